"""The one-pass Gluon backward for Hopper (sm_90): ``hopper_bwd``.

The Triton backward recomputes S = QKᵀ and dP = dO·Vᵀ in both of its kernels: seven
tile matmuls per (query tile, key tile). One pass needs five, but its dQ = dS·K must be summed
over key tiles, and Triton 3.6 gave no layout that kept dK, dV, S, dP and dQ in registers
(one-pass Triton variants measured slower than the two kernels). Gluon, Triton's lower-level
language, exposes the pieces: each program owns 128 keys in two warp groups; S and dP have
queries as rows, each warp group holding 64 of the keys; P and dS go to shared memory, so every
later matmul reads both operands from there (dV += Pᵀ·dO and dK += dSᵀ·Q, each warp group its
own keys; dQ = dS·K, each half of D); dQ is added into an fp32 buffer by the copy engine (a TMA
reduce-add). Two data layouts decide much of its speed:
- dQ's tile goes to shared memory, and so to the fp32 buffer, in its accumulator's register
  order (``_dq_fragments``), not row-major: a warp's 64-bit stores then fill all 32 banks per
  half-warp, where in the 128-byte-swizzled row-major tile a half-warp covered 4 rows and 16
  banks (twice the ideal wavefronts on every dQ store). ``_attn_dq_from_fragments_kernel``
  puts the summed buffer back in row order as it casts it.
- Each query tile's lse·log2(e) and delta come from one buffer (``_delta`` given lse, in tiles
  of ``HOPPER_BWD_ROWS``), side by side: one pointer live through the loop instead of two
  leaves ptxas fewer spills.
- Causal at D=128, the two query tiles reaching the diagonal run in a loop of their own, so the
  loop over the others holds no mask: ptxas then spills nothing (``HOPPER_BWD_PEEL_DIAGONAL``).
"""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

from custom_ops.attention.configs import (
    DQ_FRAGMENT_ROW, HOPPER_BWD, HOPPER_BWD_PEEL_DIAGONAL, HOPPER_BWD_ROWS, HOPPER_BWD_TMA_EPILOGUE, LOG2E)
from custom_ops.attention.gluon_common import _head_origin, _in_place_or_dense, _rows_desc, _this_head
from custom_ops.attention.layouts import empty_like_v, is_sequence_major
from custom_ops.attention.triton_kernels import _as_4d, _delta, _empty_bwd, _no_heads


@gluon.constexpr_function
def _dq_fragments(head_d):
    """dQ's 64 x ``head_d`` tile in its accumulator's register order (``_dq_layout(head_d, 2)``, 4 x 2
    warps): offset bit i holds the element of bit i of (register pair, lane, register, warp). For
    D = 128: col 0, cols 1-2 and rows 0-2 (the lane), row 3, cols 3-5 (the register), rows 4-5 and
    col 6 (the warp)."""
    chunks = [[0, 8 << i] for i in range((head_d // 16).bit_length() - 1)]  # a group's 8-column chunks
    bases = [[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [4, 0], [8, 0], *chunks, [16, 0], [32, 0], [0, head_d // 2]]
    return gl.SharedLinearLayout(offset_bases=bases, alignment=128)


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
def _load_query_tile(q_desc, do_desc, q_smem, do_smem, ready, slot, row, pred, do_shift, do_col):
    """Start the TMA loads of Q's tile at ``row`` and dO's at (``row + do_shift``, ``do_col``: dO's
    layout may differ from Q's) into ring slot ``slot`` (if ``pred``)."""
    mbarrier.expect(ready.index(slot), 2 * q_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(q_desc, [row, 0], ready.index(slot), q_smem.index(slot), pred=pred)
    tma.async_copy_global_to_shared(do_desc, [row + do_shift, do_col], ready.index(slot), do_smem.index(slot),
                                    pred=pred)


@gluon.jit
def _load_row_stats(STATS, row, offs_m):
    """The row stats of the query tile starting at ``row`` (of all heads' rows): (lse·log2(e), delta)."""
    stats = STATS + row * 2  # the tile's lse·log2(e), then its delta
    return gl.load(stats + offs_m), gl.load(stats + offs_m.type.shape[0] + offs_m)


@gluon.jit
def _bwd_query_tile(i, dk, dv, stats, q_desc, do_desc, dq_desc, k_smem, v_smem, q_smem, do_smem, p_smem, ds_smem,
                    dq_smem, dq_box, ready, STATS, qk_scale, scale, q_row0, do_shift, do_col, lo, n_iter, offs_m, cols,
                    masked):
    """The backward's work on its ``i``-th query tile: S and dP, then P and dS into shared memory,
    dQ's TMA reduce-add, and dV, dK left in flight into the next tile. ``stats``: this tile's row
    stats, loaded one tile ahead; ``masked`` (a constexpr, or a bool the loop computes) applies the
    causal mask to P. Returns (dk, dv, the next tile's stats)."""
    STAGES: gl.constexpr = q_smem.type.shape[0]
    BLOCK_M: gl.constexpr = q_smem.type.shape[1]
    HEAD_D: gl.constexpr = q_smem.type.shape[2]
    BLOCK_N: gl.constexpr = k_smem.type.shape[0]
    dtype: gl.constexpr = q_smem.dtype
    L_S: gl.constexpr = offs_m.type.layout.parent  # S and dP: queries as rows, the warp groups side by side
    L_DQ: gl.constexpr = _dq_layout(HEAD_D, L_S.warps_per_cta[1])
    stage = i % STAGES
    mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
    q = q_smem.index(stage)
    do = do_smem.index(stage)
    start_m = lo + i * BLOCK_M
    lse2, delta = stats
    stats_next = _load_row_stats(STATS, q_row0 + lo + gl.minimum(i + 1, n_iter - 1) * BLOCK_M, offs_m)
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
                     nxt < n_iter, do_shift, do_col)
    p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
    if masked:
        rows = start_m + offs_m
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
    return dk, dv, stats_next


@gluon.jit
def _attn_bwd_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, DK, DV, STATS, qk_scale, scale, SQ, SK,
                            IS_CAUSAL: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PEEL_DIAGONAL: gl.constexpr,
                            TMA_EPILOGUE: gl.constexpr, V_SEQUENCE_MAJOR: gl.constexpr,
                            DO_SEQUENCE_MAJOR: gl.constexpr, num_warps: gl.constexpr):
    # q's descriptor reads [B·H·SQ, D] and k's [B·H·SK, D]; v's and DV's layout is V_SEQUENCE_MAJOR's,
    # dO's DO_SEQUENCE_MAJOR's;
    # dQ's descriptor, one query tile per box of its fp32 buffer (``_fragments_desc``); DK and DV:
    # descriptors if TMA_EPILOGUE, else pointers. SQ and SK are whole tiles.
    start_n = gl.program_id(0) * BLOCK_N
    zh, z, h = _this_head()
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
    dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_D], _dq_fragments(HEAD_D))
    dq_box = dq_smem._reinterpret(gl.float32, dq_desc.block_type.shape, dq_desc.layout)  # what the TMA reads
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [zh * SK + start_n, 0], kv_bar, k_smem)
    v_row, v_col = _head_origin(z, h, SK, HEAD_D, V_SEQUENCE_MAJOR)
    tma.async_copy_global_to_shared(v_desc, [v_row + start_n, v_col], kv_bar, v_smem)
    do_row0, do_col = _head_origin(z, h, SQ, HEAD_D, DO_SEQUENCE_MAJOR)
    do_shift = do_row0 - q_row0

    # Causal: the first query tile that sees a key of this tile (BLOCK_N is a multiple of BLOCK_M).
    lo = start_n if IS_CAUSAL else 0
    n_iter = (SQ - lo) // BLOCK_M
    for i in gl.static_range(STAGES - 1):  # Q and dO of the first tiles, in a STAGES-deep ring
        _load_query_tile(q_desc, do_desc, q_smem, do_smem, ready, i, q_row0 + lo + i * BLOCK_M, i < n_iter, do_shift,
                         do_col)

    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_D], gl.float32, L_KV))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_D], gl.float32, L_KV))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L_S))
    cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, L_S))
    mbarrier.wait(kv_bar, 0)
    args = (q_desc, do_desc, dq_desc, k_smem, v_smem, q_smem, do_smem, p_smem, ds_smem, dq_smem, dq_box, ready, STATS,
            qk_scale, scale, q_row0, do_shift, do_col, lo, n_iter, offs_m, cols)
    # Each tile's row stats are loaded one tile ahead, so their latency is not waited for
    # (1.3% faster at one rank's shape, docs/decisions.md).
    stats = _load_row_stats(STATS, q_row0 + lo, offs_m)
    if PEEL_DIAGONAL:  # causal: the tiles reaching the diagonal, then an unmasked loop (configs.py says why)
        for i in range(BLOCK_N // BLOCK_M):
            dk, dv, stats = _bwd_query_tile(i, dk, dv, stats, *args, True)
        for i in range(BLOCK_N // BLOCK_M, n_iter):
            dk, dv, stats = _bwd_query_tile(i, dk, dv, stats, *args, False)
    else:
        for i in range(n_iter):
            dk, dv, stats = _bwd_query_tile(i, dk, dv, stats, *args, IS_CAUSAL and lo + i * BLOCK_M < start_n + BLOCK_N)
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    tma.store_wait(0)
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    # The key rows' base again from q_row0: one register less live through the loop, which
    # ptxas repays with fewer spills and the kernel with less time (docs/decisions.md).
    if TMA_EPILOGUE:  # through K's and V's tiles in shared memory: no matmul reads them any more
        gl.thread_barrier()
        k_smem.store(dk.to(dtype))
        v_smem.store(dv.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        key_row = (q_row0 // SQ) * SK + start_n
        tma.async_copy_shared_to_global(DK, [key_row, 0], k_smem)
        if V_SEQUENCE_MAJOR:  # dV's rows as v's: [Z·SK, H·D]
            v_row, v_col = _head_origin(gl.program_id(2), gl.program_id(1), SK, HEAD_D, True)
            tma.async_copy_shared_to_global(DV, [v_row + start_n, v_col], v_smem)
        else:
            tma.async_copy_shared_to_global(DV, [key_row, 0], v_smem)
        tma.store_wait(0)
    else:
        out_rows = (q_row0 // SQ) * SK + start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_KV))
        out_cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, L_KV))
        out = gl.expand_dims(out_rows.to(gl.int64) * HEAD_D, 1) + gl.expand_dims(out_cols, 0)
        gl.store(DK + out, dk.to(dtype))
        if V_SEQUENCE_MAJOR:  # dV's rows as v's: [Z·SK, H·D]
            v_row, v_col = _head_origin(gl.program_id(2), gl.program_id(1), SK, HEAD_D, True)
            dv_rows = v_row + start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_KV))
            out = gl.expand_dims(dv_rows.to(gl.int64) * (gl.num_programs(1) * HEAD_D) + v_col, 1) + \
                gl.expand_dims(out_cols, 0)
        gl.store(DV + out, dv.to(dtype))


def _fragments_desc(acc: torch.Tensor) -> GluonTensorDescriptor:
    """The fp32 dQ buffer as unswizzled [N, DQ_FRAGMENT_ROW] rows, one query tile per box."""
    flat = acc.view(-1, DQ_FRAGMENT_ROW)
    box = [HOPPER_BWD_ROWS * acc.shape[-1] // DQ_FRAGMENT_ROW, DQ_FRAGMENT_ROW]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return GluonTensorDescriptor(flat, list(flat.shape), list(flat.stride()), box, layout)


@triton.jit
def _attn_dq_from_fragments_kernel(ACC, DQ, HEAD_D: tl.constexpr):
    """One 64 x HEAD_D tile of the fp32 dQ buffer, read in ``_dq_fragments`` order, written row-major
    in DQ's dtype. Its offset bits, high to low, are runs of column and row bits (D = 128: col 6,
    rows 4-5, cols 3-5, rows 0-3, cols 0-2); a permute of those runs makes them row-major."""
    TILE: tl.constexpr = 64 * HEAD_D
    base = tl.program_id(0).to(tl.int64) * TILE
    tile = tl.arange(0, TILE)
    runs = tl.reshape(tl.load(ACC + base + tile), (2, 4, HEAD_D // 16, 16, 8))
    row_major = tl.reshape(tl.permute(runs, (1, 3, 0, 2, 4)), (TILE,))
    tl.store(DQ + base + tile, row_major.to(DQ.dtype.element_ty))


def dq_from_fragments(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The summed fp32 dQ buffer ([..., S, D], tiles in fragment order) as row-major ``dtype``."""
    dq = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    d = acc.shape[-1]
    _attn_dq_from_fragments_kernel[(acc.numel() // (64 * d),)](acc, dq, HEAD_D=d, num_warps=8)
    return dq


def hopper_bwd(dout, q, k, v, out, lse, is_causal: bool, scale: float):
    """Run the one-pass Gluon backward on inputs ``uses_hopper_kernels`` accepts; returns (dq, dk, dv).
    dQ is summed in fp32 (Sq·D·4 bytes per head, tiles in fragment order), then cast."""
    if _no_heads(q):
        return _empty_bwd(q, k, v)
    q4, k4 = (_as_4d(t).contiguous() for t in (q, k))
    v4, do4 = _in_place_or_dense(v), _in_place_or_dense(dout)
    Z, H, SQ, D = q4.shape
    SK = k4.shape[2]
    t = HOPPER_BWD[D]
    stats = _delta(_as_4d(out), do4, lse)
    dq = torch.zeros((Z, H, SQ, D), dtype=torch.float32, device=q.device)  # tiles in fragment order
    dk = torch.empty((Z, H, SK, D), dtype=k.dtype, device=q.device)
    dv = empty_like_v((Z, H, SK, D), v.dtype, v4)
    _attn_bwd_hopper_kernel[(SK // t.block_n, H, Z)](
        _rows_desc(q4, t.block_m), _rows_desc(k4, t.block_n), _rows_desc(v4, t.block_n),
        _rows_desc(do4, t.block_m), _fragments_desc(dq),
        *((_rows_desc(dk, t.block_n), _rows_desc(dv, t.block_n)) if HOPPER_BWD_TMA_EPILOGUE[D] else (dk, dv)), stats,
        scale * LOG2E, scale, SQ, SK,
        IS_CAUSAL=is_causal, HEAD_D=D, BLOCK_M=t.block_m, BLOCK_N=t.block_n, STAGES=t.num_stages,
        PEEL_DIAGONAL=is_causal and HOPPER_BWD_PEEL_DIAGONAL[D], TMA_EPILOGUE=HOPPER_BWD_TMA_EPILOGUE[D],
        V_SEQUENCE_MAJOR=is_sequence_major(v4), DO_SEQUENCE_MAJOR=is_sequence_major(do4),
        num_warps=t.num_warps,
    )
    return dq_from_fragments(dq, q.dtype).view(q.shape), dk.view(k.shape), dv.view(v.shape)
