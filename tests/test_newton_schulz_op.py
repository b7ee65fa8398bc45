"""cstack::newton_schulz: float64 references with first-order rounding bounds, the Triton kernels
(CPU tensors under the interpreter in fp32/fp16, CUDA tensors in bf16/fp16), the CPU op, the
transposed (m > n) case, ``zeropower``, bad input, opcheck, fake tensors, and the backward that
raises."""
import pytest
import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensorMode

from custom_ops.newton_schulz import MUON_COEFFICIENTS, Gemm, Syrk, Tiles, newton_schulz_triton, zeropower
from custom_ops.newton_schulz.triton_kernels import _stack_input, _upper_tile
from tests.helpers import HAS_CUDA

A, B, C = MUON_COEFFICIENTS
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DEVICE = "cuda" if HAS_CUDA else "cpu"
# The interpreter's bf16 loads are wrong: there the kernels are checked in fp32 and fp16.
TRITON_DTYPES = (BF16, FP16) if HAS_CUDA else (FP32, FP16)
UNIT_ROUNDOFF = {FP32: 2**-24, FP16: 2**-11, BF16: 2**-8}
FP32_EPS = 2**-24  # the kernels' (and cpu.py's) fp32 accumulation
# Tiles small enough that the shapes below span several tiles and super tiles a side, with a
# partial last one: one subtile per program, and two (a GEMM tile taller than it is wide).
SMALL_TILES = {
    "split1": Tiles(Syrk(16, 1, 16, 4, 2), Gemm(16, 32, 16, 2, 4, 2)),
    "split2": Tiles(Syrk(16, 2, 16, 4, 2), Gemm(32, 16, 16, 2, 4, 2)),
}
# Wide, tall, a batch, and sizes that leave partial tiles (70×100: 5 subtiles, 3 super tiles a side).
SHAPES = [(5, 7), (7, 5), (33, 17), (3, 9, 20), (70, 100)]


pytestmark = pytest.mark.usefixtures("scalar_loop_bounds")


def make_x(shape, dtype, device=DEVICE):
    """A random X normalised per matrix as Muon does before the iterations (Frobenius norm 1)."""
    x = torch.randn(shape, dtype=torch.float64)
    return (x / x.norm(dim=(-2, -1), keepdim=True)).to(device, dtype)


def reference_step(x):
    """One iteration of x in float64, as given, and a bound on |ours − it| elementwise.

    The bound is first order in the rounding of the orientation the op iterates (xᵀ when x has
    more rows than columns): A, B and the new X each rounded once to x's dtype (unit roundoff u,
    relative), and every fp32 sum of k products off by at most k·2⁻²⁴ of the sum of their
    magnitudes; an error in A reaches A² as |A|·|E| + |E|·|A|."""
    u = UNIT_ROUNDOFF[x.dtype]
    x64 = x.double().cpu()
    gram = x64 @ x64.mT
    expected = A * x64 + (B * gram + C * gram @ gram) @ x64
    tall = x.size(-2) > x.size(-1)
    w = x64.mT if tall else x64
    k_n, k_m = w.size(-1), w.size(-2)
    gram = w @ w.mT
    poly = B * gram + C * gram @ gram
    new = A * w + poly @ w
    aw, ag = w.abs(), gram.abs()
    d_gram = u * ag + k_n * FP32_EPS * (aw @ aw.mT)
    d_poly = u * poly.abs() + abs(B) * d_gram + abs(C) * (d_gram @ ag + ag @ d_gram + k_m * FP32_EPS * (ag @ ag))
    d_new = u * new.abs() + d_poly @ aw + k_m * FP32_EPS * (poly.abs() @ aw)
    return expected, (d_new.mT if tall else d_new)


def reference_steps(x, steps):
    x64 = x.double().cpu()
    for _ in range(steps):
        gram = x64 @ x64.mT
        x64 = A * x64 + (B * gram + C * gram @ gram) @ x64
    return x64


def assert_one_step(actual, x):
    """Within twice the first-order bound (the factor covers second-order terms and the fp32
    epilogue sums) of the float64 step from the same x."""
    expected, bound = reference_step(x)
    assert actual.shape == x.shape and actual.dtype == x.dtype and actual.is_contiguous()
    err = (actual.double().cpu() - expected).abs()
    worst = (err / bound).max().item()
    assert worst <= 2.0, f"error {worst:.2f}x the rounding bound"


def assert_five_steps(run, x):
    """Five steps: the same as five single steps, bit for bit, each within the one-step bound; and
    within 4·steps·(u + k·2⁻²⁴) of the float64 iteration in norm. Each step's own error is below
    u + k·2⁻²⁴ (normwise, checked above per element); on the Muon band an earlier step's error
    grows by a small factor over the later steps (measured below 2×): 4× leaves room."""
    out = run(x, 5)
    y = x
    for _ in range(5):
        y_next = run(y, 1)
        assert_one_step(y_next, y)
        y = y_next
    assert torch.equal(out, y)
    ref = reference_steps(x, 5)
    rel = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert rel <= 4 * 5 * (UNIT_ROUNDOFF[x.dtype] + max(x.shape[-2:]) * FP32_EPS), rel


def triton_run(tiles):
    return lambda x, steps: newton_schulz_triton(x, steps, A, B, C, tiles=tiles)


def op_run(x, steps):
    return torch.ops.cstack.newton_schulz(x, steps, A, B, C)


# --------------------------------------------------------------------------- the Triton kernels


@triton.jit
def _upper_tile_probe(out_ptr):
    t = tl.program_id(0)
    i, j = _upper_tile(t)
    tl.store(out_ptr + 2 * t, i)
    tl.store(out_ptr + 2 * t + 1, j)


def test_upper_tile_order():
    """Program t's tile is the t-th of the upper triangle, column by column; on a GPU up to 4,000
    tiles a side, where the float square root alone would be off by one."""
    side = 4000 if HAS_CUDA else 30
    j = torch.arange(side).repeat_interleave(torch.arange(1, side + 1))
    i = torch.arange(len(j)) - j * (j + 1) // 2
    expected = torch.stack([i, j], dim=1).int()
    out = torch.empty_like(expected, device=DEVICE)
    _upper_tile_probe[(len(expected),)](out)
    assert torch.equal(out.cpu(), expected)



@pytest.mark.parametrize("tiles", SMALL_TILES)
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_one_step(shape, dtype, tiles):
    x = make_x(shape, dtype)
    assert_one_step(newton_schulz_triton(x, 1, A, B, C, tiles=SMALL_TILES[tiles]), x)


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("shape", [(33, 17), (3, 9, 20)])
def test_triton_five_steps(shape, dtype):
    assert_five_steps(triton_run(SMALL_TILES["split2"]), make_x(shape, dtype))


@pytest.mark.parametrize("shape", [(2, 32, 48), (24, 45), (2, 16, 40)])
def test_triton_layouts(shape):
    """X read in place (row-major: dense, or rows of a wider buffer; column-major, as Muon hands
    over a weight it transposed, or a row-major tall X's transpose) or copied (column-major with a
    partial last column tile in a batch, a batch with gaps between matrices): each within the
    rounding bound, and row-major X read in place the same bits as copied."""
    dtype, tiles = TRITON_DTYPES[0], SMALL_TILES["split2"]
    run = triton_run(tiles)
    *lead, m, n = shape
    x = make_x(shape, dtype)
    wide = torch.zeros(*lead, m, n + 16, dtype=dtype, device=DEVICE)[..., :n]
    wide.copy_(x)
    gapped = torch.zeros(2 * len(x), m, n, dtype=dtype, device=DEVICE)[::2] if lead else x.clone()
    gapped.copy_(x)
    rows = triton.cdiv(m, tiles.row_unit) * tiles.row_unit
    row_major = m == rows and n * x.element_size() % 16 == 0
    column_major = not lead or n % tiles.col_unit == 0
    for layout, in_place in ((x, row_major), (wide, row_major), (gapped, row_major and not lead),
                             (x.mT.contiguous().mT, column_major), (x.mT.contiguous(), column_major)):
        w = layout if layout.dim() == 3 else layout.unsqueeze(0)
        w = w.mT if w.size(1) > w.size(2) else w
        assert (_stack_input(w, rows, tiles.col_unit).base is w) == in_place
        assert_one_step(run(layout, 1), layout)
    assert torch.equal(run(wide, 1), run(x, 1)) and torch.equal(run(gapped, 1), run(x, 1))


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(300, 520), (520, 300), (2, 256, 384)])
def test_cuda_op_default_tiles(shape):
    x = make_x(shape, BF16)
    assert_one_step(op_run(x, 1), x)
    assert_five_steps(op_run, make_x(shape[-2:], BF16))


# --------------------------------------------------------------------------- the CPU op


@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_op_one_step(shape):
    x = make_x(shape, BF16, "cpu")
    assert_one_step(op_run(x, 1), x)


@pytest.mark.parametrize("shape", [(33, 17), (3, 9, 20)])
def test_cpu_op_five_steps(shape):
    assert_five_steps(op_run, make_x(shape, BF16, "cpu"))


def test_tall_is_iterating_as_given():
    """m > n: the op iterates on Xᵀ; the float64 reference iterates on X as given (33×33 A)."""
    x = make_x((33, 17), BF16, "cpu")
    assert op_run(x, 1).shape == (33, 17)
    assert_one_step(op_run(x, 1), x)
    assert torch.equal(op_run(x, 3), op_run(x.mT.contiguous(), 3).mT)


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (3, 0, 4), (0, 4, 6)])
def test_empty(shape):
    x = torch.empty(shape, dtype=BF16)
    assert op_run(x, 2).shape == shape
    assert newton_schulz_triton(x.to(TRITON_DTYPES[0]), 2, A, B, C, tiles=SMALL_TILES["split1"]).shape == shape


# --------------------------------------------------------------------------- zeropower


@pytest.mark.parametrize("shape", [(96, 64), (64, 96), (2, 40, 56)])
def test_zeropower_singular_values_in_muon_band(shape):
    """Five Muon steps put every singular value of a (non-square) Gaussian matrix in the
    quintic's band, measured [0.68, 1.14] in float64: allow [0.6, 1.2] for bf16 rounding."""
    G = torch.randn(shape)
    out = zeropower(G)
    assert out.shape == G.shape and out.dtype == BF16
    s = torch.linalg.svdvals(out.float())
    assert s.min() >= 0.6 and s.max() <= 1.2, (s.min().item(), s.max().item())


def test_zeropower_is_normalise_then_op():
    G = torch.randn(40, 24, dtype=torch.float64)
    X = G.bfloat16().mT
    X = X / (X.norm() + 1e-7)
    assert torch.equal(zeropower(G, steps=3), op_run(X, 3).mT)


# --------------------------------------------------------------------------- checks, opcheck, fake, autograd


@pytest.mark.parametrize("args, arg", [
    ((torch.zeros(4, 6), 5, A, B, C), "X"),
    ((torch.zeros(6, dtype=BF16), 5, A, B, C), "X"),
    ((torch.zeros(1, 2, 4, 6, dtype=BF16), 5, A, B, C), "X"),
    ((torch.zeros(4, 6, dtype=BF16), 0, A, B, C), "steps"),
    ((torch.zeros(4, 6, dtype=BF16), -1, A, B, C), "steps"),
    ((torch.zeros(4, 6, dtype=BF16), 5, float("nan"), B, C), "a"),
    ((torch.zeros(4, 6, dtype=BF16), 5, A, float("inf"), C), "b"),
    ((torch.zeros(4, 6, dtype=BF16), 5, A, B, float("-inf")), "c"),
])
def test_op_bad_input(args, arg):
    with pytest.raises(ValueError, match=rf"^{arg}: expected"):
        torch.ops.cstack.newton_schulz(*args)


@pytest.mark.parametrize("kwargs, arg", [
    (dict(G=[[1.0]]), "G"),
    (dict(G=torch.zeros(4, dtype=BF16)), "G"),
    (dict(G=torch.zeros(4, 6, dtype=torch.int32)), "G"),
    (dict(steps=0), "steps"),
    (dict(steps=2.0), "steps"),
    (dict(steps=True), "steps"),
    (dict(coefficients=(1.0, 2.0)), "coefficients"),
    (dict(coefficients=(1.0, float("nan"), 2.0)), r"coefficients\[1\]"),
    (dict(eps=-1.0), "eps"),
])
def test_zeropower_bad_input(kwargs, arg):
    kwargs = {"G": torch.zeros(4, 6), **kwargs}
    with pytest.raises(ValueError, match=rf"^{arg}: expected"):
        zeropower(**kwargs)


@pytest.mark.parametrize("x", [
    torch.randn(6, 10), torch.randn(10, 6), torch.randn(2, 5, 8), torch.randn(10, 6).mT,
], ids=["wide", "tall", "batched", "column-major"])
def test_opcheck(x):
    torch.library.opcheck(torch.ops.cstack.newton_schulz.default, (x.to(BF16), 2, A, B, C))


def test_fake_shapes_and_checks():
    with FakeTensorMode():
        for shape in [(9, 20), (20, 9), (3, 9, 20)]:
            x = torch.empty(shape, dtype=BF16, device=DEVICE)
            out = torch.ops.cstack.newton_schulz(x, 5, A, B, C)
            assert out.shape == shape and out.dtype == BF16 and out.is_contiguous()
        with pytest.raises(ValueError, match="^X: expected dtype"):
            torch.ops.cstack.newton_schulz(torch.empty(9, 20, device=DEVICE), 5, A, B, C)


def test_backward_raises():
    x = make_x((6, 10), BF16, "cpu").requires_grad_()
    out = torch.ops.cstack.newton_schulz(x, 2, A, B, C)
    with pytest.raises(RuntimeError, match="newton_schulz has no backward"):
        out.float().sum().backward()

