"""cstack::batched_qr / batched_geqrf: the Triton kernels (interpreter on CPU tensors, or a GPU)
against float64 and torch's QR, every kernel path, matrix kinds, NaN, bad input, opcheck,
fakes, autograd, and prefer_ours."""
import dataclasses

import pytest
import torch

from custom_ops import batched_qr as qr_pkg
from custom_ops.batched_qr import QRConfig, _triton_geqrf, _triton_qr, batched_geqrf, batched_qr, prefer_ours
from custom_ops.batched_qr.configs import table_prefers
from tests.helpers import HAS_CUDA

DEVICE = "cuda" if HAS_CUDA else "cpu"
EPS = 2.0**-24
# Small enough that the interpreter reaches every kernel on small matrices: 16×16 whole tiles,
# panels of 16 columns held in registers up to 32 rows and streamed in chunks of 16 rows above.
TINY = QRConfig(tile_max=16 * 16, nb=16, panel_max=32 * 16, stream_bm=16, bm=16, bn=16)
PATHS = {
    "tile": QRConfig(),                                # whole matrices in one register tile
    "panels": dataclasses.replace(TINY, panel_max=64 * 16),  # blocked, every panel in registers
    "streamed": dataclasses.replace(TINY, panel_max=0),      # blocked, every panel streamed
}


def kind_matrix(kind: str, shape, gen=None) -> torch.Tensor:
    """fp32 matrices [..., m, n] of one kind (float64 maths, then rounded)."""
    *batch, m, n = shape
    g = torch.randn(*shape, dtype=torch.float64, generator=gen)
    r = max(1, min(m, n) // 2)
    if kind == "gaussian":
        a = g
    elif kind == "rank_deficient":
        a = torch.randn(*batch, m, r, dtype=torch.float64) @ torch.randn(*batch, r, n, dtype=torch.float64)
    elif kind == "clustered":  # singular values in clusters at 1, 1e-2, 1e-4
        u, _ = torch.linalg.qr(torch.randn(*batch, m, m, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(*batch, n, n, dtype=torch.float64))
        k = min(m, n)
        s = torch.tensor([1.0, 1e-2, 1e-4], dtype=torch.float64)[torch.arange(k) % 3] * (1 + 1e-3 * torch.rand(k))
        a = (u[..., :k] * s) @ v[..., :k].mT
    elif kind == "row_scaled":
        a = 10.0 ** (8 * torch.rand(*batch, m, 1, dtype=torch.float64) - 4) * g
    elif kind == "collinear":
        a = torch.randn(*batch, m, 1, dtype=torch.float64) + 1e-4 * g
    else:
        raise ValueError(kind)
    return a.float()


def residual_orthogonality(A, Q, R):
    """Worst matrix: ‖A − QR‖_F/‖A‖_F and ‖QᵀQ − I‖_F, in float64."""
    a, q, r = (t.double().cpu() for t in (A, Q, R))
    res = torch.linalg.matrix_norm(a - q @ r) / torch.linalg.matrix_norm(a).clamp_min(1e-300)
    orth = torch.linalg.matrix_norm(q.mT @ q - torch.eye(q.shape[-1], dtype=torch.float64))
    return res.max().item(), orth.max().item()


def check_qr(A, cfg, *, match_torch=True):
    """Our Q, R (Triton path) against float64 backward error and, for full-rank input, torch's fp32 Q, R."""
    Q, R = _triton_qr(A.to(DEVICE), cfg)
    *batch, m, n = A.shape
    k = min(m, n)
    assert Q.shape == (*batch, m, k) and R.shape == (*batch, k, n)
    assert Q.is_contiguous() and R.is_contiguous()
    assert torch.equal(R.tril(-1), torch.zeros_like(R)), "R is not exactly upper triangular"
    res, orth = residual_orthogonality(A, Q, R)
    tol = 30 * EPS * max(m, n)
    assert res < tol and orth < tol, (res, orth, tol)
    if match_torch:  # LAPACK's signs: the same Q and R up to rounding
        Qt, Rt = torch.linalg.qr(A)
        torch.testing.assert_close(Q.cpu(), Qt, rtol=0, atol=1e-4)
        torch.testing.assert_close(R.cpu(), Rt, rtol=0, atol=1e-4 * Rt.abs().max().item())
    return Q, R


ODD_SHAPES = [(1, 1), (5, 3), (3, 5), (17, 17), (33, 20), (2, 3, 9, 6)]


@pytest.mark.parametrize("shape", ODD_SHAPES, ids=str)
def test_whole_tile_odd_shapes(shape):
    check_qr(torch.randn(shape), PATHS["tile"])


@pytest.mark.parametrize("path", ["panels", "streamed"])
@pytest.mark.parametrize("shape", [(40, 37), (2, 33, 20), (20, 35)], ids=str)
def test_blocked_paths(path, shape):
    """Several panels (one partial), trailing updates, Q formed by blocks; tall, batched and wide."""
    check_qr(torch.randn(shape), PATHS[path])


@pytest.mark.parametrize("kind", ["gaussian", "rank_deficient", "clustered", "row_scaled", "collinear"])
@pytest.mark.parametrize("path", ["tile", "panels"])
def test_matrix_kinds(kind, path):
    """Backward error of every kind; Q, R equal torch's where the factorisation is unique enough."""
    A = kind_matrix(kind, (2, 20, 20))
    check_qr(A, PATHS[path], match_torch=kind == "gaussian")


@pytest.mark.parametrize("path", ["tile", "panels", "streamed"])
def test_geqrf_equals_torch(path):
    A = torch.randn(2, 37, 21)
    a, tau = _triton_geqrf(A.to(DEVICE), PATHS[path])
    at, taut = torch.geqrf(A)
    assert a.shape == at.shape and tau.shape == taut.shape
    torch.testing.assert_close(a.cpu(), at, rtol=0, atol=2e-5 * at.abs().max().item())
    torch.testing.assert_close(tau.cpu(), taut, rtol=0, atol=2e-5)


@pytest.mark.parametrize("path", ["tile", "panels"])
def test_zero_columns_and_exact_zeros(path):
    """A zero column gives tau = 0 (H = I) and a zero on R's diagonal, as LAPACK; the rest stays exact."""
    A = torch.randn(1, 20, 18)
    A[..., 3] = 0.0
    A[..., 7] = A[..., 2]  # rank-deficient: a repeated column
    a, tau = _triton_geqrf(A.to(DEVICE), PATHS[path])
    assert tau[0, 3].item() == 0.0 and a[0, 3, 3].item() == 0.0
    check_qr(A, PATHS[path], match_torch=False)
    zeros = torch.zeros(3, 17, 17)
    Q, R = _triton_qr(zeros.to(DEVICE), PATHS[path])
    assert torch.equal(R.cpu(), zeros) and torch.equal(Q.cpu(), torch.eye(17).expand(3, 17, 17))


@pytest.mark.parametrize("scale", [1e-18, 1e18])
def test_extreme_scales_are_rescaled(scale):
    """Columns whose squared norm leaves fp32's comfortable range take the rescaled path."""
    A = torch.randn(2, 20, 20)
    Q, R = _triton_qr((A * scale).to(DEVICE), PATHS["tile"])
    Qt, Rt = torch.linalg.qr(A)
    torch.testing.assert_close(Q.cpu(), Qt, rtol=0, atol=1e-4)
    torch.testing.assert_close((R / scale).cpu(), Rt, rtol=0, atol=1e-4 * Rt.abs().max().item())


@pytest.mark.parametrize("path", ["tile", "streamed"])
def test_nan_stays_in_its_matrix(path):
    """A NaN reaches its own matrix's factors; every other matrix of the batch is bit-identical to
    its factorisation without the NaN (no host sync, no check)."""
    A = torch.randn(2, 18, 17)
    clean_q, clean_r = _triton_qr(A.to(DEVICE), PATHS[path])
    A[0, 5, 2] = float("nan")
    Q, R = _triton_qr(A.to(DEVICE), PATHS[path])
    assert Q[0].isnan().any() and R[0].isnan().any()
    assert torch.equal(Q[1], clean_q[1]) and torch.equal(R[1], clean_r[1])


def test_noncontiguous_and_empty_inputs():
    A = torch.randn(2, 20, 30).mT  # [2, 30, 20], not contiguous
    Q, R = _triton_qr(A.to(DEVICE), PATHS["tile"])
    torch.testing.assert_close(Q.cpu(), torch.linalg.qr(A)[0], rtol=0, atol=1e-4)
    for shape in [(0, 3), (3, 0), (2, 0, 4), (0, 5, 5)]:
        A = torch.randn(shape)
        for ours, theirs in ((_triton_qr(A, PATHS["tile"]), torch.linalg.qr(A)),
                             (_triton_geqrf(A, PATHS["tile"]), torch.geqrf(A)),
                             (batched_qr(A), torch.linalg.qr(A))):
            assert [t.shape for t in ours] == [t.shape for t in theirs]


@pytest.mark.parametrize("A, match", [
    ([[1.0, 2.0]], r"A: expected a torch.Tensor"),
    (torch.randn(4, 4, dtype=torch.float64), r"A: expected dtype torch.float32 \(float64"),
    (torch.randn(4, 4, dtype=torch.bfloat16), r"A: expected dtype torch.float32"),
    (torch.randn(4), r"A: expected a tensor of rank >= 2"),
], ids=["list", "fp64", "bf16", "rank1"])
def test_bad_input(A, match):
    for fn in (batched_qr, batched_geqrf, _triton_qr, _triton_geqrf):
        with pytest.raises(ValueError, match=match):
            fn(A)


def test_cpu_op_is_torch():
    A = torch.randn(2, 7, 5)
    Q, R = batched_qr(A)
    Qt, Rt = torch.linalg.qr(A)
    assert torch.equal(Q, Qt) and torch.equal(R, Rt) and Q.is_contiguous()
    a, tau = batched_geqrf(A)
    assert torch.equal(a, torch.geqrf(A)[0]) and torch.equal(tau, torch.geqrf(A)[1])


def test_opcheck():
    for A in (torch.randn(2, 6, 4, requires_grad=True), torch.randn(3, 5)):
        torch.library.opcheck(torch.ops.cstack.batched_qr.default, (A,))
    torch.library.opcheck(torch.ops.cstack.batched_geqrf.default, (torch.randn(2, 6, 4),))


def test_fake_shapes():
    with torch._subclasses.fake_tensor.FakeTensorMode():
        A = torch.empty(3, 2, 9, 5)
        Q, R = torch.ops.cstack.batched_qr(A)
        a, tau = torch.ops.cstack.batched_geqrf(torch.empty(4, 7))
    assert Q.shape == (3, 2, 9, 5) and R.shape == (3, 2, 5, 5) and Q.is_contiguous() and R.is_contiguous()
    assert a.shape == (4, 7) and tau.shape == (4,)


def test_backward_matches_torch():
    """The reduced-QR backward (m >= n) equals torch.linalg.qr's, both fp32 on the same input,
    with both gradients given and with Q's left undefined."""
    A = torch.randn(2, 9, 6)
    gQ, gR = torch.randn(2, 9, 6), torch.randn(2, 6, 6)
    for loss in (lambda Q, R: (Q * gQ).sum() + (R * gR).sum(), lambda Q, R: (R * gR).sum()):
        grads = []
        for fn in (batched_qr, torch.linalg.qr):
            x = A.clone().requires_grad_()
            loss(*fn(x)).backward()
            grads.append(x.grad)
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-4)


def test_backward_refusals():
    x = torch.randn(4, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match="m >= n only"):
        batched_qr(x)[0].sum().backward()
    with pytest.raises(RuntimeError, match="batched_geqrf has no derivative"):
        batched_geqrf(torch.randn(6, 4, requires_grad=True))[0].sum().backward()


def test_prefer_ours():
    assert not prefer_ours((640, 512, 512), "cpu")
    assert not prefer_ours((640, 512, 512), torch.device("cpu"), "geqrf")
    with pytest.raises(ValueError, match="op: expected 'qr' or 'geqrf'"):
        prefer_ours((4, 4), "cpu", op="svd")
    if HAS_CUDA:
        assert not prefer_ours((640, 512, 512), "cuda", dtype=torch.float64)
        assert not prefer_ours((0, 512, 512), "cuda")


def test_speed_table_rows_are_ordered():
    """Each row list is sorted by side, so table_prefers finds a shape's neighbours."""
    for ops in qr_pkg.SPEED_TABLE.values():
        for rows in ops.values():
            sides = [side for side, _ in rows]
            assert sides == sorted(sides)


def test_table_prefers_classes():
    rows = ((32, 1), (176, 1), (352, 4), (4096, None))
    assert table_prefers(rows, 8, 1) and table_prefers(rows, 176, 1)
    assert not table_prefers(rows, 200, 2) and table_prefers(rows, 200, 4)  # between 176 and 352: the stricter
    assert not table_prefers(rows, 352, 3) and table_prefers(rows, 352, 4)
    assert not table_prefers(rows, 1000, 1000) and not table_prefers(rows, 4096, 10**6)
    assert not table_prefers(rows, 5000, 10**6)
