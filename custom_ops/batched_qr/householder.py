"""Triton device functions of one Householder step, shared by the register-resident and the
streaming kernels (``triton_kernels``): the same arithmetic whether a tile is the whole panel
or one chunk of its rows.

Coordinates: ``rows`` are global row indices of a tile, ``j`` the global index of the
reflector's diagonal row; ``c`` are the tile's local column indices and ``jj`` the local index
of the reflector's column (its global column is ``j`` too).

LAPACK's convention (slarfg): for the column x = (alpha, x₁…) below and on the diagonal,
beta = −sign(alpha)·‖x‖, tau = (beta − alpha)/beta, v = (1, x₁…/(alpha − beta)); when x₁… is
zero, tau = 0 and beta = alpha (H = I). One step of a column is fused with the gather of the
next: the dot products y = x₁…ᵀ·X and the diagonal row are reduced together, before v is
known, and w = vᵀX = row_j + y/(alpha − beta). Sums of squares and these products are formed
unscaled in fp32; a column whose squared norm leaves [2⁻¹⁰⁰, 2¹⁰⁰] (or is NaN) is redone with
x scaled by its largest magnitude (``NORM_LO``/``NORM_HI``, the slow path), as snrm2 would.

Loops over runtime bounds are ``while`` loops: the Triton 3.6 interpreter holds scalars as
1-element numpy arrays, which numpy >= 2.4 refuses to turn into the Python int range() needs.
"""
import triton
import triton.language as tl

NORM_LO = tl.constexpr(2.0**-100)
NORM_HI = tl.constexpr(2.0**100)


@triton.jit
def pick(vec, idx, i):
    """vec[i] for a runtime i (a masked sum: registers cannot be indexed)."""
    return tl.sum(tl.where(idx == i, vec, 0.0), axis=0)


@triton.jit
def column(X, jj):
    """Column jj of the tile X: a gather along the columns, which Triton lowers to one warp shuffle
    an element when a row's columns lie in one warp (a masked sum there took a 5-step butterfly).
    jj past the last column (the gather after a panel's last step, never used) reads the last."""
    index = tl.zeros([X.shape[0], 1], dtype=tl.int32) + tl.minimum(jj, X.shape[1] - 1)
    return tl.reshape(tl.gather(X, index, axis=1), [X.shape[0]])


@triton.jit
def gather_terms(X, rows, j, jj, inv_scale):
    """This tile's share of (row_j, y) for the reflector at (j, jj): X's row j, and
    Σ_{rows > j} (x_r·inv_scale)·X[r, :] with x = X[:, jj]."""
    x = tl.where(rows > j, column(X, jj) * inv_scale, 0.0)
    return tl.where(rows[:, None] == j, X, 0.0), x[:, None] * X


@triton.jit
def column_absmax(X, rows, j, jj):
    """max |X[r, jj]| over rows r >= j, NaN counted as +inf (so that it reaches the result)."""
    x = tl.where(rows >= j, column(X, jj), 0.0)
    return tl.max(tl.where(x != x, float("inf"), tl.abs(x)), axis=0)


@triton.jit
def needs_rescale(alpha, sigma):
    """Whether alpha² + sigma left the range where unscaled fp32 sums are exact enough (or is NaN)."""
    ss = alpha * alpha + sigma
    return ~((ss >= NORM_LO) & (ss <= NORM_HI))


@triton.jit
def reflector(alpha, sigma, scale):
    """(beta, tau, vscale, wscale) from alpha and sigma = Σ(x₁…/scale)²: v₁… = x₁…·vscale and
    w = row_j + y·wscale, y formed with x₁…/scale."""
    a = alpha / scale
    norm = scale * tl.sqrt_rn(a * a + sigma)
    beta = tl.where(alpha >= 0, -norm, norm)
    identity = sigma == 0.0
    beta = tl.where(identity, alpha, beta)
    # the denominators of H = I are never used: 1 there keeps 0/0 out of the interpreter's warnings
    tau = tl.where(identity, 0.0, (beta - alpha) / tl.where(identity, 1.0, beta))
    vscale = tl.where(identity, 0.0, 1.0 / tl.where(identity, 1.0, alpha - beta))
    return beta, tau, vscale, vscale * scale


@triton.jit
def apply_reflector(X, rows, c, j, jj, beta, tau, vscale, w):
    """X after H = I − tau·v·vᵀ on its columns right of jj; column jj becomes (beta, v₁…)."""
    x = column(X, jj)
    v = tl.where(rows == j, 1.0, tl.where(rows > j, x * vscale, 0.0))
    updated = X - (tau * v)[:, None] * w[None, :]
    reflected = tl.where(rows == j, beta, tl.where(rows > j, v, x))
    return tl.where(c[None, :] > jj, updated, tl.where(c[None, :] == jj, reflected[:, None], X))


@triton.jit
def unit_lower(X, rows, cols, col_ok):
    """The reflectors V stored in X (rows, cols global): 1 on the diagonal, X below it, 0 above
    and in columns that hold no reflector."""
    v = tl.where(rows[:, None] > cols[None, :], X, tl.where(rows[:, None] == cols[None, :], 1.0, 0.0))
    return tl.where(col_ok[None, :], v, 0.0)


@triton.jit
def build_t(G, taus, c, nref):
    """The upper-triangular T of the compact WY form H₁…H_nb = I − V·T·Vᵀ (slarft, forward,
    columnwise) from the Gram matrix G = VᵀV: T[:i, i] = −tau_i·T[:i, :i]·G[:i, i], T[i, i] = tau_i."""
    T = tl.zeros_like(G)
    i = nref * 0
    while i < nref:
        tau = pick(taus, c, i)
        g = tl.where(c < i, column(G, i), 0.0)
        t = tl.where(c == i, tau, -tau * tl.sum(T * g[None, :], axis=1))
        T = tl.where(c[None, :] == i, t[:, None], T)
        i += 1
    return T
