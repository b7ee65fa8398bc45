"""Argument checks shared by the custom ops.

Every op validates its inputs on the host before any kernel launches, and a
bad argument raises a ValueError that names the argument and says what was
expected, instead of a Triton or CUDA error deep in a launch.
"""
from collections.abc import Iterable

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def require(ok: bool, arg: str, expected: str, got: object) -> None:
    """Raise ValueError('<arg>: expected <expected>, got <got>') unless ok."""
    if not ok:
        raise ValueError(f"{arg}: expected {expected}, got {got}")


def check_tensor(
    arg: str,
    t: object,
    *,
    ndim: int | Iterable[int] | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
) -> None:
    """Check that ``t`` is a tensor of an allowed rank and dtype."""
    require(isinstance(t, torch.Tensor), arg, "a torch.Tensor", type(t).__name__)
    if ndim is not None:
        ranks = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        require(t.dim() in ranks, arg, f"a tensor of rank {' or '.join(map(str, ranks))}", f"rank {t.dim()}")
    if dtypes is not None:
        allowed = tuple(dtypes)
        require(t.dtype in allowed, arg, "dtype " + " or ".join(str(d) for d in allowed), t.dtype)


def check_like(arg: str, t: torch.Tensor, ref_arg: str, ref: torch.Tensor, *, dtype: bool = True) -> None:
    """Check that ``t`` lives on the same device as ``ref`` (and has its dtype)."""
    require(t.device == ref.device, arg, f"the device of {ref_arg} ({ref.device})", t.device)
    if dtype:
        require(t.dtype == ref.dtype, arg, f"the dtype of {ref_arg} ({ref.dtype})", t.dtype)


def runs_triton(t: torch.Tensor) -> bool:
    """Whether ops on ``t`` run their Triton kernels (CUDA tensors) or the torch CPU path."""
    return t.device.type == "cuda"
