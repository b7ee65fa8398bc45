"""What the Hopper (sm_90) Gluon kernels share: the dispatch rule, a program's head, and the
tensor descriptors the launchers build.

The kernels: a warp-specialized forward (``gluon_forward.hopper_fwd``) and a one-pass backward
(``gluon_backward.hopper_bwd``: five tile matmuls per tile pair where the two Triton kernels need
seven). The CUDA ops run them on the inputs ``uses_hopper_kernels`` accepts (16-bit, D = 64 or
128, whole 128-row tiles); docs/decisions.md has the figures. q and k are read dense; v and dO dense
or sequence-major (``layouts``: heads split off a projection, or the gradient of such an output),
in place, with out and dv written in v's layout.
"""
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

from custom_ops.attention.configs import HOPPER_BWD, HOPPER_FWD, HOPPER_HEAD_DIMS
from custom_ops.attention.layouts import is_sequence_major
from custom_ops.attention.triton_kernels import _as_4d


@gluon.jit
def _this_head():
    """This program's (batch·head, batch, head): the grids are (tiles, H, Z)."""
    h = gl.program_id(1)
    z = gl.program_id(2)
    return z * gl.num_programs(1) + h, z, h


@gluon.jit
def _head_origin(z, h, S, HEAD_D: gl.constexpr, SEQUENCE_MAJOR: gl.constexpr):
    """Where row 0 of head (z, h) sits in its descriptor's 2-d view (``_rows_desc``): ((z·H + h)·S, 0)
    heads-major, (z·S, h·D) sequence-major."""
    if SEQUENCE_MAJOR:
        row = z * S
        col = h * HEAD_D
    else:
        row = (z * gl.num_programs(1) + h) * S
        col = h * 0
    return row, col


def uses_hopper_kernels(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the CUDA ops run the Gluon kernels (``hopper_fwd``, ``hopper_bwd``) on these inputs
    (``hopper_kernels_accept``); every other input takes the Triton ones."""
    return q.is_cuda and hopper_kernels_accept(torch.cuda.get_device_capability(q.device), q.shape[-1], q.dtype,
                                               q.shape[-2], k.shape[-2])


def hopper_kernels_accept(capability: tuple[int, int], head_dim: int, dtype: torch.dtype, sq: int, sk: int) -> bool:
    """The dispatch rule, apart from the device so CPU tests can check it: an sm_90 GPU exactly (the
    kernels use wgmma, which sm_100 and older GPUs lack), D = 64 or 128, 16-bit, Sq and Sk in whole
    128-row tiles."""
    if capability != (9, 0) or head_dim not in HOPPER_HEAD_DIMS or dtype not in (torch.bfloat16, torch.float16):
        return False
    bwd = HOPPER_BWD[head_dim]
    tile = math.lcm(HOPPER_FWD.block_m, HOPPER_FWD.block_n, bwd.block_m, bwd.block_n)
    return sq % tile == 0 and sk % tile == 0


_GLUON_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


def _rows_desc(t: torch.Tensor, rows: int) -> GluonTensorDescriptor:
    """A Gluon descriptor of [rows, D] tiles of a [Z, H, S, D] tensor: heads-major seen as
    [Z·H·S, D], sequence-major as [Z·S, H·D] (``_head_origin`` finds a head's rows in either)."""
    flat = t.transpose(1, 2).view(-1, t.shape[1] * t.shape[-1]) if is_sequence_major(t) else t.view(-1, t.shape[-1])
    layout = gl.NVMMASharedLayout.get_default_for([rows, t.shape[-1]], _GLUON_DTYPES[t.dtype])
    return GluonTensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, t.shape[-1]], layout)


def _in_place_or_dense(t: torch.Tensor) -> torch.Tensor:
    """v or dO as 4-d: read in place if sequence-major (the kernels take either layout for them,
    and lay out and dv out like v), else copied dense. q and k are always copied dense."""
    t4 = _as_4d(t)
    return t4 if is_sequence_major(t4) else t4.contiguous()
