"""The batched QR's Triton kernels and their launchers (``triton_geqrf``, ``triton_qr``).

Every kernel's grid has the batch as its first axis, so a batch of B matrices is one launch
per step, whatever B. Three kernels:
- ``_tile_kernel``: a tile held in registers, factored column by column. It is either a
  whole small matrix (geqrf, and Q and R when asked for) or one panel of nb columns of a
  blocked factorisation (then also the panel's T factor);
- ``_panel_stream_kernel``: the same panel factorisation for panels too tall for registers,
  streaming row chunks through L2, one pass a column;
- ``_apply_kernel``: one block of reflectors in compact WY form on a tile of columns,
  C ← (I − V·Tᵀ·Vᵀ)·C for the trailing update of the factorisation, C ← (I − V·T·Vᵀ)·C for Q,
  built from the identity with the blocks taken backwards (as sorgqr does).
fp32 throughout; ``tl.dot`` at the precision the config names ("ieee", or "tf32x3": TF32 alone
loses about 3 digits and spoils orthogonality). The kernels run on any CUDA GPU and, under
``TRITON_INTERPRET=1``, on CPU tensors (how the tests check them).
"""
import torch
import triton
import triton.language as tl

from custom_ops.batched_qr.configs import QRConfig, tile_warps
from custom_ops.batched_qr.householder import (apply_reflector, build_t, column, column_absmax, gather_terms,
                                               needs_rescale, pick, reflector, unit_lower)

T_ROWS = tl.constexpr(32)  # rows a chunk of _store_t


@triton.jit(do_not_specialize=["k0", "nref", "blk"])
def _tile_kernel(src_ptr, a_ptr, tau_ptr, t_ptr, q_ptr, r_ptr, m, n, k, k0, nref, blk, nblocks,
                 ROWS: tl.constexpr, COLS: tl.constexpr, WANT_A: tl.constexpr, WANT_T: tl.constexpr,
                 WANT_Q: tl.constexpr, PRECISION: tl.constexpr):
    """Factor rows [k0, m) × columns [k0, k0 + COLS) of matrix program_id(0), held in registers:
    nref = min(k − k0, COLS) reflectors. Reads src; writes the factored tile and tau to a (WANT_A),
    the panel's T to t[b, blk] (WANT_T), Q [m, k] and R [k, n] (WANT_Q: the tile is the whole matrix)."""
    b = tl.program_id(0).to(tl.int64)
    rows = k0 + tl.arange(0, ROWS)
    c = tl.arange(0, COLS)
    cols = k0 + c
    in_a = (rows < m)[:, None] & (cols < n)[None, :]
    offsets = b * m * n + rows[:, None] * n + cols[None, :]
    X = tl.load(src_ptr + offsets, mask=in_a, other=0.0)
    taus = tl.zeros([COLS], dtype=tl.float32)
    row_terms, y_terms = gather_terms(X, rows, k0, 0, 1.0)
    row_j = tl.sum(row_terms, axis=0)
    y = tl.sum(y_terms, axis=0)
    jj = nref * 0
    while jj < nref:
        j = k0 + jj
        alpha = pick(row_j, c, jj)
        sigma = pick(y, c, jj)
        scale = tl.full([], 1.0, tl.float32)
        if needs_rescale(alpha, sigma):
            scale = column_absmax(X, rows, j, jj)
            scale = tl.where(scale == 0.0, 1.0, scale)
            _, y_terms = gather_terms(X, rows, j, jj, 1.0 / scale)
            y = tl.sum(y_terms, axis=0)
            sigma = pick(y, c, jj) / scale
        beta, tau, vscale, wscale = reflector(alpha, sigma, scale)
        X = apply_reflector(X, rows, c, j, jj, beta, tau, vscale, row_j + y * wscale)
        taus = tl.where(c == jj, tau, taus)
        row_terms, y_terms = gather_terms(X, rows, j + 1, jj + 1, 1.0)
        row_j = tl.sum(row_terms, axis=0)
        y = tl.sum(y_terms, axis=0)
        jj += 1
    if WANT_A:
        tl.store(a_ptr + offsets, X, mask=in_a)
        tl.store(tau_ptr + b * k + cols, taus, mask=c < nref)
    if WANT_T:
        tl.debug_barrier()
        _store_t(a_ptr + b * m * n, t_ptr + (b * nblocks + blk) * COLS * COLS, m, n, k0, nref, taus, COLS,
                 PRECISION)
    if WANT_Q:
        Q = tl.where(rows[:, None] == cols[None, :], 1.0, 0.0)
        jj = nref - 1
        while jj >= 0:
            v = tl.where(rows > jj, column(X, jj), tl.where(rows == jj, 1.0, 0.0))
            w = tl.sum(v[:, None] * Q, axis=0)
            Q = Q - (pick(taus, c, jj) * v)[:, None] * w[None, :]
            jj -= 1
        tl.store(q_ptr + b * m * k + rows[:, None] * k + cols[None, :], Q,
                 mask=(rows < m)[:, None] & (cols < k)[None, :])
        tl.store(r_ptr + b * k * n + rows[:, None] * n + cols[None, :],
                 tl.where(rows[:, None] <= cols[None, :], X, 0.0), mask=(rows < k)[:, None] & (cols < n)[None, :])


@triton.jit
def _chunk(a_base, r0, m, n, cols, col_ok, BM: tl.constexpr):
    """Rows [r0, r0 + BM) of the given columns: (pointers, mask, rows); outside the matrix masked."""
    rows = r0 + tl.arange(0, BM)
    return a_base + rows[:, None] * n + cols[None, :], (rows < m)[:, None] & col_ok[None, :], rows


@triton.jit
def _load(a_base, r0, m, n, cols, col_ok, BM: tl.constexpr):
    """The values of _chunk (zeros outside the matrix). The loops over chunks are while loops, which
    Triton does not pipeline: each loads its next chunk before working on the current one, so that
    the load's latency overlaps the work (only the values are carried: pointers cost registers)."""
    ptrs, mask, _ = _chunk(a_base, r0, m, n, cols, col_ok, BM)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store_t(a_base, t_base, m, n, k0, nref, taus, NB: tl.constexpr, PRECISION: tl.constexpr):
    """The T factor of the factored panel at columns [k0, k0 + NB) into t_base, from VᵀV read back
    from memory T_ROWS rows at a time (a tall panel's VᵀV in one tl.dot overflows shared memory,
    and chunks of 128 rows made the kernels spill registers)."""
    BM: tl.constexpr = T_ROWS
    c = tl.arange(0, NB)
    cols = k0 + c
    G = tl.zeros([NB, NB], dtype=tl.float32)
    r0 = k0
    X = _load(a_base, r0, m, n, cols, cols < n, BM)
    while r0 < m:
        next_X = _load(a_base, r0 + BM, m, n, cols, cols < n, BM)
        V = unit_lower(X, r0 + tl.arange(0, BM), cols, c < nref)
        G = tl.dot(tl.trans(V), V, G, input_precision=PRECISION)
        X = next_X
        r0 += BM
    tl.store(t_base + c[:, None] * NB + c[None, :], build_t(G, taus, c, nref))


@triton.jit
def _stream_gather(a_base, m, n, k0, j, jj, cols, col_ok, inv_scale, BM: tl.constexpr, NB: tl.constexpr):
    """(row_j, y) of the reflector at (j, jj), over the chunks of rows >= j (chunks aligned at k0)."""
    row_acc = tl.zeros([BM, NB], dtype=tl.float32)
    y_acc = tl.zeros([BM, NB], dtype=tl.float32)
    r0 = k0 + (jj // BM) * BM
    X = _load(a_base, r0, m, n, cols, col_ok, BM)
    while r0 < m:
        next_X = _load(a_base, r0 + BM, m, n, cols, col_ok, BM)
        row_t, y_t = gather_terms(X, r0 + tl.arange(0, BM), j, jj, inv_scale)
        row_acc += row_t
        y_acc += y_t
        X = next_X
        r0 += BM
    return tl.sum(row_acc, axis=0), tl.sum(y_acc, axis=0)


@triton.jit
def _stream_absmax(a_base, m, n, k0, j, jj, cols, col_ok, BM: tl.constexpr):
    """column_absmax over the chunks of rows >= j."""
    result = tl.full([], 0.0, tl.float32)
    r0 = k0 + (jj // BM) * BM
    while r0 < m:
        X = _load(a_base, r0, m, n, cols, col_ok, BM)
        result = tl.maximum(result, column_absmax(X, r0 + tl.arange(0, BM), j, jj))
        r0 += BM
    return result


@triton.jit(do_not_specialize=["k0", "nref", "blk"])
def _panel_stream_kernel(a_ptr, tau_ptr, t_ptr, m, n, k, k0, nref, blk, nblocks, NB: tl.constexpr, BM: tl.constexpr,
                         PRECISION: tl.constexpr):
    """Factor the panel rows [k0, m) × columns [k0, k0 + NB) of matrix program_id(0) in place, one
    pass over its row chunks a column (the step of column j fused with the gather of column j + 1),
    then its T factor into t[b, blk]. A barrier ends each pass: the next reads what other threads
    of this program wrote."""
    b = tl.program_id(0).to(tl.int64)
    a_base = a_ptr + b * m * n
    c = tl.arange(0, NB)
    cols = k0 + c
    col_ok = cols < n
    taus = tl.zeros([NB], dtype=tl.float32)
    row_j, y = _stream_gather(a_base, m, n, k0, k0, 0, cols, col_ok, 1.0, BM, NB)
    jj = nref * 0
    while jj < nref:
        j = k0 + jj
        alpha = pick(row_j, c, jj)
        sigma = pick(y, c, jj)
        scale = tl.full([], 1.0, tl.float32)
        if needs_rescale(alpha, sigma):
            scale = _stream_absmax(a_base, m, n, k0, j, jj, cols, col_ok, BM)
            scale = tl.where(scale == 0.0, 1.0, scale)
            _, y = _stream_gather(a_base, m, n, k0, j, jj, cols, col_ok, 1.0 / scale, BM, NB)
            sigma = pick(y, c, jj) / scale
        beta, tau, vscale, wscale = reflector(alpha, sigma, scale)
        w = row_j + y * wscale
        taus = tl.where(c == jj, tau, taus)
        row_acc = tl.zeros([BM, NB], dtype=tl.float32)
        y_acc = tl.zeros([BM, NB], dtype=tl.float32)
        r0 = k0 + (jj // BM) * BM
        X = _load(a_base, r0, m, n, cols, col_ok, BM)
        while r0 < m:
            next_X = _load(a_base, r0 + BM, m, n, cols, col_ok, BM)
            ptrs, in_a, rows = _chunk(a_base, r0, m, n, cols, col_ok, BM)
            X = apply_reflector(X, rows, c, j, jj, beta, tau, vscale, w)
            tl.store(ptrs, X, mask=in_a)
            row_t, y_t = gather_terms(X, rows, j + 1, jj + 1, 1.0)
            row_acc += row_t
            y_acc += y_t
            X = next_X
            r0 += BM
        row_j = tl.sum(row_acc, axis=0)
        y = tl.sum(y_acc, axis=0)
        tl.debug_barrier()
        jj += 1
    tl.store(tau_ptr + b * k + cols, taus, mask=c < nref)
    _store_t(a_base, t_ptr + (b * nblocks + blk) * NB * NB, m, n, k0, nref, taus, NB, PRECISION)


@triton.jit(do_not_specialize=["k0", "nref", "blk", "col0"])
def _apply_kernel(a_ptr, t_ptr, c_ptr, m, n, k0, nref, blk, nblocks, ldc, col0, col1, NB: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, TRANS_T: tl.constexpr, PRECISION: tl.constexpr):
    """Rows [k0, m) × columns [col0 + BN·program_id(1), …) ∩ [col0, col1) of C (row stride ldc) of
    matrix program_id(0) ← (I − V·op(T)·Vᵀ)·C, with V the reflectors a holds in columns
    [k0, k0 + NB) and T = t[b, blk]; op(T) = Tᵀ when TRANS_T (Qᵀ·C, the trailing update), else T
    (Q·C, forming Q). Two passes over the rows: W = Vᵀ·C, then C −= V·(op(T)·W)."""
    b = tl.program_id(0).to(tl.int64)
    a_base = a_ptr + b * m * n
    c_base = c_ptr + b * m * ldc
    vc = tl.arange(0, NB)
    vcols = k0 + vc
    v_ok = vc < nref
    ccols = col0 + tl.program_id(1) * BN + tl.arange(0, BN)
    c_ok = ccols < col1
    W = tl.zeros([NB, BN], dtype=tl.float32)
    r0 = k0
    V = _load(a_base, r0, m, n, vcols, v_ok, BM)
    C = _load(c_base, r0, m, ldc, ccols, c_ok, BM)
    while r0 < m:
        next_V = _load(a_base, r0 + BM, m, n, vcols, v_ok, BM)
        next_C = _load(c_base, r0 + BM, m, ldc, ccols, c_ok, BM)
        V = unit_lower(V, r0 + tl.arange(0, BM), vcols, v_ok)
        W = tl.dot(tl.trans(V), C, W, input_precision=PRECISION)
        V, C = next_V, next_C
        r0 += BM
    T = tl.load(t_ptr + ((b * nblocks + blk) * NB + vc[:, None]) * NB + vc[None, :])
    if TRANS_T:
        T = tl.trans(T)
    W = tl.dot(T, W, input_precision=PRECISION)
    r0 = k0
    V = _load(a_base, r0, m, n, vcols, v_ok, BM)
    C = _load(c_base, r0, m, ldc, ccols, c_ok, BM)
    while r0 < m:
        next_V = _load(a_base, r0 + BM, m, n, vcols, v_ok, BM)
        next_C = _load(c_base, r0 + BM, m, ldc, ccols, c_ok, BM)
        c_ptrs, c_in, rows = _chunk(c_base, r0, m, ldc, ccols, c_ok, BM)
        V = unit_lower(V, rows, vcols, v_ok)
        tl.store(c_ptrs, C - tl.dot(V, W, input_precision=PRECISION), mask=c_in)
        V, C = next_V, next_C
        r0 += BM


def _tile_shape(m: int, n: int) -> tuple[int, int]:
    """A whole matrix's register tile: each side a power of two, at least 16 (tl.dot's least)."""
    return max(16, triton.next_power_of_2(m)), max(16, triton.next_power_of_2(n))


def fits_one_tile(m: int, n: int, cfg: QRConfig) -> bool:
    rows, cols = _tile_shape(m, n)
    return rows * cols <= cfg.tile_max


def _whole_tile(A, cfg, want_q):
    """One launch: the tile kernel on whole matrices of A [B, m, n] (contiguous fp32, only read)."""
    B, m, n = A.shape
    k = min(m, n)
    rows, cols = _tile_shape(m, n)
    if want_q:
        Q, R = A.new_empty(B, m, k), A.new_empty(B, k, n)
        out = (A, A, A, Q, R)  # a, tau, T unused
    else:
        a, tau = torch.empty_like(A), A.new_empty(B, k)
        out = (a, tau, A, A, A)
    _tile_kernel[(B,)](A, *out, m, n, k, 0, k, 0, 1, ROWS=rows, COLS=cols, WANT_A=not want_q, WANT_T=False,
                       WANT_Q=want_q, PRECISION=cfg.precision, num_warps=tile_warps(rows * cols))
    return (Q, R) if want_q else (a, tau)


def _factor_blocked(a, cfg):
    """Factor a [B, m, n] in place by panels of cfg.nb columns; returns tau [B, k] and the panels'
    T factors [B, nblocks, nb, nb]."""
    B, m, n = a.shape
    k, nb = min(m, n), cfg.nb
    nblocks = triton.cdiv(k, nb)
    tau = a.new_empty(B, k)
    T = a.new_empty(B, nblocks, nb, nb)
    for blk in range(nblocks):
        k0 = blk * nb
        nref = min(k - k0, nb)
        rows = max(16, triton.next_power_of_2(m - k0))
        if rows * nb <= cfg.panel_max:
            _tile_kernel[(B,)](a, a, tau, T, a, a, m, n, k, k0, nref, blk, nblocks, ROWS=rows, COLS=nb, WANT_A=True,
                               WANT_T=True, WANT_Q=False, PRECISION=cfg.precision,
                               num_warps=tile_warps(rows * nb))
        else:
            _panel_stream_kernel[(B,)](a, tau, T, m, n, k, k0, nref, blk, nblocks, NB=nb, BM=cfg.stream_bm,
                                       PRECISION=cfg.precision, num_warps=cfg.stream_warps)
        if k0 + nb < n:
            _apply(a, T, a, k0, blk, n, k0 + nb, n, cfg, trans_t=True)
    return tau, T


def _apply(a, T, C, k0, blk, ldc, col0, col1, cfg, trans_t):
    B, m, n = a.shape
    grid = (B, triton.cdiv(col1 - col0, cfg.bn))
    nref = min(min(m, n) - k0, cfg.nb)
    _apply_kernel[grid](a, T, C, m, n, k0, nref, blk, T.shape[1], ldc, col0, col1, NB=cfg.nb, BM=cfg.bm,
                        BN=cfg.bn, TRANS_T=trans_t, PRECISION=cfg.precision, num_warps=cfg.apply_warps)


def _form_q(a, T, cfg):
    """Q [B, m, k] = H₁…H_k·I[:, :k]: the blocks applied backwards, each to the rows and columns
    from its own first column on (the rest of Q is still the identity's there)."""
    B, m, n = a.shape
    k = min(m, n)
    Q = torch.eye(m, k, dtype=a.dtype, device=a.device).expand(B, m, k).contiguous()
    for blk in reversed(range(T.shape[1])):
        k0 = blk * cfg.nb
        _apply(a, T, Q, k0, blk, k, k0, k, cfg, trans_t=False)
    return Q


def triton_geqrf(A: torch.Tensor, cfg: QRConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, tau) as torch.geqrf of A [B, m, n] (contiguous fp32, B >= 1, min(m, n) >= 1; only read)."""
    B, m, n = A.shape
    if fits_one_tile(m, n, cfg):
        return _whole_tile(A, cfg, want_q=False)
    a = A.clone()
    tau, _ = _factor_blocked(a, cfg)
    return a, tau


def triton_qr(A: torch.Tensor, cfg: QRConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, R) as torch.linalg.qr (reduced) of A [B, m, n] (contiguous fp32, B >= 1, min(m, n) >= 1; only read)."""
    B, m, n = A.shape
    k = min(m, n)
    if fits_one_tile(m, n, cfg):
        return _whole_tile(A, cfg, want_q=True)
    a = A.clone()
    _, T = _factor_blocked(a, cfg)
    return _form_q(a, T, cfg), a[:, :k, :].triu()
