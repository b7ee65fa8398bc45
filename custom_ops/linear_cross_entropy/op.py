"""The ``cstack`` cross-entropy ops, their argument checks, FLOP formula and autograd, the
per-device bad-target flags, and ``linear_cross_entropy``, the function user code calls.

CUDA tensors run the chunk loop (``fwd_chunked``) with the Triton row kernel, CPU tensors
with the plain-torch one, in fp32.

Bad targets: a target outside [0, V) that is not ``ignore_index`` makes its row's
loss (and so the returned loss) and its gradient row NaN, and sets a device-side
int32 flag (one per device, ``custom_ops.flags.targets_flag(device)``: 0, or
nonzero once a call saw such a target); nothing syncs with the host. While the
flag is set, ``cstack::fused_adamw_`` (custom_ops/adamw) on that device skips
its whole update, so NaN gradients never reach the parameters or the moments:
on the CPU it raises the ValueError (naming ``targets``) before any update; on
CUDA its kernel reads the flag and reports the refusal as it does a bad lr/step.
Call ``check_targets_flag()`` where a sync happens anyway (after ``loss.item()``):
it raises ValueError if any call since the last check saw such a target, and
resets the flag. A bad target is reported once: whichever of the two raises
first clears the record the other keeps of it.
"""
from typing import Optional

import torch
from torch.utils.flop_counter import register_flop_formula

from custom_ops.checks import FLOAT_DTYPES, check_like, check_tensor, require
from custom_ops.flags import check_targets_flags, targets_flag
from custom_ops.linear_cross_entropy.configs import chunk_tokens_for
from custom_ops.linear_cross_entropy.cpu import xent_rows_torch_
from custom_ops.linear_cross_entropy.triton_kernels import xent_rows_triton_

REDUCTIONS = ("mean", "sum")

def check_targets_flag() -> None:
    """Raise ValueError if a call since the last check saw a bad target; reset the flags.

    Reads device memory (a host sync): call it where the step syncs anyway. A refusal that
    fused_adamw_ recorded for the same target is cleared too (it is reported here, once).
    """
    if check_targets_flags():
        raise ValueError(
            "targets: expected values in [0, V) or ignore_index; an out-of-range target "
            "was seen since the last check (its rows' loss and gradient are NaN)"
        )


def _check_args(hidden, weight, targets, ignore_index, reduction, bias) -> None:
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
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        check_like("bias", bias, "weight", weight)
        require(bias.shape[0] == weight.shape[0], "bias", f"shape ({weight.shape[0]},) (weight's V)",
                tuple(bias.shape))


def fwd_chunked(hidden, weight, targets, ignore_index: int, reduction: str, rows_fn, bias=None):
    """The chunk loop shared by both devices; ``rows_fn`` is the row kernel (Triton or torch).

    Matmuls run in hidden's dtype; grad_weight accumulates in weight's dtype (addmm_), grad_bias
    (the column sums of the logits' gradient; ignored rows' are 0) in fp32. Without a bias it is empty.
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
    grad_bias = torch.zeros(V if bias is not None else 0, dtype=torch.float32, device=weight.device)
    flag = targets_flag(hidden.device)
    n = chunk_tokens_for(T, V, hidden.element_size())
    buf = hidden.new_empty((min(n, T), V))
    for start in range(0, T, n):
        end = min(start + n, T)
        h = hidden[start:end]
        g = buf[: end - start]
        if bias is None:
            torch.mm(h, weight.t(), out=g)
        else:
            torch.addmm(bias, h, weight.t(), out=g)
        rows_fn(g, targets[start:end], loss_rows[start:end], scale, flag, ignore_index)
        torch.mm(g, weight, out=grad_hidden[start:end])
        grad_weight.addmm_(g.t(), h)
        if bias is not None:
            grad_bias += g.sum(0, dtype=torch.float32)
    loss = loss_rows.sum()
    if reduction == "mean":
        loss = loss / count
    return loss.to(hidden.dtype), grad_hidden, grad_weight, grad_bias.to(weight.dtype)


@torch.library.custom_op("cstack::linear_cross_entropy_fwd", mutates_args=(), device_types="cuda")
def linear_cross_entropy_fwd(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str,
    bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, d hidden, d weight, d bias) of cross_entropy(hidden @ weightᵀ + bias, targets).

    d bias is empty without a bias: a custom op's outputs cannot be None.
    """
    _check_args(hidden, weight, targets, ignore_index, reduction, bias)
    return fwd_chunked(hidden, weight, targets, ignore_index, reduction, xent_rows_triton_, bias)


@linear_cross_entropy_fwd.register_kernel("cpu")
def _fwd_cpu(hidden, weight, targets, ignore_index, reduction, bias=None):
    _check_args(hidden, weight, targets, ignore_index, reduction, bias)
    loss, grad_hidden, grad_weight, grad_bias = fwd_chunked(
        hidden.float(), weight.float(), targets, ignore_index, reduction, xent_rows_torch_,
        None if bias is None else bias.float(),
    )
    return (loss.to(hidden.dtype), grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype),
            grad_bias.to(weight.dtype))


@linear_cross_entropy_fwd.register_fake
def _fwd_fake(hidden, weight, targets, ignore_index, reduction, bias=None):
    _check_args(hidden, weight, targets, ignore_index, reduction, bias)
    grad_bias = weight.new_empty(0 if bias is None else bias.shape[0])
    return hidden.new_empty(()), hidden.new_empty(hidden.shape), weight.new_empty(weight.shape), grad_bias


@register_flop_formula(torch.ops.cstack.linear_cross_entropy_fwd)
def _fwd_flops(hidden_shape, weight_shape, *args, **kwargs) -> int:
    """Three matmuls of 2·T·d·V: the logits, d(hidden) and d(weight); the bias's add and sum are no matmul."""
    return 6 * hidden_shape[0] * hidden_shape[1] * weight_shape[0]


class _LinearCrossEntropy(torch.autograd.Function):
    """Saves the gradients the fwd op computed; the backward scales them by the upstream gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, reduction, bias):
        loss, *grads = torch.ops.cstack.linear_cross_entropy_fwd(hidden, weight, targets, ignore_index, reduction,
                                                                 bias)
        ctx.save_for_backward(*grads)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        needs = ctx.needs_input_grad
        return (
            grad_hidden * grad_loss if needs[0] else None,
            grad_weight * grad_loss if needs[1] else None,
            None,
            None,
            None,
            grad_bias * grad_loss if needs[5] else None,
        )


_lib = torch.library.Library("cstack", "FRAGMENT")
_lib.define(
    "linear_cross_entropy(Tensor hidden, Tensor weight, Tensor targets, int ignore_index, str reduction, "
    "Tensor? bias=None) -> Tensor"
)


def _linear_cross_entropy_composite(hidden, weight, targets, ignore_index, reduction, bias=None):
    # The fwd op (and its fake) checks the arguments, before any device work.
    return _LinearCrossEntropy.apply(hidden, weight, targets, ignore_index, reduction, bias)


_lib.impl("linear_cross_entropy", _linear_cross_entropy_composite, "CompositeImplicitAutograd")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """cross_entropy(hidden @ weightᵀ + bias, targets) without the full logits; hidden [..., d], targets [...]."""
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES)
    require(hidden.dim() >= 2, "hidden", "a tensor of shape [..., d] with at least 2 dims", tuple(hidden.shape))
    check_tensor("targets", targets, dtypes=(torch.int64,))
    require(targets.shape == hidden.shape[:-1], "targets", f"shape {tuple(hidden.shape[:-1])} (hidden's leading dims)",
            tuple(targets.shape))
    return torch.ops.cstack.linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), ignore_index, reduction, bias
    )
