"""The rotation as one Triton kernel: each program rotates BLOCK_ROWS vectors of the last dim.

A vector is loaded whole (contiguous, vectorised) and its pairs are separated in registers
(``tl.reshape`` + ``tl.split`` for neighbouring pairs, two half loads for pairs D/2 apart);
Inductor's code for the same math loads each member with its own strided, masked load and runs
at about half the memory's rate (docs/decisions.md). Rows may be strided over up to three leading
dims (a view of a projection's output, a broadcast table); the result is written contiguous.
Runs on any CUDA GPU and, under ``TRITON_INTERPRET=1``, on CPU tensors.
"""
import torch
import triton
import triton.language as tl

from custom_ops.rope.configs import BLOCK_ROWS, NUM_WARPS


@triton.jit
def _load_pairs(ptr, rows, mask, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    if INTERLEAVED:
        cols = tl.arange(0, 2 * HALF)
        whole = tl.load(ptr + rows[:, None] + cols[None, :], mask=mask[:, None]).to(tl.float32)
        return tl.split(tl.reshape(whole, (rows.shape[0], HALF, 2)))
    cols = tl.arange(0, HALF)
    a = tl.load(ptr + rows[:, None] + cols[None, :], mask=mask[:, None]).to(tl.float32)
    b = tl.load(ptr + rows[:, None] + HALF + cols[None, :], mask=mask[:, None]).to(tl.float32)
    return a, b


@triton.jit
def _store_pairs(ptr, rows, mask, a, b, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    a = a.to(ptr.dtype.element_ty)
    b = b.to(ptr.dtype.element_ty)
    if INTERLEAVED:
        cols = tl.arange(0, 2 * HALF)
        whole = tl.reshape(tl.join(a, b), (rows.shape[0], 2 * HALF))
        tl.store(ptr + rows[:, None] + cols[None, :], whole, mask=mask[:, None])
    else:
        cols = tl.arange(0, HALF)
        tl.store(ptr + rows[:, None] + cols[None, :], a, mask=mask[:, None])
        tl.store(ptr + rows[:, None] + HALF + cols[None, :], b, mask=mask[:, None])


@triton.jit
def _row_offsets(r, n1, n2, s0, s1, s2):
    """Offsets of rows ``r`` (flat over three leading dims of sizes [*, n1, n2]) with strides s0, s1, s2."""
    i2 = r % n2
    i1 = (r // n2) % n1
    i0 = r // (n2 * n1)
    return i0.to(tl.int64) * s0 + i1.to(tl.int64) * s1 + i2.to(tl.int64) * s2


@triton.jit
def _table_pairs(ptr, rows, mask, HALF: tl.constexpr, FULL: tl.constexpr, INTERLEAVED_OUT: tl.constexpr):
    """A table's values for each pair's two outputs: per output position (full width) or per pair."""
    if FULL:
        return _load_pairs(ptr, rows, mask, HALF, INTERLEAVED_OUT)
    cols = tl.arange(0, HALF)
    t = tl.load(ptr + rows[:, None] + cols[None, :], mask=mask[:, None]).to(tl.float32)
    return t, t


@triton.jit
def _rope_kernel(src, cos, sin, dst, n_rows, n1, n2,
                 src_s0, src_s1, src_s2, cos_s0, cos_s1, cos_s2, sin_s0, sin_s1, sin_s2,
                 HALF: tl.constexpr, FULL_TABLE: tl.constexpr, INTERLEAVED_IN: tl.constexpr,
                 INTERLEAVED_OUT: tl.constexpr, INVERSE: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = r < n_rows
    src_rows = _row_offsets(r, n1, n2, src_s0, src_s1, src_s2)
    dst_rows = r.to(tl.int64) * (2 * HALF)
    c_a, c_b = _table_pairs(cos, _row_offsets(r, n1, n2, cos_s0, cos_s1, cos_s2), mask, HALF, FULL_TABLE,
                            INTERLEAVED_OUT)
    s_a, s_b = _table_pairs(sin, _row_offsets(r, n1, n2, sin_s0, sin_s1, sin_s2), mask, HALF, FULL_TABLE,
                            INTERLEAVED_OUT)
    if not INVERSE:
        first, second = _load_pairs(src, src_rows, mask, HALF, INTERLEAVED_IN)
        _store_pairs(dst, dst_rows, mask, first * c_a - second * s_a, second * c_b + first * s_b, HALF,
                     INTERLEAVED_OUT)
    else:
        g_a, g_b = _load_pairs(src, src_rows, mask, HALF, INTERLEAVED_OUT)
        _store_pairs(dst, dst_rows, mask, g_a * c_a + g_b * s_b, g_b * c_b - g_a * s_a, HALF, INTERLEAVED_IN)


def _leading3(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """Sizes and strides of ``t``'s leading dims (all but the last), padded in front to three."""
    sizes, strides = list(t.shape[:-1]), list(t.stride()[:-1])
    return [1] * (3 - len(sizes)) + sizes, [0] * (3 - len(strides)) + strides


def kernel_takes(shape) -> bool:
    """Whether the kernel takes an x of ``shape``: at most three leading dims, D/2 a power of two
    (a register tile of the vector), D at most 1024."""
    half = shape[-1] // 2
    return len(shape) <= 4 and half >= 1 and half & (half - 1) == 0 and shape[-1] <= 1024


def kernel_applies(x: torch.Tensor) -> bool:
    """Whether the CUDA op runs the kernel on ``x`` (else the plain-torch rotation)."""
    return x.is_cuda and kernel_takes(x.shape)


def triton_rope(x, cos, sin, interleaved_in: bool, interleaved_out: bool, inverse: bool,
                dtype: torch.dtype) -> torch.Tensor:
    width = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    tables = []
    for t in (cos, sin):  # made dense before the broadcast, which stays a view
        t = t if t.stride(-1) == 1 else t.contiguous()
        tables.append(t.broadcast_to(*x.shape[:-1], t.shape[-1]))
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    (_, n1, n2), src_strides = _leading3(x)
    rows = x.numel() // width
    if rows == 0:
        return out
    (_, cos_strides), (_, sin_strides) = _leading3(tables[0]), _leading3(tables[1])
    _rope_kernel[(triton.cdiv(rows, BLOCK_ROWS),)](
        x, tables[0], tables[1], out, rows, n1, n2, *src_strides, *cos_strides, *sin_strides,
        HALF=width // 2, FULL_TABLE=tables[0].shape[-1] == width, INTERLEAVED_IN=interleaved_in,
        INTERLEAVED_OUT=interleaved_out, INVERSE=inverse, BLOCK=BLOCK_ROWS, num_warps=NUM_WARPS)
    return out
