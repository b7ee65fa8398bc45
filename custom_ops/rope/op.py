"""The ``cstack::rope`` op: its argument checks, registration (CUDA, CPU, fake), autograd, and
``rope``, the function user code calls."""
import torch

from custom_ops.checks import FLOAT_DTYPES, check_like, check_tensor, require
from custom_ops.rope.cpu import torch_rope
from custom_ops.rope.triton_kernels import kernel_applies, triton_rope


def result_dtype(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype``, or by default the inputs' promoted dtype."""
    return dtype if dtype is not None else torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)


def check_rope_args(x, cos, sin, dtype) -> None:
    """Dtypes, ranks, the last dim and the tables' shapes: metadata only."""
    check_tensor("x", x, ndim=(1, 2, 3, 4), dtypes=FLOAT_DTYPES)
    width = x.shape[-1]
    require(width % 2 == 0, "x", "an even last dim (the rotated pairs)", f"shape {tuple(x.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        check_tensor(name, table, dtypes=FLOAT_DTYPES)
        check_like(name, table, "x", x, dtype=False)
        require(table.shape[-1] in (width // 2, width) and width > 0, name,
                f"a last dim of {width // 2} (one angle per pair) or {width} (one per output)",
                f"shape {tuple(table.shape)}")
        ok = table.dim() <= x.dim() and all(table.shape[d] in (1, x.shape[d]) for d in range(-table.dim(), -1))
        require(ok, name, f"a shape that broadcasts over x's leading dims {tuple(x.shape[:-1])}",
                f"shape {tuple(table.shape)}")
    require(cos.shape[-1] == sin.shape[-1], "sin", f"the last dim of cos ({cos.shape[-1]})", sin.shape[-1])
    require(dtype is None or dtype in FLOAT_DTYPES, "dtype", "None or " + " or ".join(map(str, FLOAT_DTYPES)), dtype)


@torch.library.custom_op("cstack::rope", mutates_args=(), device_types="cuda")
def rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved_in: bool, interleaved_out: bool,
            inverse: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    check_rope_args(x, cos, sin, dtype)
    rotate = triton_rope if kernel_applies(x) else torch_rope
    return rotate(x, cos, sin, interleaved_in, interleaved_out, inverse, result_dtype(x, cos, sin, dtype))


@rope_op.register_kernel("cpu")
def _rope_cpu(x, cos, sin, interleaved_in, interleaved_out, inverse, dtype=None):
    check_rope_args(x, cos, sin, dtype)
    return torch_rope(x, cos, sin, interleaved_in, interleaved_out, inverse, result_dtype(x, cos, sin, dtype))


@rope_op.register_fake
def _rope_fake(x, cos, sin, interleaved_in, interleaved_out, inverse, dtype=None):
    check_rope_args(x, cos, sin, dtype)
    return x.new_empty(x.shape, dtype=result_dtype(x, cos, sin, dtype))


def _setup_context(ctx, inputs, output):
    x, cos, sin, interleaved_in, interleaved_out, inverse, _ = inputs
    ctx.save_for_backward(cos, sin)
    ctx.layout = (interleaved_in, interleaved_out, inverse)
    ctx.x_dtype = x.dtype


def _backward(ctx, grad):
    """A rotation's adjoint is the rotation back: the same op with ``inverse`` flipped."""
    require(not (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]), "cos/sin",
            "tables that do not require grad (the op has no gradient for them)", "a table requiring grad")
    cos, sin = ctx.saved_tensors
    interleaved_in, interleaved_out, inverse = ctx.layout
    dx = torch.ops.cstack.rope(grad, cos, sin, interleaved_in, interleaved_out, not inverse, ctx.x_dtype)
    return dx, None, None, None, None, None, None


rope_op.register_autograd(_backward, setup_context=_setup_context)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved_in: bool = False,
         interleaved_out: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rotate each pair of ``x``'s last dim by the angle whose cosine and sine the tables hold.

    Pairs are (x[2i], x[2i+1]) with ``interleaved_in``, else (x[i], x[i + D/2]); the rotated pair
    lands at (2i, 2i+1) with ``interleaved_out``, else at (i, i + D/2). For a pair (a, b) going
    to output positions (p, q): out[p] = a·cos[p] − b·sin[p], out[q] = b·cos[q] + a·sin[q], where
    a table of width D is read at the output position and one of width D/2 at the pair's index.
    Tables broadcast over x's leading dims. The result is contiguous, of ``dtype`` (default: the
    promoted dtype of the inputs), computed in fp32."""
    return torch.ops.cstack.rope(x, cos, sin, interleaved_in, interleaved_out, False, dtype)
