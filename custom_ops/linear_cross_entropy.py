"""Fused LM head + cross-entropy that never builds the full [T, V] logits.

At T = 65,536 tokens and V = 151,936 the logits alone are 20 GB in bf16, so the
op walks the tokens in chunks whose logits stay under ``CHUNK_BYTES``. Per chunk:

    logits = h_chunk @ Wᵀ                       (cuBLAS, input dtype)
    row kernel, in place: logits ← (softmax − onehot(target)) · scale,
                          loss_rows ← logsumexp − logit[target]      (fp32)
    grad_hidden[chunk] = G @ W ;  grad_weight += Gᵀ @ h_chunk

so the gradients come out of the forward at the cost of the three matmuls that
any fused design needs; the backward only multiplies them by the upstream
gradient. scale is 1/count for "mean" (count of non-ignored targets, computed on
device: no host sync) and 1 for "sum"; ignored rows get zero loss and gradient.

Ops:
  * ``cstack::linear_cross_entropy_fwd(hidden, weight, targets, ignore_index,
    reduction) -> (loss, grad_hidden, grad_weight)``: the work; no autograd.
  * ``cstack::linear_cross_entropy(hidden, weight, targets, ignore_index,
    reduction) -> loss``: differentiable in hidden and weight. A
    CompositeImplicitAutograd op: under autograd (eager or AOTAutograd tracing)
    it becomes the fwd op in the forward graph and two scalar multiplies in the
    backward graph. A custom_op with register_autograd cannot do that, since its
    backward only sees the op's inputs and outputs and the gradients are neither.

Bad targets: a target outside [0, V) that is not ``ignore_index`` makes its row's
loss (and so the returned loss) and its gradient row NaN, and sets a device-side
int32 flag owned by this module (one per device, ``targets_flag(device)``: 0, or
nonzero once a call saw such a target); nothing syncs with the host. While the
flag is set, ``cstack::fused_adamw_`` (custom_ops/adamw.py) on that device skips
its whole update, so NaN gradients never reach the parameters or the moments:
on the CPU it raises the ValueError (naming ``targets``) before any update; on
CUDA its kernel reads the flag and reports the refusal as it does a bad lr/step.
Call ``check_targets_flag()`` where a sync happens anyway (after ``loss.item()``):
it raises ValueError if any call since the last check saw such a target, and
resets the flag. A bad target is reported once: whichever of the two raises
first clears the record the other keeps of it.
"""
import sys
import contextlib

import torch
from torch.utils.flop_counter import register_flop_formula
import triton
import triton.language as tl

from custom_ops.checks import FLOAT_DTYPES, check_like, check_tensor, require

CHUNK_BYTES = 5 * 2**28  # 1.25 GiB: the most one chunk of logits may take
REDUCTIONS = ("mean", "sum")

_chunk_tokens_override: int | None = None
_bad_target_flags: dict[torch.device, torch.Tensor] = {}


def chunk_tokens_for(tokens: int, vocab: int, itemsize: int) -> int:
    """Tokens per chunk: the largest power of two whose logits fit CHUNK_BYTES (capped at T)."""
    if _chunk_tokens_override is not None:
        return max(1, min(_chunk_tokens_override, tokens))
    fit = max(1, CHUNK_BYTES // (vocab * itemsize))
    return max(1, min(1 << (fit.bit_length() - 1), tokens))


@contextlib.contextmanager
def chunk_tokens(n: int):
    """Force n tokens per chunk inside the block (tests: several chunks on tiny T; benchmark sweeps)."""
    global _chunk_tokens_override
    require(isinstance(n, int) and n >= 1, "n", "a positive int", n)
    saved, _chunk_tokens_override = _chunk_tokens_override, n
    try:
        yield
    finally:
        _chunk_tokens_override = saved


def targets_flag(device: torch.device | str) -> torch.Tensor:
    """The device's bad-target flag (int32 [1], made on first use): nonzero once a call saw a
    target outside [0, V) that is not ignore_index, until a check clears it. fused_adamw_ reads it."""
    device = torch.device(device)
    flag = _bad_target_flags.get(device)
    if flag is None:
        flag = _bad_target_flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return flag



def clear_targets_flag(device: torch.device | str) -> None:
    """Reset the device's flag (no read, no sync): fused_adamw_ has reported what it recorded."""
    flag = _bad_target_flags.get(torch.device(device))
    if flag is not None:
        flag.zero_()


def check_targets_flag() -> None:
    """Raise ValueError if a call since the last check saw a bad target; reset the flags.

    Reads device memory (a host sync): call it where the step syncs anyway. A refusal that
    fused_adamw_ recorded for the same target is cleared too (it is reported here, once).
    """
    seen = False
    for flag in _bad_target_flags.values():
        seen = bool(flag.item()) or seen
        flag.zero_()
    if seen:
        adamw = sys.modules.get("custom_ops.adamw")
        if adamw is not None:
            adamw.forget_refused_targets()
        raise ValueError(
            "targets: expected values in [0, V) or ignore_index; an out-of-range target "
            "was seen since the last check (its rows' loss and gradient are NaN)"
        )


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
        block_v = min(4096, triton.next_power_of_2(V))
    require(block_v >= 16 and block_v & (block_v - 1) == 0, "block_v", "a power of two >= 16", block_v)
    if rows:
        _xent_rows_kernel[(rows,)](logits, targets, loss_rows, scale, flag, ignore_index, V=V,
                                   BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4)


def xent_rows_torch_(logits, targets, loss_rows, scale, flag, ignore_index: int):
    """Same contract as xent_rows_triton_, in plain torch with fp32 math (the CPU path)."""
    V = logits.shape[1]
    kept = targets != ignore_index
    bad = kept & ((targets < 0) | (targets >= V))
    valid = kept & (targets >= 0) & (targets < V)
    safe_targets = torch.where(valid, targets, 0)[:, None]
    x = logits.float()
    lse = torch.logsumexp(x, dim=1)
    nan = torch.full_like(lse, float("nan"))
    loss = torch.where(valid, lse - x.gather(1, safe_targets)[:, 0], 0.0)
    loss_rows.copy_(torch.where(bad, nan, loss))
    row_scale = torch.where(bad, nan, torch.where(valid, scale, 0.0))[:, None]
    g = torch.exp(x - lse[:, None]) * row_scale
    g.scatter_add_(1, safe_targets, -row_scale)
    logits.copy_(g)
    flag.bitwise_or_(bad.any())


def _check_args(hidden, weight, targets, ignore_index, reduction) -> None:
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2)
    check_like("weight", weight, "hidden", hidden)
    require(weight.shape[1] == hidden.shape[1], "weight", f"shape (V, {hidden.shape[1]}) (hidden's d)",
            tuple(weight.shape))
    require(weight.shape[0] >= 1 and weight.shape[1] >= 1, "weight", "V >= 1 and d >= 1", tuple(weight.shape))
    check_tensor("targets", targets, ndim=1, dtypes=(torch.int64,))
    check_like("targets", targets, "hidden", hidden, dtype=False)
    require(targets.shape[0] == hidden.shape[0], "targets", f"shape ({hidden.shape[0]},) (hidden's T)",
            tuple(targets.shape))
    require(isinstance(ignore_index, int), "ignore_index", "an int", type(ignore_index).__name__)
    require(reduction in REDUCTIONS, "reduction", " or ".join(map(repr, REDUCTIONS)), repr(reduction))


def fwd_chunked(hidden, weight, targets, ignore_index: int, reduction: str, rows_fn):
    """The chunk loop shared by both devices; ``rows_fn`` is the row kernel (Triton or torch).

    Matmuls run in hidden's dtype; grad_weight accumulates in weight's dtype (addmm_).
    """
    T, V = hidden.shape[0], weight.shape[0]
    targets = targets.contiguous()
    count = (targets != ignore_index).sum()
    if reduction == "mean":
        scale = 1.0 / count.float()
    else:
        scale = torch.ones((), dtype=torch.float32, device=hidden.device)
    loss_rows = torch.empty(T, dtype=torch.float32, device=hidden.device)
    grad_hidden = hidden.new_empty(hidden.shape)
    grad_weight = weight.new_zeros(weight.shape)
    flag = targets_flag(hidden.device)
    n = chunk_tokens_for(T, V, hidden.element_size())
    buf = hidden.new_empty((min(n, T), V))
    for start in range(0, T, n):
        end = min(start + n, T)
        h = hidden[start:end]
        g = buf[: end - start]
        torch.mm(h, weight.t(), out=g)
        rows_fn(g, targets[start:end], loss_rows[start:end], scale, flag, ignore_index)
        torch.mm(g, weight, out=grad_hidden[start:end])
        grad_weight.addmm_(g.t(), h)
    loss = loss_rows.sum()
    if reduction == "mean":
        loss = loss / count
    return loss.to(hidden.dtype), grad_hidden, grad_weight


@torch.library.custom_op("cstack::linear_cross_entropy_fwd", mutates_args=(), device_types="cuda")
def linear_cross_entropy_fwd(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, d loss/d hidden, d loss/d weight) of cross_entropy(hidden @ weightᵀ, targets)."""
    _check_args(hidden, weight, targets, ignore_index, reduction)
    return fwd_chunked(hidden, weight, targets, ignore_index, reduction, xent_rows_triton_)


@linear_cross_entropy_fwd.register_kernel("cpu")
def _fwd_cpu(hidden, weight, targets, ignore_index, reduction):
    _check_args(hidden, weight, targets, ignore_index, reduction)
    loss, grad_hidden, grad_weight = fwd_chunked(
        hidden.float(), weight.float(), targets, ignore_index, reduction, xent_rows_torch_
    )
    return loss.to(hidden.dtype), grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype)


@linear_cross_entropy_fwd.register_fake
def _fwd_fake(hidden, weight, targets, ignore_index, reduction):
    _check_args(hidden, weight, targets, ignore_index, reduction)
    return hidden.new_empty(()), hidden.new_empty(hidden.shape), weight.new_empty(weight.shape)


@register_flop_formula(torch.ops.cstack.linear_cross_entropy_fwd)
def _fwd_flops(hidden_shape, weight_shape, *args, **kwargs) -> int:
    """Three matmuls of 2·T·d·V: the logits, d(hidden) and d(weight)."""
    return 6 * hidden_shape[0] * hidden_shape[1] * weight_shape[0]


class _LinearCrossEntropy(torch.autograd.Function):
    """Saves the gradients the fwd op computed; the backward scales them by the upstream gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, reduction):
        loss, grad_hidden, grad_weight = torch.ops.cstack.linear_cross_entropy_fwd(
            hidden, weight, targets, ignore_index, reduction
        )
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            grad_hidden * grad_loss if ctx.needs_input_grad[0] else None,
            grad_weight * grad_loss if ctx.needs_input_grad[1] else None,
            None,
            None,
            None,
        )


_lib = torch.library.Library("cstack", "FRAGMENT")
_lib.define(
    "linear_cross_entropy(Tensor hidden, Tensor weight, Tensor targets, int ignore_index, str reduction) -> Tensor"
)


def _linear_cross_entropy_composite(hidden, weight, targets, ignore_index, reduction):
    # The fwd op (and its fake) checks the arguments, before any device work.
    return _LinearCrossEntropy.apply(hidden, weight, targets, ignore_index, reduction)


_lib.impl("linear_cross_entropy", _linear_cross_entropy_composite, "CompositeImplicitAutograd")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """cross_entropy(hidden @ weightᵀ, targets) without the full logits; hidden [..., d], targets [...]."""
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES)
    require(hidden.dim() >= 2, "hidden", "a tensor of shape [..., d] with at least 2 dims", tuple(hidden.shape))
    check_tensor("targets", targets, dtypes=(torch.int64,))
    require(targets.shape == hidden.shape[:-1], "targets", f"shape {tuple(hidden.shape[:-1])} (hidden's leading dims)",
            tuple(targets.shape))
    return torch.ops.cstack.linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), ignore_index, reduction
    )
