"""The pass registry, its Inductor hook-up and report, with the param_data capture pass."""
import copy

import pytest
import torch

from compile_stack.backend import PassBackend
from compile_stack.workloads.config import PRESETS
from compile_stack.workloads.reference import AdamW, build_model, cross_entropy
from passes import registry
from passes.param_data import rewrite_param_data_updates
from tests.helpers import dynamo_graph


@pytest.fixture(autouse=True)
def _clean_report():
    registry.current().clear()
    yield
    torch._dynamo.reset()


def test_register_rejects_unknown_stage_and_duplicate_names():
    with pytest.raises(ValueError, match="stage: expected one of"):
        registry.register_pass("x", stage="post_partition")
    with pytest.raises(ValueError, match="already registered"):
        registry.register_pass("param_data", stage="pre_grad")(lambda g: 0)


def test_resolve_names_and_unknown_pass():
    assert [p.name for p in registry.resolve(["param_data"])] == ["param_data"]
    with pytest.raises(ValueError, match="passes: unknown pass"):
        registry.resolve(["no_such_pass"])


def test_installed_sets_inductor_hooks_and_restores_them():
    assert torch._inductor.config.pre_grad_custom_pass is None
    with registry.installed(["param_data"]):
        hook = torch._inductor.config.pre_grad_custom_pass
        assert isinstance(hook, registry.StagePass) and hook.stage == "pre_grad"
        # A stable identity lets Inductor's FX-graph cache key on it.
        assert hook.uuid() == registry.StagePass("pre_grad", registry.resolve(["param_data"])).uuid()
    assert torch._inductor.config.pre_grad_custom_pass is None


def _tiny_model_with_grads(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = PRESETS["tiny"].with_overrides(layers=1)
    model = build_model(cfg, "cpu", dtype)
    ids = torch.randint(cfg.vocab, (cfg.batch, cfg.seq))
    cross_entropy(model(ids), ids).sum().backward()
    return model


def test_param_data_pass_rewrites_each_data_update():
    model = _tiny_model_with_grads()
    opt = AdamW(model.parameters())
    gm = dynamo_graph(opt.step)
    # Two `p.data -= …` per parameter: decay, then the Adam step.
    assert rewrite_param_data_updates(gm.graph) == 2 * len(opt.params)
    targets = {n.target for n in gm.graph.nodes}
    assert torch._C._autograd._get_data_attr not in targets and torch.Tensor.set_ not in targets


def test_param_data_pass_rewrites_a_data_assignment_outside_no_grad_and_matches_eager():
    """``w.data = f(w.data)`` with grad enabled: a copy into ``w`` (nothing in the graph can tell
    the two apart), so the step compiles, with eager's result."""
    w = torch.randn(4, requires_grad=True)
    expected = w.detach() * 2

    def swap(x):
        w.data = w.data * 2
        return x + 1

    compiled = torch.compile(swap, backend=PassBackend(["param_data"], codegen=False))
    torch.testing.assert_close(compiled(torch.ones(4)), torch.full((4,), 2.0))
    torch.testing.assert_close(w.detach(), expected)
    assert registry.current().replacements["param_data"] >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_reference_optimizer_matches_eager(dtype):
    model = _tiny_model_with_grads(dtype)
    twin = copy.deepcopy(model)
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = p.grad.clone()
    opt, opt_eager = AdamW(model.parameters()), AdamW(twin.parameters())
    step = torch.compile(opt.step, backend=PassBackend(["param_data"], codegen=False), fullgraph=True)
    held = model.lm_head.weight  # a reference the user holds must see the update
    before = held.detach().clone()
    for _ in range(3):  # t = 1 compiles with constants, t = 2 recompiles with a symbolic t
        step()
        opt_eager.step()
    assert not torch.equal(held, before)
    tol = 0 if dtype == torch.float32 else 1e-2
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol)
    for m, n in zip(opt.m + opt.v, opt_eager.m + opt_eager.v):
        torch.testing.assert_close(m, n, rtol=tol, atol=tol)
    assert registry.current().replacements["param_data"] == 2 * 2 * len(opt.params)


def test_default_pipeline_is_the_project_passes_only():
    @registry.register_pass("test_only_probe", stage="post_grad")
    def probe(graph):
        return 0

    pipeline = [p.name for p in registry.resolve(None)]
    assert "test_only_probe" not in pipeline
    assert set(pipeline) == {"param_data", "rope", "attention", "cross_entropy", "adamw", "linalg_qr", "newton_schulz"}
    assert [p.name for p in registry.resolve(["test_only_probe"])] == ["test_only_probe"]


def test_pipeline_order_is_the_modules_order_whatever_was_imported_first(monkeypatch):
    """A test or user importing passes.attention before passes.rope registers attention first;
    the pipeline still runs RoPE first (attention run first left it a third match per layer)."""
    registry.load_all()
    monkeypatch.setattr(registry, "_PASSES", dict(reversed(registry._PASSES.items())))
    assert [p.name for p in registry.resolve(None)] == [
        "param_data", "rope", "attention", "cross_entropy", "adamw", "linalg_qr", "newton_schulz"]
    assert [p.name for p in registry.resolve(["attention", "rope"])] == ["rope", "attention"]


def _failing_pass(edit_first: bool):
    def fail(graph):
        if edit_first:
            node = next(n for n in graph.nodes if n.op == "call_function")
            node.args = tuple(node.args)  # a new argument tuple: an edit
        raise RuntimeError("boom")

    return fail


def test_a_pass_that_fails_before_editing_leaves_the_graph_and_notes_it(monkeypatch):
    """Never an exception where eager works: the step compiles as written, with a note."""
    monkeypatch.setitem(registry._PASSES, "probe_fail", registry.RegisteredPass("probe_fail", "joint", _failing_pass(False)))
    registry.current().clear()
    torch._dynamo.reset()
    x = torch.randn(3, requires_grad=True)
    out = torch.compile(lambda t: (t.sin() * 2).sum(), backend=PassBackend(["probe_fail"], codegen=False))(x)
    out.backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())
    assert any(n.startswith("probe_fail: failed and left the graph as it was (RuntimeError: boom)")
               for n in registry.current().notes)


def test_a_pass_that_fails_after_editing_raises(monkeypatch):
    monkeypatch.setitem(registry._PASSES, "probe_fail", registry.RegisteredPass("probe_fail", "joint", _failing_pass(True)))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="boom"):
        torch.compile(lambda t: t.sin() * 2, backend=PassBackend(["probe_fail"], codegen=False))(torch.randn(3))
