"""cstack::rope: float64 references for every pairing and table width, the kernel under the
interpreter (or on a GPU), the inverse, autograd, opcheck, and bad input."""
import itertools

import pytest
import torch

import custom_ops.rope as rope_ops
from custom_ops.rope import rope, torch_rope, triton_rope
from tests.helpers import HAS_CUDA, rel_err

LAYOUTS = list(itertools.product((False, True), repeat=2))  # (interleaved_in, interleaved_out)
DEVICE = "cuda" if HAS_CUDA else "cpu"


def reference(x, cos, sin, interleaved_in, interleaved_out):
    """The rotation in float64, pair by pair, written independently of the op's code."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    width, half = x.shape[-1], x.shape[-1] // 2
    cos, sin = (t.broadcast_to(*x.shape[:-1], t.shape[-1]) for t in (cos, sin))
    out = torch.empty_like(x)
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if interleaved_in else (i, i + half)
        p, q = (2 * i, 2 * i + 1) if interleaved_out else (i, i + half)
        tp, tq = (p, q) if cos.shape[-1] == width else (i, i)
        out[..., p] = x[..., a] * cos[..., tp] - x[..., b] * sin[..., tp]
        out[..., q] = x[..., b] * cos[..., tq] + x[..., a] * sin[..., tq]
    return out


def angles(rows, width):
    """Unit (cos, sin) pairs of random angles, [rows, width]."""
    theta = torch.rand(rows, width, dtype=torch.float64) * 20 - 10
    return theta.cos().float(), theta.sin().float()


# (x shape, table shape, x made from a transposed view): odd row counts, broadcast tables.
CASES = [
    ((2, 3, 37, 16), (37, 8), False),
    ((2, 3, 37, 16), (37, 16), True),
    ((5, 8), (5, 4), False),
    ((3, 7, 4, 32), (3, 7, 1, 32), True),
    ((1, 1, 1, 2), (1, 1), False),
]


def make_case(shape, table_shape, transposed, dtype=torch.float32, device="cpu"):
    if transposed:  # a head split off a [B, S, H·D] projection: [B, H, S, D] strided
        b, h, s, d = shape
        x = torch.randn(b, s, h, d, dtype=dtype, device=device).transpose(1, 2)
    else:
        x = torch.randn(shape, dtype=dtype, device=device)
    rows = int(torch.tensor(table_shape[:-1]).prod())
    cos, sin = angles(rows, table_shape[-1])
    return x, cos.view(table_shape).to(device), sin.view(table_shape).to(device)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_cpu_matches_float64(case, layout):
    x, cos, sin = make_case(*case)
    out = rope(x, cos, sin, *layout)
    assert out.is_contiguous() and out.dtype == torch.float32
    assert rel_err(out, reference(x, cos, sin, *layout)) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_triton_kernel_matches_float64(case, layout, dtype):
    """The kernel itself: CPU tensors under the interpreter (fp32/fp16), CUDA tensors on a GPU."""
    x, cos, sin = make_case(*case, dtype=dtype, device=DEVICE)
    for inverse in (False, True):
        out = triton_rope(x, cos, sin, *layout, inverse, dtype)
        want = torch_rope(x, cos, sin, *layout, inverse, dtype)
        assert out.is_contiguous() and out.dtype == dtype
        tol = 1e-6 if dtype == torch.float32 else 1e-3
        assert rel_err(out, want) < tol
    assert rel_err(triton_rope(x, cos, sin, *layout, False, torch.float32),
                   reference(x, cos, sin, *layout)) < 1e-6


def test_triton_kernel_reads_strided_tables():
    """A complex table's parts (every other element) and a table broadcast over heads."""
    x = torch.randn(2, 11, 3, 16, device=DEVICE)
    cis = torch.polar(torch.ones(11, 8), torch.randn(11, 8))
    cos, sin = (torch.view_as_real(cis)[..., k].view(11, 1, 8).to(DEVICE) for k in (0, 1))
    assert cos.stride(-1) == 2
    out = triton_rope(x, cos, sin, True, True, False, torch.float32)
    assert rel_err(out, reference(x, cos, sin, True, True)) < 1e-6


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inverse_undoes_the_rotation(layout):
    x, cos, sin = make_case((2, 3, 37, 16), (37, 8), True)
    there = rope(x, cos, sin, *layout)
    back = torch.ops.cstack.rope(there, cos, sin, *layout, True)
    assert rel_err(back, x) < 1e-6


def test_boundary_values():
    """Angle 0 is the identity (or a permutation of pairs), π/2 swaps each pair with a sign; zeros
    stay zero; large values keep their relative precision."""
    x = torch.randn(3, 9, 8) * 1e30
    zeros, ones = torch.zeros(9, 4), torch.ones(9, 4)
    assert torch.equal(rope(x, ones, zeros, False, False), x)
    assert torch.equal(rope(x, ones, zeros, True, True), x)
    swapped = rope(x, zeros, ones, False, False)
    assert torch.equal(swapped, torch.cat([-x[..., 4:], x[..., :4]], -1))
    assert torch.equal(rope(torch.zeros(2, 8), *angles(2, 4), True, False), torch.zeros(2, 8))


def test_bf16_and_mixed_dtypes_round_once():
    x = torch.randn(4, 11, 16, dtype=torch.bfloat16)
    cos, sin = angles(11, 8)
    out = rope(x, cos, sin, True, False)
    assert out.dtype == torch.float32  # promoted with the fp32 tables
    narrow = rope(x, cos, sin, True, False, dtype=torch.bfloat16)
    assert torch.equal(narrow, reference(x, cos, sin, True, False).to(torch.bfloat16))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradient_is_the_rotation_back(layout):
    x, cos, sin = make_case((2, 3, 13, 8), (13, 8), True)
    x = x.double().requires_grad_()
    grad = torch.randn(2, 3, 13, 8, dtype=torch.float64)
    want, = torch.autograd.grad(reference(x, cos, sin, *layout), x, grad)
    x32 = x.detach().float().requires_grad_()
    got, = torch.autograd.grad(rope(x32, cos, sin, *layout), x32, grad.float())
    assert got.dtype == torch.float32 and rel_err(got, want) < 1e-6


@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck(layout):
    x, cos, sin = make_case((2, 3, 5, 8), (5, 4), True)
    torch.library.opcheck(torch.ops.cstack.rope.default, (x.requires_grad_(), cos, sin, *layout, False, None))
    torch.library.opcheck(torch.ops.cstack.rope.default, (x, cos, sin, *layout, True, torch.float32))


def test_compiles_with_inductor():
    x, cos, sin = make_case((2, 3, 5, 8), (5, 4), False)
    fn = torch.compile(lambda x: rope(x, cos, sin, True, False) * 2, fullgraph=True)
    assert rel_err(fn(x), 2 * reference(x, cos, sin, True, False)) < 1e-6


@pytest.mark.parametrize("args, message", [
    ((torch.randn(2, 7), torch.ones(7), torch.ones(7)), "x: expected an even last dim"),
    ((torch.randn(2, 8), torch.ones(3), torch.ones(3)), "cos: expected a last dim of 4 (one angle per pair) or 8"),
    ((torch.randn(2, 8), torch.ones(2, 4), torch.ones(2, 8)), "sin: expected the last dim of cos (4)"),
    ((torch.randn(2, 5, 8), torch.ones(3, 4), torch.ones(3, 4)), "cos: expected a shape that broadcasts over x's"),
    ((torch.randn(5, 8), torch.ones(2, 5, 4), torch.ones(2, 5, 4)), "cos: expected a shape that broadcasts over x's"),
    ((torch.randn(2, 8, dtype=torch.float64), torch.ones(4), torch.ones(4)), "x: expected dtype"),
    ((torch.randn(1, 1, 1, 1, 8), torch.ones(4), torch.ones(4)), "x: expected a tensor of rank 1 or 2 or 3 or 4"),
])
def test_bad_input_names_the_argument(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        rope(*args)


def test_tables_requiring_grad_are_refused_in_the_backward():
    x = torch.randn(3, 8, requires_grad=True)
    cos = torch.ones(3, 4, requires_grad=True)
    out = rope(x, cos, torch.zeros(3, 4))
    with pytest.raises(ValueError, match="cos/sin: expected tables that do not require grad"):
        out.sum().backward()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_bf16_op_matches_float64(layout):
    """The CUDA op's kernel on the step's layout (heads split off a projection), bf16."""
    x, cos, sin = make_case((2, 4, 300, 128), (300, 64), True, dtype=torch.bfloat16, device="cuda")
    assert rope_ops.kernel_applies(x)
    out = rope(x, cos.bfloat16(), sin.bfloat16(), *layout, dtype=torch.bfloat16)
    assert rel_err(out, reference(x, cos.bfloat16(), sin.bfloat16(), *layout)) < 4e-3
