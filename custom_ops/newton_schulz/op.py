"""The ``cstack::newton_schulz`` op, its argument checks, and ``zeropower``, Muon's whole
orthogonalisation for code that calls us directly.

CUDA tensors run the Triton kernels (``triton_kernels``) on GPUs with TMA (compute capability
9.0 and up: their tiles are read through tensor descriptors), ``cpu.iterate`` (plain torch) on
older GPUs and on CPU tensors. The op
takes X with any strides (the kernels copy it into their padded row-major buffers when its
layout cannot back a TMA descriptor) and returns a new contiguous tensor. It is not
differentiable: optimizers call it under no_grad, and a backward through it raises.
"""
import math

import torch

from custom_ops.checks import check_tensor, require, runs_triton
from custom_ops.newton_schulz.cpu import iterate
from custom_ops.newton_schulz.triton_kernels import newton_schulz_triton

# Muon's quintic (Keller Jordan's coefficients): maps every singular value of a normalised
# matrix into roughly [0.7, 1.2] in five steps.
MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_scalars(steps, a, b, c, names=("a", "b", "c")) -> None:
    require(isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1, "steps", "an int >= 1", steps)
    for name, v in zip(names, (a, b, c)):
        require(_is_number(v) and math.isfinite(v), name, "a finite float", v)


def _check(X, steps, a, b, c) -> None:
    check_tensor("X", X, ndim=(2, 3), dtypes=(torch.bfloat16,))
    _check_scalars(steps, a, b, c)


@torch.library.custom_op("cstack::newton_schulz", mutates_args=(), device_types="cuda")
def newton_schulz(X: torch.Tensor, steps: int, a: float, b: float, c: float) -> torch.Tensor:
    """``steps`` iterations A = X Xᵀ; B = b·A + c·A²; X ← a·X + B·X of bf16 X ([m, n] or
    [batch, m, n]) as given (no normalisation), on Xᵀ when m > n; a new contiguous tensor."""
    _check(X, steps, a, b, c)
    require(runs_triton(X), "X", "a CUDA tensor", X.device)
    require(X.dim() == 2 or X.size(0) <= 65535, "X", "at most 65,535 matrices (a CUDA grid dimension)",
            f"{X.size(0)}")
    if torch.cuda.get_device_capability(X.device) < (9, 0):
        return iterate(X, steps, a, b, c)
    return newton_schulz_triton(X, steps, a, b, c)


@newton_schulz.register_kernel("cpu")
def _newton_schulz_cpu(X, steps, a, b, c):
    _check(X, steps, a, b, c)
    return iterate(X, steps, a, b, c)


@newton_schulz.register_fake
def _newton_schulz_fake(X, steps, a, b, c):
    _check(X, steps, a, b, c)
    return X.new_empty(X.shape)


def _no_backward(ctx, grad):
    raise RuntimeError("cstack::newton_schulz has no backward: it orthogonalises optimizer updates, "
                       "under torch.no_grad(); detach X before calling it")


newton_schulz.register_autograd(_no_backward)


def zeropower(G: torch.Tensor, steps: int = 5, coefficients=MUON_COEFFICIENTS, eps: float = 1e-7) -> torch.Tensor:
    """Muon's orthogonalisation of G ([m, n] or [batch, m, n], any float dtype): cast to bf16,
    transpose when m > n, divide each matrix by its Frobenius norm + eps, ``steps`` Newton–Schulz
    iterations (the op), transpose back. Returns bf16 of G's shape."""
    check_tensor("G", G, ndim=(2, 3), dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64))
    require(isinstance(coefficients, (tuple, list)) and len(coefficients) == 3, "coefficients",
            "a tuple (a, b, c)", coefficients)
    require(_is_number(eps) and math.isfinite(eps) and eps >= 0, "eps", "a finite float >= 0", eps)
    _check_scalars(steps, *coefficients, names=[f"coefficients[{i}]" for i in range(3)])
    a, b, c = (float(v) for v in coefficients)
    X = G.bfloat16()
    transposed = X.size(-2) > X.size(-1)
    X = X.mT if transposed else X
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    X = torch.ops.cstack.newton_schulz(X, steps, a, b, c)
    return X.mT if transposed else X
