"""The Triton row kernel of the fused cross-entropy and its launcher ``xent_rows_triton_``.

It runs on any CUDA GPU, and on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests
check it). The matmuls around it are cuBLAS's (``op.fwd_chunked``).
"""
import torch
import triton
import triton.language as tl

from custom_ops.checks import FLOAT_DTYPES, check_like, check_tensor, require
from custom_ops.linear_cross_entropy.configs import block_v_for, num_warps_for


@triton.jit
def _xent_rows_kernel(logits_ptr, targets_ptr, loss_ptr, scale_ptr, flag_ptr, ignore_index,
                      V: tl.constexpr, BLOCK_V: tl.constexpr):
    # V is constexpr: one compile per vocabulary, constant trip counts, and the CPU
    # interpreter (NumPy 2) cannot take a runtime scalar as a range() bound.
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * V
    cols = tl.arange(0, BLOCK_V)

    target = tl.load(targets_ptr + row)
    kept = target != ignore_index
    bad = kept & ((target < 0) | (target >= V))
    valid = kept & (target >= 0) & (target < V)

    # pass 1: running max and sum of exp over V, in fp32
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK_V):
        x = tl.load(row_ptr + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)

    x_target = tl.load(row_ptr + target, mask=valid, other=0.0).to(tl.float32)
    loss = tl.where(valid, lse - x_target, 0.0)
    row_scale = tl.where(valid, tl.load(scale_ptr), 0.0)
    tl.store(loss_ptr + row, tl.where(bad, float("nan"), loss))
    tl.store(flag_ptr, 1, mask=bad)
    row_scale = tl.where(bad, float("nan"), row_scale)

    # pass 2: overwrite the row with its logits' gradient
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        x = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) * row_scale - tl.where(offs == target, row_scale, 0.0)
        tl.store(row_ptr + offs, g.to(logits_ptr.dtype.element_ty), mask=mask)


def xent_rows_triton_(logits, targets, loss_rows, scale, flag, ignore_index: int, block_v: int | None = None):
    """In place, per row i: logits[i] ← (softmax − onehot(targets[i])) · scale, loss_rows[i] ← lse − logit.

    Rows whose target is ignore_index get 0; rows with a target outside [0, V) get NaN and set flag.
    """
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    require(logits.is_contiguous(), "logits", "a contiguous tensor", f"strides {logits.stride()}")
    check_tensor("targets", targets, ndim=1, dtypes=(torch.int64,))
    require(targets.is_contiguous() and targets.shape[0] == logits.shape[0], "targets",
            f"a contiguous tensor of shape ({logits.shape[0]},)", tuple(targets.shape))
    check_tensor("loss_rows", loss_rows, ndim=1, dtypes=(torch.float32,))
    require(loss_rows.is_contiguous() and loss_rows.shape[0] == logits.shape[0], "loss_rows",
            f"a contiguous tensor of shape ({logits.shape[0]},)", tuple(loss_rows.shape))
    check_tensor("scale", scale, ndim=0, dtypes=(torch.float32,))
    check_tensor("flag", flag, ndim=1, dtypes=(torch.int32,))
    for arg, t in (("targets", targets), ("loss_rows", loss_rows), ("scale", scale), ("flag", flag)):
        check_like(arg, t, "logits", logits, dtype=False)
    rows, V = logits.shape
    if block_v is None:
        block_v = block_v_for(V)
    require(block_v >= 16 and block_v & (block_v - 1) == 0, "block_v", "a power of two >= 16", block_v)
    if rows:
        _xent_rows_kernel[(rows,)](logits, targets, loss_rows, scale, flag, ignore_index, V=V,
                                   BLOCK_V=block_v, num_warps=num_warps_for(block_v))
