"""FlashAttention (forward + two-kernel backward) as the ``cstack`` custom ops.

    torch.ops.cstack.flash_attention_fwd(q, k, v, is_causal, scale) -> (out, lse)
    torch.ops.cstack.flash_attention_bwd(dout, q, k, v, out, lse, is_causal, scale) -> (dq, dk, dv)

q is ``[B, H, Sq, D]`` or ``[N, Sq, D]``, k and v ``[..., Sk, D]``. ``lse`` is the fp32
natural-log row log-sum-exp of ``scale * q @ k^T`` (masked); the backward recomputes the
probabilities from it, so nothing of size Sq x Sk is ever stored.

CUDA tensors run the Triton kernels below; CPU tensors run a plain-torch version that
works in fp32 on chunks of queries. The Triton launchers (``triton_fwd``, ``triton_bwd``)
also run on CPU tensors under ``TRITON_INTERPRET=1``, which is how the tests check them.
On Hopper, 16-bit D=128 attention over whole 128-row tiles (the 8B model's) runs instead as
Gluon kernels (``uses_hopper_kernels``): a warp-specialized forward (``hopper_fwd``, 16%
faster than the Triton one at one rank's shape) and a one-pass backward (``hopper_bwd``: five
tile matmuls per tile pair where the two Triton kernels need seven: 42.6 ms at one rank's
shape against their 54-56, and cuDNN's 40.8). BENCHMARKS.md has the figures.
"""
import math
import numbers
import os
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import register_flop_formula
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from custom_ops.checks import FLOAT_DTYPES, check_like, check_tensor, require

HEAD_DIMS = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Tiles:
    """One kernel's launch shape: a query tile, a key tile, warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class AttnConfig:
    """Tiles of the forward kernel and of the two backward kernels (dK/dV and dQ)."""

    fwd: Tiles
    dkdv: Tiles
    dq: Tiles


# Hopper (sm_90) configs keyed by (head dim, dtype). Fixed on purpose: autotuning would
# cost compile time the whole-step budget does not have. The D=64 and D=128 16-bit rows
# are the winners of `benchmarks/bench_attention.py --sweep` on an H200 (causal bf16,
# shapes b and a there, re-run with TMA loads: D=128's forward 256 x 64 beat 128 x 128 by
# 10%; its dQ kept 3 stages, 4 measured 2% slower); the other rows are untimed guesses.
_SM90_16BIT = {
    16: AttnConfig(Tiles(128, 64, 4, 3), Tiles(32, 128, 4, 3), Tiles(128, 64, 4, 3)),
    32: AttnConfig(Tiles(128, 64, 4, 3), Tiles(32, 128, 4, 3), Tiles(128, 64, 4, 3)),
    64: AttnConfig(Tiles(128, 64, 8, 3), Tiles(32, 128, 4, 3), Tiles(128, 64, 8, 4)),
    128: AttnConfig(Tiles(256, 64, 8, 3), Tiles(64, 128, 8, 3), Tiles(128, 64, 8, 3)),
    256: AttnConfig(Tiles(64, 64, 4, 2), Tiles(32, 64, 4, 2), Tiles(64, 32, 4, 2)),
}
_SM90_FP32 = {
    16: AttnConfig(Tiles(64, 32, 4, 2), Tiles(32, 64, 4, 2), Tiles(64, 32, 4, 2)),
    32: AttnConfig(Tiles(64, 32, 4, 2), Tiles(32, 64, 4, 2), Tiles(64, 32, 4, 2)),
    64: AttnConfig(Tiles(64, 32, 4, 2), Tiles(32, 64, 4, 2), Tiles(64, 32, 4, 2)),
    128: AttnConfig(Tiles(64, 32, 4, 2), Tiles(32, 64, 4, 1), Tiles(64, 32, 4, 1)),
    256: AttnConfig(Tiles(32, 32, 4, 1), Tiles(16, 32, 4, 1), Tiles(32, 16, 4, 1)),
}
CONFIGS = {
    **{(d, dt): cfg for dt in (torch.bfloat16, torch.float16) for d, cfg in _SM90_16BIT.items()},
    **{(d, torch.float32): cfg for d, cfg in _SM90_FP32.items()},
}
# Under the interpreter: small tiles, with unequal query/key tiles so tests cover that.
INTERPRETER_CONFIG = AttnConfig(Tiles(32, 16, 4, 1), Tiles(16, 32, 4, 1), Tiles(32, 16, 4, 1))
DELTA_BLOCK_M = 64

LOG2E = 1.4426950408889634  # host copy, folded into qk_scale
_LOG2E = tl.constexpr(LOG2E)  # kernel copies
_LN2 = tl.constexpr(0.6931471805599453)


def pick_config(head_dim: int, dtype: torch.dtype) -> AttnConfig:
    """The tile table entry for this head dim and dtype (tiny tiles under the interpreter)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return INTERPRETER_CONFIG
    return CONFIGS[(head_dim, dtype)]


# --------------------------------------------------------------------------- kernels
#
# Every tile of q, k, v, dO and O is read through a TMA tensor descriptor over the
# [Z, H, S, D] tensor: the copy engine does the address arithmetic and the bounds (rows
# past S read as zeros), which measured 4-10% faster than pointer loads on the H200
# (BENCHMARKS.md). Outputs are fresh contiguous tensors, written with masked stores.


@triton.jit
def _tile(desc, z, h, start, ROWS: tl.constexpr, HEAD_D: tl.constexpr):
    """Rows [start, start + ROWS) of head (z, h); rows past the tensor's end read as zeros."""
    return desc.load([z, h, start, 0]).reshape(ROWS, HEAD_D)


@triton.jit
def _query_tile(H, BLOCK_M: tl.constexpr):
    """This program's (batch·head, batch, head, first query row). Axis 0 is (batch, head) and
    axis 1 runs the query tiles last first, so every head's largest causal tile starts first."""
    zh = tl.program_id(0)
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    return zh, zh // H, zh % H, start_m


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_desc, v_desc, z, h, rows, offs_n, lo, hi, SK, qk_scale,
               BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr):
    """Online softmax over key tiles [lo, hi). MASK: 0 none, 1 causal diagonal, 2 key bound."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _tile(k_desc, z, h, start_n, BLOCK_N, HEAD_D)
        v = _tile(v_desc, z, h, start_n, BLOCK_N, HEAD_D)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        if MASK == 1:
            s = tl.where(rows[:, None] >= cols[None, :], s, float("-inf"))
        if MASK == 2:
            s = tl.where(cols[None, :] < SK, s, float("-inf"))
        # Scores stay unscaled; scale*log2(e) is folded into the exp2 argument.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(q_desc, k_desc, v_desc, O, LSE, qk_scale, H, SQ, SK,
                     IS_CAUSAL: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    zh, z, h, start_m = _query_tile(H, BLOCK_M)
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    row_ok = rows < SQ
    q = _tile(q_desc, z, h, start_m, BLOCK_M, HEAD_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    # Key tiles [0, split) need no mask. Causal: split is the diagonal's first tile and tiles past
    # the query tile's last row are never touched; else split is the last whole tile of SK.
    split = (start_m // BLOCK_N) * BLOCK_N if IS_CAUSAL else (SK // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_desc, v_desc, z, h, rows, offs_n, 0, split, SK, qk_scale,
                               BLOCK_N, HEAD_D, 0, PREC)
    hi = tl.minimum(start_m + BLOCK_M, SK) if IS_CAUSAL else SK
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_desc, v_desc, z, h, rows, offs_n, split, hi, SK, qk_scale,
                               BLOCK_N, HEAD_D, 1 if IS_CAUSAL else 2, PREC)
    out = acc / l_i[:, None]
    row_base = zh.to(tl.int64) * SQ
    tl.store(O + (row_base + rows[:, None]) * HEAD_D + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(LSE + row_base + rows, (m_i + tl.math.log2(l_i)) * _LN2, mask=row_ok)


@triton.jit
def _attn_bwd_delta_kernel(o_desc, do_desc, LSE, DELTA, H, SQ, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                           WITH_LSE: tl.constexpr):
    """delta = rowsum(dO * O), the softmax-backward correction, once per query row. WITH_LSE
    writes the Gluon backward's row stats instead: per BLOCK_M-row tile, lse·log2(e), then delta
    (SQ whole tiles)."""
    zh = tl.program_id(0)
    start_m = tl.program_id(1) * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    o = _tile(o_desc, zh // H, zh % H, start_m, BLOCK_M, HEAD_D)
    do = _tile(do_desc, zh // H, zh % H, start_m, BLOCK_M, HEAD_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row = zh.to(tl.int64) * SQ + rows
    if WITH_LSE:
        tile = DELTA + (zh.to(tl.int64) * SQ + start_m) * 2 + tl.arange(0, BLOCK_M)
        tl.store(tile, tl.load(LSE + row) * _LOG2E)
        tl.store(tile + BLOCK_M, delta)
    else:
        tl.store(DELTA + row, delta, mask=rows < SQ)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_desc, do_desc, z, h, lse_base, delta_base, cols, offs_m, lo, hi, SQ, qk_scale,
                BLOCK_M: tl.constexpr, HEAD_D: tl.constexpr, CAUSAL_MASK: tl.constexpr, PREC: tl.constexpr):
    """Accumulate dK, dV of one key tile over query tiles [lo, hi), in transposed (key-major) form."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < SQ
        # Rows past SQ read as zeros (q, dO, lse, delta), which makes their terms vanish.
        q = _tile(q_desc, z, h, start_m, BLOCK_M, HEAD_D)
        do = _tile(do_desc, z, h, start_m, BLOCK_M, HEAD_D)
        lse2 = tl.load(lse_base + rows, mask=row_ok, other=0.0) * _LOG2E
        delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale - lse2[None, :])
        if CAUSAL_MASK:
            p_t = tl.where(rows[None, :] >= cols[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PREC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PREC)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(q_desc, k_desc, v_desc, do_desc, DK, DV, LSE, DELTA, qk_scale, scale, H, SQ, SK,
                          IS_CAUSAL: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    # Each program owns one key tile and loops over the query tiles that can see it; causal
    # work is largest for the first key tiles, which the grid order starts first.
    zh = tl.program_id(0)
    z, h = zh // H, zh % H
    start_n = tl.program_id(1) * BLOCK_N
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    k = _tile(k_desc, z, h, start_n, BLOCK_N, HEAD_D)
    v = _tile(v_desc, z, h, start_n, BLOCK_N, HEAD_D)
    lse_base = LSE + zh.to(tl.int64) * SQ
    delta_base = DELTA + zh.to(tl.int64) * SQ
    dk = tl.zeros([BLOCK_N, HEAD_D], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_D], tl.float32)
    if IS_CAUSAL:
        # Query tiles that straddle the diagonal compare indices; later ones see every key.
        lo = (start_n // BLOCK_M) * BLOCK_M
        mid = lo + tl.cdiv(start_n + BLOCK_N - lo, BLOCK_M) * BLOCK_M
        dk, dv = _dkdv_inner(dk, dv, k, v, q_desc, do_desc, z, h, lse_base, delta_base, cols, offs_m,
                             lo, tl.minimum(mid, SQ), SQ, qk_scale, BLOCK_M, HEAD_D, True, PREC)
    else:
        mid = 0
    dk, dv = _dkdv_inner(dk, dv, k, v, q_desc, do_desc, z, h, lse_base, delta_base, cols, offs_m,
                         mid, SQ, SQ, qk_scale, BLOCK_M, HEAD_D, False, PREC)
    out_rows = zh.to(tl.int64) * SK + cols[:, None]
    col_ok = cols[:, None] < SK
    tl.store(DK + out_rows * HEAD_D + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty), mask=col_ok)
    tl.store(DV + out_rows * HEAD_D + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=col_ok)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_desc, v_desc, z, h, rows, offs_n, lo, hi, SK, qk_scale,
              BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr):
    """Accumulate dQ of one query tile over key tiles [lo, hi). MASK as in _fwd_inner."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _tile(k_desc, z, h, start_n, BLOCK_N, HEAD_D)
        v = _tile(v_desc, z, h, start_n, BLOCK_N, HEAD_D)
        p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale - lse2[:, None])
        if MASK == 1:
            p = tl.where(rows[:, None] >= cols[None, :], p, 0.0)
        if MASK == 2:
            p = tl.where(cols[None, :] < SK, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(q_desc, k_desc, v_desc, do_desc, DQ, LSE, DELTA, qk_scale, scale, H, SQ, SK,
                        IS_CAUSAL: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    zh, z, h, start_m = _query_tile(H, BLOCK_M)
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    row_ok = rows < SQ
    q = _tile(q_desc, z, h, start_m, BLOCK_M, HEAD_D)
    do = _tile(do_desc, z, h, start_m, BLOCK_M, HEAD_D)
    row_base = zh.to(tl.int64) * SQ
    lse2 = tl.load(LSE + row_base + rows, mask=row_ok, other=0.0) * _LOG2E
    delta = tl.load(DELTA + row_base + rows, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    split = (start_m // BLOCK_N) * BLOCK_N if IS_CAUSAL else (SK // BLOCK_N) * BLOCK_N  # as in the forward
    dq = _dq_inner(dq, q, do, lse2, delta, k_desc, v_desc, z, h, rows, offs_n, 0, split, SK, qk_scale,
                   BLOCK_N, HEAD_D, 0, PREC)
    hi = tl.minimum(start_m + BLOCK_M, SK) if IS_CAUSAL else SK
    dq = _dq_inner(dq, q, do, lse2, delta, k_desc, v_desc, z, h, rows, offs_n, split, hi, SK, qk_scale,
                   BLOCK_N, HEAD_D, 1 if IS_CAUSAL else 2, PREC)
    tl.store(DQ + (row_base + rows[:, None]) * HEAD_D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None])


# --------------------------------------------------------------------------- Hopper backward (Gluon)
#
# The Triton backward recomputes S = QKᵀ and dP = dO·Vᵀ in both of its kernels: seven tile
# matmuls per (query tile, key tile). One pass needs five, but its dQ = dS·K must be summed
# over key tiles, and Triton 3.6 gave no layout that kept dK, dV, S, dP and dQ in registers
# (one-pass variants measured 56-64 ms against 54, BENCHMARKS.md). Gluon, Triton's
# lower-level language, exposes the pieces: each program owns 128 keys in two warp groups;
# S and dP have queries as rows, each warp group holding 64 of the keys; P and dS go to shared
# memory, so every later matmul reads both operands from there (dV += Pᵀ·dO and dK += dSᵀ·Q,
# each warp group its own keys; dQ = dS·K, each half of D); dQ is added into an fp32 buffer
# by the copy engine (a TMA reduce-add).
#
# Two data layouts decide much of its speed (ncu and timings at one rank's shape, H200):
# - dQ's tile goes to shared memory, and so to the fp32 buffer, in its accumulator's register
#   order (``DQ_FRAGMENTS``), not row-major: a warp's 64-bit stores then fill all 32 banks per
#   half-warp, where in the 128-byte-swizzled row-major tile a half-warp covered 4 rows and 16
#   banks (twice the ideal wavefronts on every dQ store): 47.6 -> 44.6 ms.
#   ``_attn_dq_from_fragments_kernel`` puts the summed buffer back in row order as it casts it.
# - Each query tile's lse·log2(e) and delta come from one buffer (``_delta`` given lse), 64 of
#   each side by side: one pointer live through the loop instead of two took ptxas's spills
#   from 100 to 80 bytes (255 registers) and the backward to 42.6 ms (cuDNN: 40.8).
# Measured and not kept: a warp-specialized version (a load warp and a reduce warp) 4% slower;
# two dQ buffers, P rounded to 16 bits for dS, or waiting for the last reduce at the tile's
# second barrier instead of a third: no faster. Three Q/dO stages were no faster before the two
# layouts and now spill 120 bytes (not timed).

HOPPER_BWD = Tiles(block_m=64, block_n=128, num_warps=8, num_stages=2)
DQ_FRAGMENT_ROW = 256  # the fp32 buffer seen as rows of 256 for its TMA descriptor (the box's widest)
# Offset bit i of a dQ tile holds the element of bit i of (register pair, lane, register, warp)
# in dQ's wgmma accumulator layout (``_dq_layout(128, 2)``: 64 x 128, 4 x 2 warps).
DQ_FRAGMENTS = gl.constexpr(gl.SharedLinearLayout(
    offset_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [4, 0], [8, 0], [0, 8], [0, 16], [0, 32],
                  [16, 0], [32, 0], [0, 64]], alignment=128))


@gluon.constexpr_function
def _dq_layout(head_d, groups):
    """dQ = dS·K's accumulator: queries as rows, the warp groups side by side over D."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, groups], instr_shape=[16, head_d // groups, 16])


@gl._core.builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Add a shared-memory tile into global memory through the copy engine
    (``cp.reduce.async.bulk.tensor``). Triton 3.6's Gluon has the IR op but no wrapper."""
    from triton._C.libtriton import ir
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _load_query_tile(q_desc, do_desc, q_smem, do_smem, ready, slot, row, pred):
    """Start the TMA loads of Q's and dO's tile at ``row`` into ring slot ``slot`` (if ``pred``)."""
    mbarrier.expect(ready.index(slot), 2 * q_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(q_desc, [row, 0], ready.index(slot), q_smem.index(slot), pred=pred)
    tma.async_copy_global_to_shared(do_desc, [row, 0], ready.index(slot), do_smem.index(slot), pred=pred)


@gluon.jit
def _attn_bwd_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, DK, DV, STATS, qk_scale, scale, SQ, SK,
                            IS_CAUSAL: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    # q/dO descriptors read [B·H·SQ, D] and k/v [B·H·SK, D]; dQ's, one query tile per box of its
    # fp32 buffer (``_fragments_desc``); SQ and SK are whole tiles.
    start_n = gl.program_id(0) * BLOCK_N
    zh = gl.program_id(1)
    q_row0 = zh * SQ
    dtype: gl.constexpr = q_desc.dtype
    GROUPS: gl.constexpr = num_warps // 4
    # S, dP and dQ: queries as rows, the warp groups side by side; dK, dV: keys as rows.
    L_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, GROUPS],
                                                  instr_shape=[16, BLOCK_N // GROUPS, 16])
    L_DQ: gl.constexpr = _dq_layout(HEAD_D, GROUPS)
    L_KV: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, HEAD_D, 16])
    PS_SHARED: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], PS_SHARED)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], PS_SHARED)
    dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_D], DQ_FRAGMENTS)
    dq_box = dq_smem._reinterpret(gl.float32, dq_desc.block_type.shape, dq_desc.layout)  # what the TMA reads
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [zh * SK + start_n, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [zh * SK + start_n, 0], kv_bar, v_smem)

    # Causal: the first query tile that sees a key of this tile (BLOCK_N is a multiple of BLOCK_M).
    lo = start_n if IS_CAUSAL else 0
    n_iter = (SQ - lo) // BLOCK_M
    for i in gl.static_range(STAGES - 1):  # Q and dO of the first tiles, in a STAGES-deep ring
        _load_query_tile(q_desc, do_desc, q_smem, do_smem, ready, i, q_row0 + lo + i * BLOCK_M, i < n_iter)

    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_D], gl.float32, L_KV))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_D], gl.float32, L_KV))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L_S))
    cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, L_S))
    mbarrier.wait(kv_bar, 0)
    for i in range(n_iter):
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        q = q_smem.index(stage)
        do = do_smem.index(stage)
        start_m = lo + i * BLOCK_M
        rows = start_m + offs_m
        stats = STATS + (q_row0 + start_m) * 2  # this tile's lse·log2(e), then its delta
        lse2 = gl.load(stats + offs_m)
        delta = gl.load(stats + BLOCK_M + offs_m)
        s_tok = warpgroup_mma(q, k_smem.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, L_S),
                              use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(do, v_smem.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, L_S),
                               use_acc=False, is_async=True)
        # Waiting for S retires the last tile's dV and dK as well; after the barrier neither
        # warp group reads its Q/dO stage, P or dS any more.
        s, dk, dv = warpgroup_mma_wait(1, deps=(s_tok, dk, dv))
        gl.thread_barrier()
        nxt = i + STAGES - 1
        _load_query_tile(q_desc, do_desc, q_smem, do_smem, ready, nxt % STAGES, q_row0 + lo + nxt * BLOCK_M,
                         nxt < n_iter)
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
        if IS_CAUSAL:
            if start_m < start_n + BLOCK_N:
                p = gl.where(gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0), p, 0.0)
        p_smem.store(p.to(dtype))
        dp = warpgroup_mma_wait(0, deps=(dp_tok,))
        ds = p * (dp - gl.expand_dims(delta, 1)) * scale
        ds_smem.store(ds.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        dq_tok = warpgroup_mma(ds_smem, k_smem, gl.zeros([BLOCK_M, HEAD_D], gl.float32, L_DQ), use_acc=False,
                               is_async=True)
        dv = warpgroup_mma(p_smem.permute((1, 0)), do, dv, is_async=True)
        dk = warpgroup_mma(ds_smem.permute((1, 0)), q, dk, is_async=True)
        dq = warpgroup_mma_wait(2, deps=(dq_tok,))  # dV and dK stay in flight into the next tile
        tma.store_wait(0)  # the last tile's reduce has read dq_smem
        gl.thread_barrier()
        dq_smem.store(dq)
        fence_async_shared()
        gl.thread_barrier()
        _tma_reduce_add(dq_desc, [(q_row0 + start_m) // BLOCK_M * dq_box.shape[0], 0], dq_box)
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    tma.store_wait(0)
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    # The key rows' base again from q_row0: one register less live through the loop, which
    # ptxas repaid with 88 bytes less of spills and the kernel with ~14% less time (H200).
    out_rows = (q_row0 // SQ) * SK + start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_KV))
    out_cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, L_KV))
    out = gl.expand_dims(out_rows.to(gl.int64) * HEAD_D, 1) + gl.expand_dims(out_cols, 0)
    gl.store(DK + out, dk.to(dtype))
    gl.store(DV + out, dv.to(dtype))


# --------------------------------------------------------------------------- Hopper forward (Gluon)
#
# FA3's forward layout: one program per 128 queries, warp-specialized into a load warp and two
# compute warp groups of 64 queries each, 128-key K/V tiles in a 3-deep shared-memory ring.
# A group issues its QKᵀ of tile j before its P·V of tile j-1 (P the register operand), so the
# softmax of tile j runs while P·V of tile j-1 is on the tensor cores; the groups sync with the
# load warp through mbarriers only, never with each other. One rank's shape on an H200: 14.1 ms
# against 16.7 for the Triton forward (256 x 64 tiles, whose QKᵀ matmuls are n=64 with both
# operands in shared memory) and 15.4 for cuDNN; without the warp specialization (one CTA
# barrier per key tile) the same loop took 17.3 ms, 21.3 with a 2-deep ring (BENCHMARKS.md).

HOPPER_FWD = Tiles(block_m=128, block_n=128, num_warps=4, num_stages=3)  # num_warps: per compute warp group
HOPPER_FWD_COMPUTE_REGS = 232  # registers per thread set for the worker compute warp group (the load warp: 24)


@gluon.jit
def _fwd_hopper_load(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, q_row, k_row0, n_iter):
    """The load warp: Q once, then K and V tiles into the ring as the compute groups free slots."""
    STAGES: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    for j in range(n_iter):
        slot = j % STAGES
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)  # the first round passes
        mbarrier.expect(ready.index(slot), 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row0 + j * BLOCK_N, 0], ready.index(slot), k_smem.index(slot))
        tma.async_copy_global_to_shared(v_desc, [k_row0 + j * BLOCK_N, 0], ready.index(slot), v_smem.index(slot))


@gluon.jit
def _mask_after_diagonal(s, rows, start_n, start_m, IS_CAUSAL: gl.constexpr):
    """Causal: scores of the key tile at ``start_n`` set to -inf where the key comes after the
    query (``rows``: the queries' positions); only tiles reaching the diagonal do any work."""
    if IS_CAUSAL:
        BLOCK_N: gl.constexpr = s.type.shape[1]
        if start_n + BLOCK_N > start_m:
            cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
            s = gl.where(gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0), s, float("-inf"))
    return s


@gluon.jit
def _fwd_hopper_compute(GROUP: gl.constexpr, o_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, LSE, qk_scale,
                        q_row, start_m, n_iter, IS_CAUSAL: gl.constexpr):
    """One compute warp group: online softmax over the key tiles for its 64 queries, then O
    through its (no longer needed) Q rows in shared memory and a TMA store."""
    STAGES: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    HEAD_D: gl.constexpr = k_smem.type.shape[2]
    ROWS: gl.constexpr = o_desc.block_type.shape[0]
    dtype: gl.constexpr = k_smem.dtype
    L_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    L_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_D, 16])
    P_OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L_O, k_width=2)
    q = q_smem.slice(GROUP * ROWS, ROWS)
    rows = start_m + GROUP * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_S))
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, L_O)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(ready.index(0), 0)
    # Tile 0 alone: S, then P; the loop then runs P·V of tile j-1 under the softmax of tile j.
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, L_S), use_acc=False)
    s = _mask_after_diagonal(s, rows, 0, start_m, IS_CAUSAL)
    # Scores stay unscaled; scale*log2(e) is folded into the exp2 argument.
    m_i = gl.max(s, 1) * qk_scale
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_i, 1))
    l_i = gl.sum(p, 1)
    p = gl.convert_layout(p.to(dtype), P_OPERAND)
    for j in range(1, n_iter):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, L_S),
                              use_acc=False, is_async=True)
        acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
        s = _mask_after_diagonal(warpgroup_mma_wait(1, deps=(s_tok,)), rows, j * BLOCK_N, start_m, IS_CAUSAL)
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p_new = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p_new, 1)
        m_i = m_new
        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
        mbarrier.arrive(empty.index(prev), count=1)  # this group is done with tile j-1's K and V
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, L_O)), 1)
        p = gl.convert_layout(p_new.to(dtype), P_OPERAND)
    acc = warpgroup_mma(p, v_smem.index((n_iter - 1) % STAGES), acc)
    acc = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, L_O)), 1)
    gl.store(LSE + rows, (m_i + gl.log2(l_i)) * _LN2)
    q.store(acc.to(dtype))  # only this group reads these Q rows
    fence_async_shared()
    gl.thread_barrier()  # of this warp group
    tma.async_copy_shared_to_global(o_desc, [q_row + GROUP * ROWS, 0], q)
    tma.store_wait(0)


@gluon.jit
def _attn_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, LSE, qk_scale, SQ, SK,
                            IS_CAUSAL: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, COMPUTE_REGS: gl.constexpr):
    # Descriptors read [B·H·S, D]; SQ and SK are whole tiles. Largest causal query tiles first.
    start_m = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_M
    zh = gl.program_id(1)
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per compute group
    n_iter = (start_m + BLOCK_M if IS_CAUSAL else SK) // BLOCK_N
    q_row = zh * SQ + start_m
    lse = LSE + zh * SQ
    gl.warp_specialize([
        (_fwd_hopper_compute, (0, o_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, lse, qk_scale, q_row, start_m,
                               n_iter, IS_CAUSAL)),
        (_fwd_hopper_compute, (1, o_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, lse, qk_scale, q_row, start_m,
                               n_iter, IS_CAUSAL)),
        (_fwd_hopper_load, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, q_row, zh * SK,
                            n_iter)),
    ], [4, 1], [COMPUTE_REGS, 24])


# --------------------------------------------------------------------------- launchers


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """[N, S, D] -> [1, N, S, D], copied to a dense tensor when its layout cannot back a TMA
    descriptor: last dim strided, a start or stride not 16-byte aligned, or a broadcast
    (stride 0) dim, which the copy engine's tensor maps do not take."""
    t = t if t.dim() == 4 else t.unsqueeze(0)
    aligned = t.data_ptr() % 16 == 0 and all(s > 0 and s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
    return t if t.stride(-1) == 1 and aligned else t.contiguous()


def _desc(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A descriptor reading [rows, D] tiles of one (batch, head) of a 4-d tensor."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, t.shape[-1]])


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not silently drop to tf32 (they are the accuracy reference).
    return "ieee" if dtype == torch.float32 else "tf32"


def _no_heads(q: torch.Tensor) -> bool:
    """No (batch, head) pair to attend over (a zero batch or head dim): no kernel to launch, since
    a TMA descriptor takes no zero-sized dim and a grid no zero-sized axis."""
    return math.prod(q.shape[:-2]) == 0


def _empty_fwd(q: torch.Tensor):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _empty_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def triton_fwd(q, k, v, is_causal: bool, scale: float, config: AttnConfig | None = None):
    """Run the Triton forward; returns (out, lse). Inputs must already be validated."""
    if _no_heads(q):
        return _empty_fwd(q)
    q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)
    Z, H, SQ, D = q4.shape
    SK = k4.shape[2]
    t = (config or pick_config(D, q.dtype)).fwd
    out = torch.empty((Z, H, SQ, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((Z, H, SQ), dtype=torch.float32, device=q.device)
    _attn_fwd_kernel[(Z * H, triton.cdiv(SQ, t.block_m))](
        _desc(q4, t.block_m), _desc(k4, t.block_n), _desc(v4, t.block_n), out, lse, scale * LOG2E, H, SQ, SK,
        IS_CAUSAL=is_causal, HEAD_D=D, BLOCK_M=t.block_m, BLOCK_N=t.block_n, PREC=_precision(q.dtype),
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out.view(q.shape), lse.view(q.shape[:-1])


def _delta(o4: torch.Tensor, do4: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """rowsum(dO * O) of 4-d tensors, [Z, H, SQ] in fp32. Given ``lse``, the Gluon backward's row
    stats instead: [Z·H·SQ / 64, 2, 64], each tile of 64 rows its lse·log2(e) then its delta."""
    Z, H, SQ, D = o4.shape
    with_lse = lse is not None
    rows = HOPPER_BWD.block_m if with_lse else DELTA_BLOCK_M
    shape = (Z * H * SQ // rows, 2, rows) if with_lse else (Z, H, SQ)
    delta = torch.empty(shape, dtype=torch.float32, device=o4.device)
    _attn_bwd_delta_kernel[(Z * H, triton.cdiv(SQ, rows))](
        _desc(o4, rows), _desc(do4, rows), lse.contiguous() if with_lse else delta,  # LSE: read only with_lse
        delta, H, SQ, HEAD_D=D, BLOCK_M=rows, WITH_LSE=with_lse,
    )
    return delta


def triton_bwd(dout, q, k, v, out, lse, is_causal: bool, scale: float, config: AttnConfig | None = None):
    """Run the Triton backward (delta, then dK/dV, then dQ); returns (dq, dk, dv)."""
    if _no_heads(q):
        return _empty_bwd(q, k, v)
    q4, k4, v4, do4, o4 = _as_4d(q), _as_4d(k), _as_4d(v), _as_4d(dout), _as_4d(out)
    Z, H, SQ, D = q4.shape
    SK = k4.shape[2]
    cfg = config or pick_config(D, q.dtype)
    lse = lse.contiguous()
    dq = torch.empty((Z, H, SQ, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((Z, H, SK, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((Z, H, SK, D), dtype=v.dtype, device=q.device)
    prec = _precision(q.dtype)
    delta = _delta(o4, do4)
    for t, kernel, grid, outputs in (
        (cfg.dkdv, _attn_bwd_dkdv_kernel, (Z * H, triton.cdiv(SK, cfg.dkdv.block_n)), (dk, dv)),
        (cfg.dq, _attn_bwd_dq_kernel, (Z * H, triton.cdiv(SQ, cfg.dq.block_m)), (dq,)),
    ):
        kernel[grid](
            _desc(q4, t.block_m), _desc(k4, t.block_n), _desc(v4, t.block_n), _desc(do4, t.block_m), *outputs, lse, delta,
            scale * LOG2E, scale, H, SQ, SK,
            IS_CAUSAL=is_causal, HEAD_D=D, BLOCK_M=t.block_m, BLOCK_N=t.block_n, PREC=prec,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


_GLUON_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


def _rows_desc(t: torch.Tensor, rows: int) -> GluonTensorDescriptor:
    """A Gluon descriptor reading [rows, D] tiles of a contiguous [..., S, D] tensor seen as [N·S, D]."""
    flat = t.view(-1, t.shape[-1])
    layout = gl.NVMMASharedLayout.get_default_for([rows, t.shape[-1]], _GLUON_DTYPES[t.dtype])
    return GluonTensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, t.shape[-1]], layout)


def _fragments_desc(acc: torch.Tensor) -> GluonTensorDescriptor:
    """The fp32 dQ buffer as unswizzled [N, DQ_FRAGMENT_ROW] rows, one query tile per box."""
    flat = acc.view(-1, DQ_FRAGMENT_ROW)
    box = [HOPPER_BWD.block_m * acc.shape[-1] // DQ_FRAGMENT_ROW, DQ_FRAGMENT_ROW]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return GluonTensorDescriptor(flat, list(flat.shape), list(flat.stride()), box, layout)


@triton.jit
def _attn_dq_from_fragments_kernel(ACC, DQ):
    """One 64 x 128 tile of the fp32 dQ buffer, read in DQ_FRAGMENTS order, written row-major in
    DQ's dtype. DQ_FRAGMENTS' offset bits, high to low, are runs of column and row bits:
    col 6, rows 4-5, cols 3-5, rows 0-3, cols 0-2; a permute of those runs makes them row-major."""
    base = tl.program_id(0).to(tl.int64) * 8192
    tile = tl.arange(0, 8192)
    runs = tl.reshape(tl.load(ACC + base + tile), (2, 4, 8, 16, 8))
    row_major = tl.reshape(tl.permute(runs, (1, 3, 0, 2, 4)), (8192,))
    tl.store(DQ + base + tile, row_major.to(DQ.dtype.element_ty))


def dq_from_fragments(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The summed fp32 dQ buffer ([..., S, 128], tiles in fragment order) as row-major ``dtype``."""
    dq = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    _attn_dq_from_fragments_kernel[(acc.numel() // 8192,)](acc, dq, num_warps=8)
    return dq


def uses_hopper_kernels(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the CUDA ops run the Gluon kernels (``hopper_fwd``, ``hopper_bwd``): an sm_90 GPU,
    D = 128, 16-bit, and Sq and Sk in whole 128-row tiles. Every other input takes the Triton ones."""
    tile = math.lcm(HOPPER_FWD.block_m, HOPPER_FWD.block_n, HOPPER_BWD.block_m, HOPPER_BWD.block_n)
    return (q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0) and q.shape[-1] == 128
            and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-2] % tile == 0 and k.shape[-2] % tile == 0)


def hopper_fwd(q, k, v, is_causal: bool, scale: float):
    """Run the warp-specialized Gluon forward on inputs ``uses_hopper_kernels`` accepts; returns (out, lse)."""
    if _no_heads(q):
        return _empty_fwd(q)
    q4, k4, v4 = (_as_4d(t).contiguous() for t in (q, k, v))
    Z, H, SQ, D = q4.shape
    SK = k4.shape[2]
    t = HOPPER_FWD
    out = torch.empty((Z, H, SQ, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((Z, H, SQ), dtype=torch.float32, device=q.device)
    _attn_fwd_hopper_kernel[(SQ // t.block_m, Z * H)](
        _rows_desc(q4, t.block_m), _rows_desc(k4, t.block_n), _rows_desc(v4, t.block_n),
        _rows_desc(out, t.block_m // 2), lse, scale * LOG2E, SQ, SK,
        IS_CAUSAL=is_causal, HEAD_D=D, BLOCK_M=t.block_m, BLOCK_N=t.block_n, STAGES=t.num_stages,
        COMPUTE_REGS=HOPPER_FWD_COMPUTE_REGS, num_warps=t.num_warps,
    )
    return out.view(q.shape), lse.view(q.shape[:-1])


def hopper_bwd(dout, q, k, v, out, lse, is_causal: bool, scale: float):
    """Run the one-pass Gluon backward on inputs ``uses_hopper_kernels`` accepts; returns (dq, dk, dv).
    dQ is summed in fp32 (Sq·D·4 bytes per head, tiles in fragment order), then cast."""
    if _no_heads(q):
        return _empty_bwd(q, k, v)
    q4, k4, v4, do4 = (_as_4d(t).contiguous() for t in (q, k, v, dout))
    Z, H, SQ, D = q4.shape
    SK = k4.shape[2]
    t = HOPPER_BWD
    stats = _delta(_as_4d(out), do4, lse)
    dq = torch.zeros((Z, H, SQ, D), dtype=torch.float32, device=q.device)  # tiles in fragment order
    dk = torch.empty((Z, H, SK, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((Z, H, SK, D), dtype=v.dtype, device=q.device)
    _attn_bwd_hopper_kernel[(SK // t.block_n, Z * H)](
        _rows_desc(q4, t.block_m), _rows_desc(k4, t.block_n), _rows_desc(v4, t.block_n),
        _rows_desc(do4, t.block_m), _fragments_desc(dq), dk, dv, stats,
        scale * LOG2E, scale, SQ, SK,
        IS_CAUSAL=is_causal, HEAD_D=D, BLOCK_M=t.block_m, BLOCK_N=t.block_n, STAGES=t.num_stages,
        num_warps=t.num_warps,
    )
    return dq_from_fragments(dq, q.dtype).view(q.shape), dk.view(k.shape), dv.view(v.shape)


# --------------------------------------------------------------------------- torch (CPU) path

CPU_CHUNK = 256  # queries per step: bounds the score block to CPU_CHUNK x Sk per (batch, head)


def _causal_mask(c0: int, c1: int, device: torch.device) -> torch.Tensor:
    """True where key j > query i, for queries [c0, c1) and keys [0, c1)."""
    rows = torch.arange(c0, c1, device=device)[:, None]
    return torch.arange(c1, device=device)[None, :] > rows


def torch_fwd(q, k, v, is_causal: bool, scale: float):
    """Attention in fp32, one chunk of queries at a time; returns (out, lse)."""
    sq = q.shape[-2]
    kf, vf = k.float(), v.float()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for c0 in range(0, sq, CPU_CHUNK):
        c1 = min(c0 + CPU_CHUNK, sq)
        kc, vc = (kf[..., :c1, :], vf[..., :c1, :]) if is_causal else (kf, vf)
        s = q[..., c0:c1, :].float() @ kc.transpose(-1, -2) * scale
        if is_causal:
            s.masked_fill_(_causal_mask(c0, c1, q.device), float("-inf"))
        lse_c = torch.logsumexp(s, dim=-1)
        out[..., c0:c1, :] = torch.exp(s - lse_c[..., None]) @ vc
        lse[..., c0:c1] = lse_c
    return out, lse


def torch_bwd(dout, q, k, v, out, lse, is_causal: bool, scale: float):
    """Backward of torch_fwd from the saved lse, in fp32 chunks of queries; returns (dq, dk, dv)."""
    sq = q.shape[-2]
    kf, vf = k.float(), v.float()
    delta = (dout.float() * out.float()).sum(-1)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for c0 in range(0, sq, CPU_CHUNK):
        c1 = min(c0 + CPU_CHUNK, sq)
        nk = c1 if is_causal else k.shape[-2]
        kc, vc = kf[..., :nk, :], vf[..., :nk, :]
        qc, doc = q[..., c0:c1, :].float(), dout[..., c0:c1, :].float()
        s = qc @ kc.transpose(-1, -2) * scale
        if is_causal:
            s.masked_fill_(_causal_mask(c0, c1, q.device), float("-inf"))
        p = torch.exp(s - lse[..., c0:c1, None])
        dv[..., :nk, :] += p.transpose(-1, -2) @ doc
        ds = p * (doc @ vc.transpose(-1, -2) - delta[..., c0:c1, None])
        dq[..., c0:c1, :] = ds @ kc * scale
        dk[..., :nk, :] += ds.transpose(-1, -2) @ qc * scale
    return dq, dk.to(k.dtype), dv.to(v.dtype)


# --------------------------------------------------------------------------- checks and ops


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


@torch.library.custom_op("cstack::flash_attention_fwd", mutates_args=(), device_types="cpu")
def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_attention_args(q, k, v, is_causal, scale)
    return torch_fwd(q, k, v, is_causal, scale)


@flash_attention_fwd.register_kernel("cuda")
def _fwd_cuda(q, k, v, is_causal, scale):
    check_attention_args(q, k, v, is_causal, scale)
    forward = hopper_fwd if uses_hopper_kernels(q, k) else triton_fwd
    return forward(q, k, v, is_causal, scale)


@flash_attention_fwd.register_fake
def _fwd_fake(q, k, v, is_causal, scale):
    check_attention_args(q, k, v, is_causal, scale)
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("cstack::flash_attention_bwd", mutates_args=(), device_types="cpu")
def flash_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_bwd_args(dout, q, k, v, out, lse, is_causal, scale)
    return torch_bwd(dout, q, k, v, out, lse, is_causal, scale)


@flash_attention_bwd.register_kernel("cuda")
def _bwd_cuda(dout, q, k, v, out, lse, is_causal, scale):
    check_bwd_args(dout, q, k, v, out, lse, is_causal, scale)
    backward = hopper_bwd if uses_hopper_kernels(q, k) else triton_bwd
    return backward(dout, q, k, v, out, lse, is_causal, scale)


@flash_attention_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, is_causal, scale):
    check_bwd_args(dout, q, k, v, out, lse, is_causal, scale)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


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
