"""passes/newton_schulz: a hand-written Newton–Schulz chain becomes one ``newton_schulz`` call, with
eager's result; other coefficients, other dtypes and chains read in the middle are left alone.

Each case is a user's function compiled with the pass under no_grad (as an optimizer step is), on
the CPU, where the op runs its plain-torch path: the rewrite is made and checked end to end.
"""
import pytest
import torch

from compile_stack.backend import PassBackend
from custom_ops.newton_schulz import MUON_COEFFICIENTS
from passes import registry
from tests.helpers import record_graphs, rel_err

NS = torch.ops.cstack.newton_schulz.default
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
           torch.ops.aten.baddbmm.default}
a, b, c = MUON_COEFFICIENTS
# Against the same iterations in float64 from the same bf16 input: eager bf16 rounds every product
# and sum and lands 2.5-4% (norm-wise) away after five iterations, the op (each of A, B, X' rounded
# once from fp32 sums) 1-2%; so the two differ by up to about 4.5%. A wrong rewrite (steps,
# coefficients, orientation) is O(1) away.
EXACT_TOLERANCE = 2.5e-2
EAGER_TOLERANCE = 6e-2


def normalised(G):
    X = G.bfloat16()
    return X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)


def loop_mT(G, steps=5):
    """Muon's own spelling: a Python loop, ``X @ X.mT``, ``c * A @ A``, the tall case transposed."""
    X = normalised(G)
    if G.size(-2) > G.size(-1):
        X = X.mT
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def mm_addmm(G):
    X = normalised(G)
    for _ in range(5):
        A = torch.mm(X, X.T)
        B = b * A + c * (A @ A)
        X = torch.addmm(X, B, X, beta=a)
    return X


def matmul_addmm_bias(G):
    X = normalised(G)
    for _ in range(5):
        A = torch.matmul(X, X.transpose(-2, -1))
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = a * X + torch.matmul(B, X)
    return X


def bmm_baddbmm(G):
    X = normalised(G)
    for _ in range(5):
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    return X


def unrolled_literals(G):
    """Two iterations written out, the coefficients as literals, terms in another order."""
    X = normalised(G)
    A = X @ X.T
    B = 2.0315 * (A @ A) - 4.7750 * A
    X = B @ X + 3.4445 * X
    A = X @ X.T
    B = torch.add(-4.7750 * A, A @ A, alpha=2.0315)
    X = 3.4445 * X + B @ X
    return X


def two_matrices(G, H):
    return loop_mT(G), loop_mT(H)


@pytest.fixture
def compile_ns(monkeypatch):
    """``compile_ns(fn, *inputs)``: (compiled result, eager result, joint graphs after the pass), with
    fresh Dynamo state and an empty report."""
    torch._dynamo.reset()
    registry.current().clear()
    graphs = record_graphs(monkeypatch)

    def run(fn, *inputs):
        with torch.no_grad():
            compiled = torch.compile(fn, backend=PassBackend(["newton_schulz"], codegen=False), fullgraph=True)(*inputs)
            return compiled, fn(*inputs), graphs

    yield run
    torch._dynamo.reset()


def calls(graphs):
    return [n for g in graphs for n in g.nodes if n.target is NS]


def exact(G, steps):
    """The iterations in float64 from the bf16 input the functions start from (orientation does not
    matter: p(XXᵀ)X = X p(XᵀX))."""
    X = normalised(G).double()
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X


def assert_rewritten_close(compiled, eager, G, steps):
    assert compiled.dtype == eager.dtype and compiled.shape == eager.shape
    assert rel_err(compiled, exact(G, steps)) < EXACT_TOLERANCE
    assert rel_err(compiled, eager) < EAGER_TOLERANCE


@pytest.mark.parametrize("fn, shape, steps", [
    (loop_mT, (24, 40), 5),
    (loop_mT, (40, 24), 5),  # tall: the user's transposes stay around the call
    (loop_mT, (3, 17, 9), 5),  # a batch of matrices
    (mm_addmm, (12, 20), 5),
    (matmul_addmm_bias, (12, 20), 5),
    (bmm_baddbmm, (2, 12, 20), 5),
    (unrolled_literals, (12, 20), 2),
], ids=["loop_mT", "loop_mT_tall", "loop_mT_batched", "mm_addmm", "matmul_addmm_bias", "bmm_baddbmm",
        "unrolled_literals"])
def test_chain_becomes_one_call(compile_ns, fn, shape, steps):
    G = torch.randn(*shape)
    compiled, eager, graphs = compile_ns(fn, G)
    (call,) = calls(graphs)
    assert call.args[1:] == (steps, *MUON_COEFFICIENTS)
    assert not any(n.target in MATMULS for g in graphs for n in g.nodes)  # no iteration left
    assert registry.current().replacements["newton_schulz"] == 1 and not registry.current().notes
    assert_rewritten_close(compiled, eager, G, steps)


def test_one_call_per_matrix(compile_ns):
    G, H = torch.randn(16, 24), torch.randn(30, 10)
    compiled, eager, graphs = compile_ns(two_matrices, G, H)
    assert len(calls(graphs)) == 2 and registry.current().replacements["newton_schulz"] == 2
    for x, y, M in zip(compiled, eager, (G, H)):
        assert_rewritten_close(x, y, M, 5)


def other_coefficients(G):
    X = normalised(G)
    for _ in range(5):
        A = X @ X.mT
        X = 3.0 * X + (-3.2 * A + 1.2 * A @ A) @ X
    return X


def fp32_chain(G):
    X = G / G.norm()
    for _ in range(5):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X


def middle_read(G):
    X, seen = normalised(G), []
    for _ in range(5):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
        seen.append(X)
    return X, seen[2]


def gram_read(G):
    X = normalised(G)
    for _ in range(5):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X, A


@pytest.mark.parametrize("fn, why", [
    (other_coefficients, "not Muon's"),
    (fp32_chain, "torch.float32, not bfloat16"),
    (middle_read, "is also read by"),
    (gram_read, "is also read by"),
])
def test_left_alone(compile_ns, fn, why):
    compiled, eager, graphs = compile_ns(fn, torch.randn(12, 20))
    assert not calls(graphs) and registry.current().replacements["newton_schulz"] == 0
    assert any(n.startswith("newton_schulz: left the Newton–Schulz chain of 5 iterations") and why in n
               for n in registry.current().notes), registry.current().notes
    torch.testing.assert_close(compiled, eager)


def muon_then_other(G):
    """Three Muon iterations, then two with other coefficients: the Muon stretch alone is rewritten."""
    X = normalised(G)
    for coefficients in [MUON_COEFFICIENTS] * 3 + [(3.0, -3.2, 1.2)] * 2:
        p, q, r = coefficients
        A = X @ X.mT
        X = p * X + (q * A + r * A @ A) @ X
    return X


def test_coefficients_change_within_a_chain(compile_ns):
    compiled, eager, graphs = compile_ns(muon_then_other, torch.randn(12, 20))
    (call,) = calls(graphs)
    assert call.args[1] == 3
    assert sum(n.target is torch.ops.aten.mm.default for g in graphs for n in g.nodes) == 2 * 3  # two left
    assert any("chain of 2 iterations" in n and "not Muon's" in n for n in registry.current().notes)
    assert rel_err(compiled, eager) < EAGER_TOLERANCE


def test_a_gram_matrix_alone_is_no_chain(compile_ns):
    """Shampoo's preconditioner statistics: X Xᵀ and sums of it, no iteration."""
    compiled, eager, graphs = compile_ns(lambda G: 0.9 * G + 0.1 * (G @ G.mT) @ G, torch.randn(8, 8).bfloat16())
    assert not calls(graphs) and not registry.current().notes
    torch.testing.assert_close(compiled, eager)
