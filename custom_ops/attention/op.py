"""The ``cstack`` attention ops, their argument checks, autograd and FLOP formulas, and
``flash_attention``, the function user code calls.

    torch.ops.cstack.flash_attention_fwd(q, k, v, is_causal, scale) -> (out, lse)
    torch.ops.cstack.flash_attention_bwd(dout, q, k, v, out, lse, is_causal, scale) -> (dq, dk, dv)

out and dv are laid out like v (``layouts``: sequence-major when v was split off a [B, S, H·D]
projection, so heads merge after attention without a copy); lse, dq and dk are contiguous.
CPU tensors run ``torch_fwd`` / ``torch_bwd``; CUDA tensors the Gluon kernels where
``uses_hopper_kernels`` accepts the inputs, else the Triton ones. The implementations are looked
up on the ``custom_ops.attention`` package when the op runs, so what is wrapped there (tests
wrap ``torch_fwd`` to see the layouts the ops are handed) is what the op calls.
"""
import math
import numbers

import torch
from torch.utils.flop_counter import register_flop_formula

from custom_ops import attention as impl  # the package, still importing: read only at call time
from custom_ops.attention.configs import HEAD_DIMS
from custom_ops.attention.layouts import empty_like_v
from custom_ops.checks import FLOAT_DTYPES, check_like, check_tensor, require


def check_attention_args(q, k, v, is_causal, scale) -> None:
    """Validate the arguments shared by both ops; raises ValueError naming the bad one."""
    check_tensor("q", q, ndim=(3, 4), dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=q.dim(), dtypes=FLOAT_DTYPES)
    check_tensor("v", v, ndim=q.dim(), dtypes=FLOAT_DTYPES)
    check_like("k", k, "q", q)
    check_like("v", v, "q", q)
    lead = tuple(q.shape[:-2])
    require(tuple(k.shape[:-2]) == lead, "k", f"batch/head dims {lead} (those of q)", tuple(k.shape[:-2]))
    require(tuple(v.shape[:-2]) == lead, "v", f"batch/head dims {lead} (those of q)", tuple(v.shape[:-2]))
    require(q.shape[-1] in HEAD_DIMS, "q", f"head dim D in {HEAD_DIMS} (at most 256)", q.shape[-1])
    require(k.shape[-1] == q.shape[-1], "k", f"head dim {q.shape[-1]} (that of q)", k.shape[-1])
    require(v.shape[-1] == q.shape[-1], "v", f"head dim {q.shape[-1]} (that of q)", v.shape[-1])
    require(v.shape[-2] == k.shape[-2], "v", f"Sk = {k.shape[-2]} keys (that of k)", v.shape[-2])
    require(q.shape[-2] >= 1, "q", "at least one query (Sq >= 1)", q.shape[-2])
    require(k.shape[-2] >= 1, "k", "at least one key (Sk >= 1)", k.shape[-2])
    require(isinstance(is_causal, bool), "is_causal", "a bool", type(is_causal).__name__)
    require(not is_causal or q.shape[-2] == k.shape[-2], "is_causal",
            "Sq == Sk for causal attention", f"Sq={q.shape[-2]}, Sk={k.shape[-2]}")
    require(isinstance(scale, float) and math.isfinite(scale) and scale > 0, "scale",
            "a finite positive float", scale)


def check_bwd_args(dout, q, k, v, out, lse, is_causal, scale) -> None:
    check_attention_args(q, k, v, is_causal, scale)
    for name, t in (("dout", dout), ("out", out)):
        check_tensor(name, t, ndim=q.dim())
        check_like(name, t, "q", q)
        require(t.shape == q.shape, name, f"shape {tuple(q.shape)} (that of q)", tuple(t.shape))
    check_tensor("lse", lse, dtypes=(torch.float32,))
    check_like("lse", lse, "q", q, dtype=False)
    require(lse.shape == q.shape[:-1], "lse", f"shape {tuple(q.shape[:-1])}", tuple(lse.shape))


@torch.library.custom_op("cstack::flash_attention_fwd", mutates_args=(), device_types="cuda")
def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_attention_args(q, k, v, is_causal, scale)
    forward = impl.hopper_fwd if impl.uses_hopper_kernels(q, k) else impl.triton_fwd
    return forward(q, k, v, is_causal, scale)


@flash_attention_fwd.register_kernel("cpu")
def _fwd_cpu(q, k, v, is_causal, scale):
    check_attention_args(q, k, v, is_causal, scale)
    return impl.torch_fwd(q, k, v, is_causal, scale)


@flash_attention_fwd.register_fake
def _fwd_fake(q, k, v, is_causal, scale):
    check_attention_args(q, k, v, is_causal, scale)
    return empty_like_v(q.shape, q.dtype, v), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("cstack::flash_attention_bwd", mutates_args=(), device_types="cuda")
def flash_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_bwd_args(dout, q, k, v, out, lse, is_causal, scale)
    backward = impl.hopper_bwd if impl.uses_hopper_kernels(q, k) else impl.triton_bwd
    return backward(dout, q, k, v, out, lse, is_causal, scale)


@flash_attention_bwd.register_kernel("cpu")
def _bwd_cpu(dout, q, k, v, out, lse, is_causal, scale):
    check_bwd_args(dout, q, k, v, out, lse, is_causal, scale)
    return impl.torch_bwd(dout, q, k, v, out, lse, is_causal, scale)


@flash_attention_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, is_causal, scale):
    check_bwd_args(dout, q, k, v, out, lse, is_causal, scale)
    return q.new_empty(q.shape), k.new_empty(k.shape), empty_like_v(v.shape, v.dtype, v)


def _setup_context(ctx, inputs, output):
    q, k, v, is_causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.cstack.flash_attention_bwd(dout, q, k, v, out, lse, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None


flash_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention_flops(q_shape, k_shape, is_causal: bool) -> int:
    """Forward FLOPs: QKᵀ and PV, 2·Sq·Sk·D each per head; half of it under a causal mask."""
    *batch, sq, d = q_shape
    flops = 4 * math.prod(batch) * sq * k_shape[-2] * d
    return flops // 2 if is_causal else flops


# FLOP formulas let FLOP counters, and the partitioner's runtime estimate, see what
# recomputing attention would cost (without them the op looks free to recompute).
@register_flop_formula(torch.ops.cstack.flash_attention_fwd)
def _fwd_flops(q_shape, k_shape, v_shape, is_causal, scale, *args, **kwargs) -> int:
    return attention_flops(q_shape, k_shape, is_causal)


@register_flop_formula(torch.ops.cstack.flash_attention_bwd)
def _bwd_flops(dout_shape, q_shape, k_shape, *args, **kwargs) -> int:
    is_causal = args[3]  # after v, out, lse
    return 5 * attention_flops(q_shape, k_shape, is_causal) // 2


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True,
                    scale: float | None = None) -> torch.Tensor:
    """softmax(scale * q @ k^T, causally masked if is_causal) @ v; scale defaults to 1/sqrt(D).

    A zero batch or head dim gives an empty result (and empty gradients) on every path;
    Sq or Sk of 0 is refused."""
    check_tensor("q", q, ndim=(3, 4), dtypes=FLOAT_DTYPES)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    else:
        require(isinstance(scale, numbers.Real) and not isinstance(scale, bool), "scale",
                "a finite positive float or None", repr(scale))
        scale = float(scale)
    check_attention_args(q, k, v, is_causal, scale)
    return torch.ops.cstack.flash_attention_fwd(q, k, v, is_causal, scale)[0]
