"""passes/linalg_qr: a user's QR of CUDA fp32 matrices becomes our batched op where the table prefers it;
the rest stays, with a note where the user would want one.

Without a GPU, the decisions are tested on joint graphs captured from the user's code on the CPU and
then given CUDA metadata (their fake values remade on device "cuda"), with ``prefer_ours`` a test
table. What the rewritten graphs compute is tested on the CPU, with the pass told that the CPU is
one of its devices (the ops run torch's LAPACK QR there): values and gradients as eager's.
"""
import pytest
import torch
from torch._guards import detect_fake_mode

import passes.linalg_qr
from compile_stack.backend import PassBackend
from custom_ops import batched_qr
from passes import registry

aten, cstack = torch.ops.aten, torch.ops.cstack
OURS = {cstack.batched_qr.default, cstack.batched_geqrf.default}
TORCH = {aten.linalg_qr.default, aten.geqrf.default}


def table(shape, device, op):
    """The test's speed table: ours for matrices up to 16 on a side, on CUDA."""
    return torch.device(device).type == "cuda" and max(shape[-2:]) <= 16


@pytest.fixture
def fresh(monkeypatch):
    torch._dynamo.reset()
    registry.current().clear()
    monkeypatch.setattr(batched_qr, "prefer_ours", table)
    yield
    torch._dynamo.reset()


def joint_graph(monkeypatch, fn, *inputs, dynamic=False) -> torch.fx.Graph:
    """The joint graph of ``fn`` as our joint passes receive it (a copy, its nodes' meta shared)."""
    graphs = []

    def record(graph):
        copy = torch.fx.Graph()
        copy.output(copy.graph_copy(graph, {}))
        graphs.append(copy)
        return 0

    monkeypatch.setitem(registry._PASSES, "record", registry.RegisteredPass("record", "joint", record))
    torch.compile(fn, backend=PassBackend(["record"], codegen=False), dynamic=dynamic)(*inputs)
    (graph,) = graphs
    return graph


def on_cuda(graph: torch.fx.Graph) -> torch.fx.Graph:
    """The graph with every fake value remade on device "cuda" (same shapes, symbolic ones too)."""
    mode = detect_fake_mode([n.meta["val"] for n in graph.nodes if n.op == "placeholder"])

    def remake(v):
        if isinstance(v, torch.Tensor):
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cuda")
        return type(v)(map(remake, v)) if isinstance(v, (tuple, list)) else v

    with mode:
        for node in graph.nodes:
            if "val" in node.meta:
                node.meta["val"] = remake(node.meta["val"])
    return graph


def outputs(graph):
    return [tuple(n.meta["val"].shape) for n in graph.find_nodes(op="output")[0].all_input_nodes]


def q_of(M):
    Q, _ = torch.linalg.qr(M)
    return Q * 2


CASES = {
    "qr": (lambda M: torch.linalg.qr(M), (9, 5)),
    "qr_q_only_batched": (q_of, (4, 9, 5)),
    "qr_square": (q_of, (6, 6)),
    "qr_reduced": (lambda M: torch.linalg.qr(M, mode="reduced").R, (3, 5, 12)),
    "tensor_qr": (lambda M: M.qr(), (7, 4)),
    "geqrf": (lambda M: torch.geqrf(M), (9, 5)),
    "geqrf_batched": (lambda M: torch.geqrf(M), (2, 3, 5, 9)),
    "qr_r": (lambda M: torch.linalg.qr(M, mode="r"), (2, 11, 6)),
}


@pytest.mark.parametrize("case", CASES)
def test_cuda_fp32_qr_becomes_ours(monkeypatch, fresh, case):
    fn, shape = CASES[case]
    graph = on_cuda(joint_graph(monkeypatch, fn, torch.randn(shape)))
    before = outputs(graph)
    assert passes.linalg_qr.use_batched_qr(graph) == 1
    graph.lint()
    targets = {n.target for n in graph.nodes}
    assert targets & OURS and not targets & TORCH
    expected = cstack.batched_qr.default if case.startswith(("qr", "tensor")) and case != "qr_r" \
        else cstack.batched_geqrf.default
    assert expected in targets
    assert outputs(graph) == before  # the graph's results keep their shapes
    assert not registry.current().notes


@pytest.mark.parametrize("fn, dtype, shape, note", [
    (lambda M: torch.linalg.qr(M), torch.float64, (9, 5), "torch.float64 (ours is float32)"),
    (lambda M: torch.linalg.qr(M, mode="complete"), torch.float32, (9, 5), "mode 'complete'"),
    (lambda M: torch.linalg.qr(M), torch.float32, (9, 17), "torch's qr is faster for shape (9, 17)"),
    (lambda M: torch.geqrf(M), torch.float32, (40, 5), "torch's geqrf is faster for shape (40, 5)"),
], ids=["fp64", "complete", "table_qr", "table_geqrf"])
def test_cuda_qr_left_alone_with_a_note(monkeypatch, fresh, fn, dtype, shape, note):
    graph = on_cuda(joint_graph(monkeypatch, fn, torch.randn(shape, dtype=dtype)))
    assert passes.linalg_qr.use_batched_qr(graph) == 0
    assert {n.target for n in graph.nodes} & TORCH
    assert any(n.startswith("linalg_qr: left") and note in n for n in registry.current().notes), registry.current().notes


def test_dynamic_shape_left_alone_with_a_note(monkeypatch, fresh):
    graph = on_cuda(joint_graph(monkeypatch, lambda M: torch.linalg.qr(M), torch.randn(9, 5), dynamic=True))
    assert passes.linalg_qr.use_batched_qr(graph) == 0
    assert any("dynamic shape" in n for n in registry.current().notes), registry.current().notes


def test_cpu_qr_left_alone_quietly(monkeypatch, fresh):
    graph = joint_graph(monkeypatch, lambda M: torch.linalg.qr(M), torch.randn(9, 5))
    monkeypatch.setattr(batched_qr, "prefer_ours", lambda *a: True)  # even where ours were the faster
    assert passes.linalg_qr.use_batched_qr(graph) == 0
    assert not registry.current().notes


def eigenbasis_refresh(P, Q):
    """SOAP's refresh of an eigenbasis estimate: one power iteration, re-orthogonalised."""
    Q, _ = torch.linalg.qr(P @ Q)
    return Q


def test_soap_refresh_on_cpu_equals_eager(fresh):
    P = torch.randn(3, 12, 12)
    P = P @ P.mT
    Q = torch.linalg.qr(torch.randn(3, 12, 12)).Q
    compiled = torch.compile(eigenbasis_refresh, backend=PassBackend(codegen=False))(P, Q)
    torch.testing.assert_close(compiled, eigenbasis_refresh(P, Q))
    assert registry.current().replacements["linalg_qr"] == 0 and not registry.current().notes


def qr_loss(M, W):
    Q, R = torch.linalg.qr(M)
    return (Q * W[..., :Q.shape[-1]]).sum() + R.square().sum()


@pytest.mark.parametrize("fn, grad", [
    (eigenbasis_refresh, False),
    (lambda M: torch.linalg.qr(M, mode="r"), False),
    (lambda M: torch.geqrf(M), False),
    (qr_loss, True),
], ids=["soap_refresh", "qr_r", "geqrf", "qr_backward"])
def test_rewritten_graph_computes_eagers_values_and_gradients(monkeypatch, fresh, fn, grad):
    """The rewrite forced on the CPU (ours run LAPACK there): the joint graph's backward, torch's QR
    derivative traced into aten ops, reads our Q and R and gives eager's gradient."""
    monkeypatch.setattr(passes.linalg_qr, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(batched_qr, "prefer_ours", lambda *a: True)
    inputs = [torch.randn(4, 9, 6) for _ in range(2 if fn in (eigenbasis_refresh, qr_loss) else 1)]
    if fn is eigenbasis_refresh:
        inputs[1] = inputs[1][..., :6, :]
    eager_inputs = [x.clone().requires_grad_(grad) for x in inputs]
    inputs = [x.requires_grad_(grad) for x in inputs]
    compiled = torch.compile(fn, backend=PassBackend(["linalg_qr"], codegen=False))(*inputs)
    eager = fn(*eager_inputs)
    assert registry.current().replacements["linalg_qr"] == 1
    torch.testing.assert_close(compiled, eager)
    if grad:
        compiled.backward()
        eager.backward()
        for x, y in zip(inputs, eager_inputs):
            torch.testing.assert_close(x.grad, y.grad)
