"""The Triton Newton–Schulz kernels and their launcher ``newton_schulz_triton``.

One iteration is three launches, each one pass over its output tiles:
  A = X Xᵀ           ``_syrk_kernel``: A is symmetric, so only the tiles on and above the
                     diagonal are computed; each is stored twice (itself and its mirror);
  B = b·A + c·A Aᵀ   the same kernel on A (A² = A Aᵀ, symmetric too), epilogue b·A_tile + c·acc;
  X ← a·X + B X      ``_gemm_kernel``, a full product, epilogue a·X_tile + acc.
Operands in the input's dtype, fp32 accumulation, one rounding per stored element.

Every tile is read and written through TMA tensor descriptors over 2-D views whose rows are
the batch's matrices stacked, each a whole number of tiles of rows (copies padded with zero
rows where X is not; a padded row stays zero through every product), so no tile straddles two
matrices. Columns past the matrix read as zeros and are never written. A column-major X (what
Muon hands over for a weight it transposed) is read in place on the first step, through
descriptors over its transpose whose tiles the kernels transpose back (``XT``). The kernels run on any CUDA GPU with TMA
(sm_90+), and on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests check them: fp32
and fp16 there, as the interpreter's bf16 loads are wrong).
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from custom_ops.newton_schulz.configs import TILES, Tiles


@triton.jit
def _upper_tile(t):
    """The t-th tile (i, j), i <= j, of the upper triangle taken column by column: j is the largest
    with j(j+1)/2 <= t (a float square root, then corrected by one either way)."""
    j = ((tl.sqrt(8.0 * t + 1.0) - 1.0) * 0.5).to(tl.int32)
    j = tl.where(j * (j + 1) // 2 > t, j - 1, j)
    j = tl.where((j + 1) * (j + 2) // 2 <= t, j + 1, j)
    return t - j * (j + 1) // 2, j


@triton.jit
def _store_with_mirror(out_desc, tile, base, i, q, BLOCK: tl.constexpr):
    """Subtile (i, q) of the upper triangle (i <= q) at its place, and its transpose at (q, i); a
    subtile below the diagonal (i > q) is not stored: the program of (q, i) stores its mirror."""
    if i <= q:
        out_desc.store([base + i * BLOCK, q * BLOCK], tile)
    if i < q:
        out_desc.store([base + q * BLOCK, i * BLOCK], tile.T)


@triton.jit
def _syrk_kernel(x_desc, xc_desc, s_desc, out_desc, alpha, beta, ROWS, K, XT: tl.constexpr, HAS_S: tl.constexpr,
                 BLOCK: tl.constexpr, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    """out = alpha·S + beta·X Xᵀ (S symmetric, or absent) over the upper triangle, mirrored.

    The output is cut in square super tiles of SPLIT·BLOCK; the programs of one super tile on or
    above the diagonal each compute one [BLOCK, SPLIT·BLOCK] row slice of it (one tile-row i,
    tile-columns SPLIT·j ..), and store each of its SPLIT square subtiles with its mirror
    (``_store_with_mirror``). On the diagonal, the subtiles below it are computed and dropped.
    x_desc reads X in [BLOCK, BLOCK_K] tiles, xc_desc in [SPLIT·BLOCK, BLOCK_K] ones (XT: both
    read the stacked Xᵀ, [K rows per matrix], in the transposed tiles). Grid: (SPLIT ×
    upper-triangle super tiles, batch); matrix z's rows of S and out start at z·ROWS."""
    t = tl.program_id(0)
    p, j = _upper_tile(t // SPLIT)
    i = p * SPLIT + t % SPLIT
    z = tl.program_id(1)
    base = z * ROWS
    rows = base + i * BLOCK
    acc = tl.zeros((BLOCK, SPLIT * BLOCK), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if XT:
            x_i = x_desc.load([z * K + k, i * BLOCK]).T
            x_j = xc_desc.load([z * K + k, j * SPLIT * BLOCK])
        else:
            x_i = x_desc.load([rows, k])
            x_j = xc_desc.load([base + j * SPLIT * BLOCK, k]).T
        acc = tl.dot(x_i, x_j, acc, input_precision=PREC)
    acc = beta * acc
    if HAS_S:
        acc += alpha * s_desc.load([rows, j * SPLIT * BLOCK]).to(tl.float32)
    tile = acc.to(out_desc.dtype)
    if SPLIT == 1:
        _store_with_mirror(out_desc, tile, base, i, j, BLOCK)
    else:
        tl.static_assert(SPLIT == 2, "SPLIT is 1 or 2")
        left, right = tl.split(tile.reshape(BLOCK, 2, BLOCK).permute(0, 2, 1))
        _store_with_mirror(out_desc, left, base, i, 2 * j, BLOCK)
        _store_with_mirror(out_desc, right, base, i, 2 * j + 1, BLOCK)


@triton.jit
def _gemm_kernel(b_desc, x_desc, xe_desc, out_desc, a, ROWS, N, XT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PREC: tl.constexpr):
    """out = a·X + B X for one [BLOCK_M, BLOCK_N] tile (B: [ROWS, ROWS] per matrix, X: [ROWS, N]).
    Grid: (tiles of one matrix, batch), tiles in groups of GROUP_M row panels so that programs
    running together share X's column panels in L2. x_desc reads X in [BLOCK_K, BLOCK_N] tiles,
    xe_desc in output tiles (epilogue); XT: both read the stacked Xᵀ ([N rows per matrix]) in the
    transposed tiles."""
    pid = tl.program_id(0)
    tiles_m = ROWS // BLOCK_M
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first = pid // per_group * GROUP_M
    size = tl.minimum(tiles_m - first, GROUP_M)
    i = first + pid % per_group % size
    j = pid % per_group // size
    z = tl.program_id(1)
    base = z * ROWS
    rows, cols = base + i * BLOCK_M, j * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, ROWS, BLOCK_K):
        if XT:
            x_k = x_desc.load([z * N + cols, k]).T
        else:
            x_k = x_desc.load([base + k, cols])
        acc = tl.dot(b_desc.load([rows, k]), x_k, acc, input_precision=PREC)
    if XT:
        x_tile = xe_desc.load([z * N + cols, i * BLOCK_M]).T
    else:
        x_tile = xe_desc.load([rows, cols])
    acc += a * x_tile.to(tl.float32)
    out_desc.store([rows, cols], acc.to(out_desc.dtype))


class _Stacked:
    """A batch of matrices as one 2-D view for descriptors: ``rows`` rows per matrix (a multiple of
    the tiles), ``cols`` columns read and written, consecutive rows ``stride`` elements apart.

    ``transposed``: the view stacks the matrices' transposes instead (X stored column-major, read
    in place): ``cols`` rows per matrix, ``rows`` columns (past the matrix they read as zeros);
    its tiles are the transposes of X's, which the kernels (XT) transpose back."""

    def __init__(self, base: torch.Tensor, batch: int, rows: int, cols: int, stride: int, transposed=False):
        self.base, self.stride, self.transposed = base, stride, transposed
        self.shape = [batch * cols, rows] if transposed else [batch * rows, cols]

    def desc(self, block_rows: int, block_cols: int) -> TensorDescriptor:
        """A descriptor of [block_rows, block_cols] tiles of X (of Xᵀ: [block_cols, block_rows])."""
        block = [block_cols, block_rows] if self.transposed else [block_rows, block_cols]
        return TensorDescriptor(self.base, self.shape, [self.stride, 1], block)


def _padded(rows: int, cols: int, batch: int, like: torch.Tensor) -> _Stacked:
    """An uninitialised [batch, rows, cols] buffer (``.base``), its row stride rounded up to 16 bytes (TMA)."""
    step = 16 // like.element_size()
    buf = torch.empty((batch, rows, triton.cdiv(cols, step) * step), dtype=like.dtype, device=like.device)
    return _Stacked(buf, batch, rows, cols, buf.stride(1))


def _stack_input(w: torch.Tensor, rows: int, col_unit: int) -> _Stacked:
    """The iteration's first X, read in place when the layout allows, else a zero-padded copy:
      - row-major matrices of ``rows`` rows each, 16-byte aligned rows, stacked without gaps;
      - column-major ones (what Muon hands over for a weight it transposed), their columns
        16-byte aligned, stacked without gaps, and a whole number of ``col_unit`` columns each
        unless there is one matrix (a tile running past a matrix's last column would read the next
        one's first; past the last matrix it reads zeros)."""
    batch, m, n = w.shape
    size = w.element_size()
    aligned = w.data_ptr() % 16 == 0
    if (aligned and m == rows and w.stride(2) == 1 and w.stride(1) >= n and w.stride(1) * size % 16 == 0
            and (batch == 1 or w.stride(0) == m * w.stride(1))):
        return _Stacked(w, batch, rows, n, w.stride(1))
    if (aligned and w.stride(1) == 1 and w.stride(2) >= m and w.stride(2) * size % 16 == 0
            and (batch == 1 or (w.stride(0) == n * w.stride(2) and n % col_unit == 0))):
        return _Stacked(w, batch, m, n, w.stride(2), transposed=True)
    stacked = _padded(rows, n, batch, w)
    stacked.base[:, m:].zero_()
    stacked.base[:, :m, :n].copy_(w)
    return stacked


def _precision(dtype: torch.dtype) -> str:
    # fp32 operands must not silently drop to tf32 (tests compare them with float64).
    return "ieee" if dtype == torch.float32 else "tf32"


def newton_schulz_triton(x: torch.Tensor, steps: int, a: float, b: float, c: float,
                         tiles: Tiles = TILES) -> torch.Tensor:
    """``steps`` iterations X ← a·X + (b·A + c·A²)·X, A = X Xᵀ, of x ([m, n] or [B, m, n], any
    strides; bf16, fp16 or fp32), on x's transpose when m > n (the same result, fewer flops).
    Returns a new contiguous tensor of x's shape. Arguments must already be validated."""
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    transposed = x3.size(1) > x3.size(2)
    w = x3.mT if transposed else x3
    batch, m, n = w.shape
    rows = triton.cdiv(m, tiles.row_unit) * tiles.row_unit
    s, g, prec = tiles.syrk, tiles.gemm, _precision(x.dtype)

    src_v = _stack_input(w, rows, tiles.col_unit)
    a_v, b_v = _padded(rows, rows, batch, w), _padded(rows, rows, batch, w)
    # Two X buffers taken in turn, the last step writing into ``final``: when it has no padding and
    # needs no transposition, it is the returned tensor itself (``contiguous`` below copies nothing).
    final_v = _padded(rows, n, batch, w)
    spare_v = _padded(rows, n, batch, w) if steps > 1 else None

    a_store, a_tile = a_v.desc(s.block, s.block), a_v.desc(s.block, s.split * s.block)
    a_rows, a_cols = a_v.desc(s.block, s.block_k), a_v.desc(s.split * s.block, s.block_k)
    b_store, b_load = b_v.desc(s.block, s.block), b_v.desc(g.block_m, g.block_k)
    supers = rows // (s.split * s.block)
    syrk_grid = (s.split * supers * (supers + 1) // 2, batch)
    gemm_grid = ((rows // g.block_m) * triton.cdiv(n, g.block_n), batch)
    syrk_opts = dict(BLOCK=s.block, SPLIT=s.split, BLOCK_K=s.block_k, PREC=prec, num_warps=s.num_warps,
                     num_stages=s.num_stages)
    for k in range(steps):
        dst_v = final_v if (steps - 1 - k) % 2 == 0 else spare_v
        _syrk_kernel[syrk_grid](src_v.desc(s.block, s.block_k), src_v.desc(s.split * s.block, s.block_k), None,
                                a_store, 0.0, 1.0, rows, n, XT=src_v.transposed, HAS_S=False, **syrk_opts)
        _syrk_kernel[syrk_grid](a_rows, a_cols, a_tile, b_store, b, c, rows, rows, XT=False, HAS_S=True,
                                **syrk_opts)
        _gemm_kernel[gemm_grid](b_load, src_v.desc(g.block_k, g.block_n), src_v.desc(g.block_m, g.block_n),
                                dst_v.desc(g.block_m, g.block_n), a, rows, n, XT=src_v.transposed, BLOCK_M=g.block_m,
                                BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_M=g.group_m, PREC=prec,
                                num_warps=g.num_warps, num_stages=g.num_stages)
        src_v = dst_v
    out = final_v.base[:, :m, :n]
    return (out.mT if transposed else out).contiguous().reshape(x.shape)
