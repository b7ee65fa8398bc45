"""The warp-specialized Gluon forward for Hopper (sm_90): ``hopper_fwd``.

FA3's layout: one program per 128 queries, warp-specialized into a load warp and two
compute warp groups of 64 queries each, 128-key K/V tiles in a 3-deep shared-memory ring. A
group issues its QKᵀ of tile j and its P·V of tile j-1 together (P the register operand). ptxas
writes tile j's P into the registers P·V reads, so it waits for P·V before the softmax: one
group's softmax runs under the other group's matmuls, not under its own (a wait placed after
the softmax ran no faster, docs/decisions.md). The groups sync with the load warp through mbarriers
only, never with each other.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from custom_ops.attention.configs import HOPPER_FWD, HOPPER_FWD_COMPUTE_REGS, LOG2E, _LN2
from custom_ops.attention.gluon_common import _head_origin, _in_place_or_dense, _rows_desc, _this_head
from custom_ops.attention.layouts import empty_like_v, is_sequence_major
from custom_ops.attention.triton_kernels import _as_4d, _empty_fwd, _no_heads



@gluon.jit
def _fwd_hopper_load(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, q_row, k_row0, v_row0,
                     v_col, n_iter):
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
        tma.async_copy_global_to_shared(v_desc, [v_row0 + j * BLOCK_N, v_col], ready.index(slot), v_smem.index(slot))


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
                        o_row, o_col, start_m, n_iter, IS_CAUSAL: gl.constexpr):
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
    # Tile 0 alone: S, then P; the loop then issues QKᵀ of tile j with P·V of tile j-1.
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
    tma.async_copy_shared_to_global(o_desc, [o_row + GROUP * ROWS, o_col], q)
    tma.store_wait(0)


@gluon.jit
def _attn_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, LSE, qk_scale, SQ, SK,
                            IS_CAUSAL: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, COMPUTE_REGS: gl.constexpr,
                            V_SEQUENCE_MAJOR: gl.constexpr):
    # q/k descriptors read [B·H·S, D]; v's and O's layout is V_SEQUENCE_MAJOR's (``_rows_desc``);
    # SQ and SK are whole tiles. Largest causal query tiles first.
    start_m = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_M
    zh, z, h = _this_head()
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
    v_row0, v_col = _head_origin(z, h, SK, HEAD_D, V_SEQUENCE_MAJOR)
    o_row, o_col = _head_origin(z, h, SQ, HEAD_D, V_SEQUENCE_MAJOR)
    o_row += start_m
    lse = LSE + zh * SQ
    gl.warp_specialize([
        (_fwd_hopper_compute, (0, o_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, lse, qk_scale, o_row, o_col,
                               start_m, n_iter, IS_CAUSAL)),
        (_fwd_hopper_compute, (1, o_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, lse, qk_scale, o_row, o_col,
                               start_m, n_iter, IS_CAUSAL)),
        (_fwd_hopper_load, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, q_row, zh * SK,
                            v_row0, v_col, n_iter)),
    ], [4, 1], [COMPUTE_REGS, 24])


def hopper_fwd(q, k, v, is_causal: bool, scale: float):
    """Run the warp-specialized Gluon forward on inputs ``uses_hopper_kernels`` accepts; returns (out, lse)."""
    if _no_heads(q):
        return _empty_fwd(q, v)
    q4, k4 = (_as_4d(t).contiguous() for t in (q, k))
    v4 = _in_place_or_dense(v)
    Z, H, SQ, D = q4.shape
    SK = k4.shape[2]
    t = HOPPER_FWD
    out = empty_like_v((Z, H, SQ, D), q.dtype, v4)
    lse = torch.empty((Z, H, SQ), dtype=torch.float32, device=q.device)
    _attn_fwd_hopper_kernel[(SQ // t.block_m, H, Z)](
        _rows_desc(q4, t.block_m), _rows_desc(k4, t.block_n), _rows_desc(v4, t.block_n),
        _rows_desc(out, t.block_m // 2), lse, scale * LOG2E, SQ, SK,
        IS_CAUSAL=is_causal, HEAD_D=D, BLOCK_M=t.block_m, BLOCK_N=t.block_n, STAGES=t.num_stages,
        COMPUTE_REGS=HOPPER_FWD_COMPUTE_REGS, V_SEQUENCE_MAJOR=is_sequence_major(v4), num_warps=t.num_warps,
    )
    return out.view(q.shape), lse.view(q.shape[:-1])
