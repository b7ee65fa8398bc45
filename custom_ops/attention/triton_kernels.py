"""The Triton FlashAttention kernels (forward; backward as delta, then dK/dV, then dQ) and their
launchers ``triton_fwd``, ``triton_bwd``. They run on any CUDA GPU, and on CPU tensors under
``TRITON_INTERPRET=1`` (how the tests check them).

Every tile of q, k, v, dO and O is read through a TMA tensor descriptor over the
[Z, H, S, D] tensor: the copy engine does the address arithmetic and the bounds (rows
past S read as zeros), which measured faster than pointer loads on the H200
(docs/decisions.md). Outputs are fresh tensors in the ops' layouts (``layouts``), written through
descriptors as well (rows past S are not written).
"""
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from custom_ops.attention.configs import (
    DELTA_BLOCK_M, HOPPER_BWD_ROWS, LOG2E, _LN2, _LOG2E, AttnConfig, pick_config)
from custom_ops.attention.layouts import empty_like_v


@triton.jit
def _tile(desc, z, h, start, ROWS: tl.constexpr, HEAD_D: tl.constexpr):
    """Rows [start, start + ROWS) of head (z, h); rows past the tensor's end read as zeros."""
    return desc.load([z, h, start, 0]).reshape(ROWS, HEAD_D)


@triton.jit
def _store_tile(desc, z, h, start, tile):
    """Write ``tile`` as rows [start, start + ROWS) of head (z, h), in the descriptor's dtype; rows
    past the tensor's end are dropped."""
    desc.store([z, h, start, 0], tile.to(desc.dtype).reshape(1, 1, tile.shape[0], tile.shape[1]))


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
def _attn_fwd_kernel(q_desc, k_desc, v_desc, o_desc, LSE, qk_scale, H, SQ, SK,
                     IS_CAUSAL: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    zh, z, h, start_m = _query_tile(H, BLOCK_M)
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
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
    _store_tile(o_desc, z, h, start_m, acc / l_i[:, None])
    tl.store(LSE + zh.to(tl.int64) * SQ + rows, (m_i + tl.math.log2(l_i)) * _LN2, mask=row_ok)


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
def _attn_bwd_dkdv_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, DELTA, qk_scale, scale, H, SQ, SK,
                          IS_CAUSAL: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    # Each program owns one key tile and loops over the query tiles that can see it; causal
    # work is largest for the first key tiles, which the grid order starts first.
    zh = tl.program_id(0)
    z, h = zh // H, zh % H
    start_n = tl.program_id(1) * BLOCK_N
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
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
    _store_tile(dk_desc, z, h, start_n, dk * scale)
    _store_tile(dv_desc, z, h, start_n, dv)


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
def _attn_bwd_dq_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, LSE, DELTA, qk_scale, scale, H, SQ, SK,
                        IS_CAUSAL: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    zh, z, h, start_m = _query_tile(H, BLOCK_M)
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
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
    _store_tile(dq_desc, z, h, start_m, dq * scale)

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


def _empty_fwd(q: torch.Tensor, v: torch.Tensor):
    return empty_like_v(q.shape, q.dtype, v), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _empty_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    return q.new_empty(q.shape), k.new_empty(k.shape), empty_like_v(v.shape, v.dtype, v)


def triton_fwd(q, k, v, is_causal: bool, scale: float, config: AttnConfig | None = None):
    """Run the Triton forward; returns (out, lse). Inputs must already be validated."""
    if _no_heads(q):
        return _empty_fwd(q, v)
    q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)
    Z, H, SQ, D = q4.shape
    SK = k4.shape[2]
    t = (config or pick_config(D, q.dtype)).fwd
    out = empty_like_v((Z, H, SQ, D), q.dtype, v4)
    lse = torch.empty((Z, H, SQ), dtype=torch.float32, device=q.device)
    _attn_fwd_kernel[(Z * H, triton.cdiv(SQ, t.block_m))](
        _desc(q4, t.block_m), _desc(k4, t.block_n), _desc(v4, t.block_n), _desc(out, t.block_m), lse,
        scale * LOG2E, H, SQ, SK,
        IS_CAUSAL=is_causal, HEAD_D=D, BLOCK_M=t.block_m, BLOCK_N=t.block_n, PREC=_precision(q.dtype),
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out.view(q.shape), lse.view(q.shape[:-1])


def _delta(o4: torch.Tensor, do4: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """rowsum(dO * O) of 4-d tensors, [Z, H, SQ] in fp32. Given ``lse``, the Gluon backward's row
    stats instead: [Z·H·SQ / R, 2, R] for R = HOPPER_BWD_ROWS, each tile of R rows its
    lse·log2(e) then its delta."""
    Z, H, SQ, D = o4.shape
    with_lse = lse is not None
    rows = HOPPER_BWD_ROWS if with_lse else DELTA_BLOCK_M
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
    dv = empty_like_v((Z, H, SK, D), v.dtype, v4)
    prec = _precision(q.dtype)
    delta = _delta(o4, do4)
    for t, kernel, grid, outputs in (
        (cfg.dkdv, _attn_bwd_dkdv_kernel, (Z * H, triton.cdiv(SK, cfg.dkdv.block_n)), (dk, dv)),
        (cfg.dq, _attn_bwd_dq_kernel, (Z * H, triton.cdiv(SQ, cfg.dq.block_m)), (dq,)),
    ):
        rows = t.block_n if kernel is _attn_bwd_dkdv_kernel else t.block_m
        kernel[grid](
            _desc(q4, t.block_m), _desc(k4, t.block_n), _desc(v4, t.block_n), _desc(do4, t.block_m),
            *(_desc(o, rows) for o in outputs), lse, delta,
            scale * LOG2E, scale, H, SQ, SK,
            IS_CAUSAL=is_causal, HEAD_D=D, BLOCK_M=t.block_m, BLOCK_N=t.block_n, PREC=prec,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
