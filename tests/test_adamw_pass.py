"""passes/adamw.py: a compiled AdamW update becomes one fused call, with the same result; anything else stays."""
import copy
import dataclasses

import pytest
import torch

import compile_stack
import passes.adamw  # noqa: F401  (registers the pass)
import passes.param_data  # noqa: F401
from compile_stack.backend import aten_graphs
from compile_stack.workloads import reference
from compile_stack.backend import PassBackend
from compile_stack.workloads.config import PRESETS
from compile_stack.harness.user_code import make_train_step
from custom_ops.adamw import fused_adamw
from passes import registry
from tests.helpers import HAS_CUDA, record_graphs

FUSED = torch.ops.cstack.fused_adamw_.default
PASSES = ["param_data", "adamw"]
# eps large enough that its placement (reference vs torch.optim) shows in fp32 results.
HYPER = dict(lr=0.05, betas=(0.8, 0.99), eps=1e-3, weight_decay=0.1)
# Ops of the per-parameter update chains, none of which may survive the pass.
CHAIN_OPS = {"sqrt", "div", "pow", "lerp", "addcdiv", "addcmul", "fma"}
CHAIN_OPS |= {"_foreach_" + op for op in CHAIN_OPS}
ULP = {torch.float32: 2**-23, torch.bfloat16: 2**-8}
# Compiled vs eager optimizer: the eager one rounds every intermediate to the storage dtype, so in
# bf16 a few elements land some ulps apart (on the H200, 9 of 32768 by 2-3 ulps after 3 steps).
# The fused result is checked exactly against the op above, and the op against float64 in its tests.
EAGER_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2**-5, atol=2**-4)}


class VariantAdamW(reference.AdamW):
    """The reference update with two hooks, for the variants below (neither is AdamW)."""

    def grad(self, p):
        return p.grad

    def denominator(self, v):
        return torch.sqrt(v) + self.eps

    @torch.no_grad()
    def step(self):
        self.t += 1
        beta1, beta2 = self.betas
        alpha = self.lr * (1 - beta2**self.t) ** 0.5 / (1 - beta1**self.t)
        for p, m, v in zip(self.params, self.m, self.v):
            g = self.grad(p)
            p.data -= self.lr * self.weight_decay * p.data
            m.mul_(beta1).add_((1 - beta1) * g)
            v.mul_(beta2).add_((1 - beta2) * g * g)
            p.data -= alpha * m / self.denominator(v)


class EpsInsideSqrt(VariantAdamW):
    """Not AdamW: √(v + eps) instead of √v + eps. Same ops, same inputs: only the probes tell."""

    def denominator(self, v):
        return torch.sqrt(v + self.eps)


class ClippedUpdate(VariantAdamW):
    """Not AdamW: the gradient is zeroed where it is huge. No probe reaches the threshold, so only
    the rule that comparisons read no data keeps this unfused."""

    def grad(self, p):
        return torch.where(p.grad.abs() > 1e6, 0.0, p.grad)


OPTIMIZERS = {
    "reference": lambda ps: reference.AdamW(ps, **HYPER),
    "torch": lambda ps: torch.optim.AdamW(ps, **HYPER, foreach=False),
    "torch_foreach": lambda ps: torch.optim.AdamW(ps, **HYPER, foreach=True),
    # Not AdamW updates.
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam_l2": lambda ps: torch.optim.Adam(ps, **HYPER),  # decay added to the gradient
    "amsgrad": lambda ps: torch.optim.AdamW(ps, **HYPER, amsgrad=True),
    "maximize": lambda ps: torch.optim.AdamW(ps, **HYPER, maximize=True),
    "eps_inside_sqrt": lambda ps: EpsInsideSqrt(ps, **HYPER),
    "clipped": lambda ps: ClippedUpdate(ps, **HYPER),
}


@pytest.fixture
def graphs(monkeypatch):
    """The graphs as our joint-stage passes leave them; fresh Dynamo state, empty report, no Inductor
    caches (a cache hit would skip the passes)."""
    torch._dynamo.reset()
    registry.current().clear()
    seen = record_graphs(monkeypatch)
    with torch._inductor.config.patch(force_disable_caches=True):
        yield seen
    torch._dynamo.reset()


def make_model(dtype, device="cpu"):
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3, bias=False)).to(device, dtype)


def optimizer_state(opt, params):
    """Every tensor the optimizer updates: params, then per state (exp_avg, exp_avg_sq, ...) all params'."""
    if isinstance(opt, reference.AdamW):
        return list(params) + opt.m + opt.v
    keys = sorted(k for k, v in opt.state[params[0]].items() if v.dim() > 0)
    return list(params) + [opt.state[p][k] for k in keys for p in params]


def train(kind, model, steps, codegen=False):
    """``steps`` updates with the same random grads by: the compiled optimizer, the eager one, and the
    fused op called directly with the optimizer's settings. Returns the three states."""
    compiled_params = list(model.parameters())
    eager_params = list(copy.deepcopy(model).parameters())
    direct = [p.detach().clone() for p in compiled_params]
    direct += [torch.zeros_like(p) for p in direct for _ in range(2)]
    compiled, eager = OPTIMIZERS[kind](compiled_params), OPTIMIZERS[kind](eager_params)
    backend = PassBackend(PASSES, codegen=codegen, name="optimizer")
    step = torch.compile(compiled.step, backend=backend, fullgraph=kind == "reference")
    n = len(compiled_params)
    for t in range(1, steps + 1):
        grads = [torch.randn_like(p) for p in compiled_params]
        for params in (compiled_params, eager_params):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        with backend.active():
            step()
        eager.step()
        fused_adamw(direct[:n], grads, direct[n::2], direct[n + 1::2], lr=HYPER["lr"], step=t, betas=HYPER["betas"],
                    eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], torch_semantics=kind != "reference")
    direct = direct[:n] + direct[n::2] + direct[n + 1::2]
    return optimizer_state(compiled, compiled_params), optimizer_state(eager, eager_params), direct


def chain_ops(graph):
    return {passes.adamw._op_name(n.target) for n in graph.nodes} & CHAIN_OPS


def check_fused(graphs, fused_graphs, states, dtype):
    """One fused call per optimizer graph and no update chain left; results as the op's and the optimizer's."""
    compiled, eager, direct = states
    assert registry.current().replacements["adamw"] == fused_graphs
    updating = [g for g in graphs if any(n.target is FUSED for n in g.nodes)]
    assert len(updating) == fused_graphs
    for graph in updating:
        assert sum(n.target is FUSED for n in graph.nodes) == 1
        assert not chain_ops(graph), graph
        # Only torch.optim's step counters (0-d) are still written back by the graph.
        assert all(n.args[0].meta["val"].dim() == 0 for n in graph.nodes if n.target is torch.ops.aten.copy_.default)
    for c, d in zip(compiled, direct):
        torch.testing.assert_close(c, d, rtol=2 * ULP[dtype], atol=1e-7)
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, **EAGER_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["reference", "torch", "torch_foreach"])
def test_adamw_update_becomes_one_fused_call(graphs, kind, dtype):
    # The reference optimizer compiles twice: t baked in (t = 1), then t symbolic (t = 2, 3, 4).
    states = train(kind, make_model(dtype), steps=4)
    check_fused(graphs, 2 if kind == "reference" else 1, states, dtype)
    assert not registry.current().notes


@pytest.mark.parametrize("kind", ["sgd_momentum", "adam_l2", "amsgrad", "maximize", "eps_inside_sqrt", "clipped"])
def test_other_updates_are_left_alone(graphs, kind):
    compiled, eager, _ = train(kind, make_model(torch.float32), steps=2)
    assert registry.current().replacements["adamw"] == 0
    assert not any(n.target is FUSED for g in graphs for n in g.nodes)
    assert any(note.startswith("adamw: left") for note in registry.current().notes), registry.current().notes
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e)


def step_side_by_side(compiled, eager, model, eager_model, steps=3, dynamic=None):
    """``steps`` updates with the same random grads: ``compiled`` through our passes, ``eager`` as is."""
    backend = PassBackend(PASSES, codegen=False)
    step = torch.compile(compiled.step, backend=backend, dynamic=dynamic)
    for _ in range(steps):
        for p, q in zip(model.parameters(), eager_model.parameters()):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        with backend.active():
            step()
        eager.step()


def assert_same_state(compiled, eager, model, eager_model):
    for c, e in zip(optimizer_state(compiled, list(model.parameters())),
                    optimizer_state(eager, list(eager_model.parameters()))):
        torch.testing.assert_close(c, e, **EAGER_TOL[torch.float32])


def test_capturable_torch_adamw_is_fused(graphs):
    """The form Dynamo traces for CUDA parameters (step counters as tensors), here on the CPU."""
    model = make_model(torch.float32)
    eager_model = copy.deepcopy(model)
    compiled = torch.optim.AdamW(model.parameters(), **HYPER, foreach=False, capturable=True)
    eager = torch.optim.AdamW(eager_model.parameters(), **HYPER, foreach=False)
    step_side_by_side(compiled, eager, model, eager_model)
    assert registry.current().replacements["adamw"] == 1
    assert_same_state(compiled, eager, model, eager_model)


@pytest.mark.parametrize("foreach", [False, True], ids=["for_loop", "foreach"])
def test_an_update_of_symbolic_shapes_is_fused_or_left_alone_with_a_note(graphs, foreach):
    """Shapes traced as symbols (``dynamic=True``, parameters too) do not hash; the pass compares
    them as expressions instead of failing on them, and either fuses the update (torch 2.11's
    foreach form) or leaves it alone saying why (where the probes meet symbolic sizes). Either way
    the update equals eager's. (The constant-valued symbols of FSDP2's gradient shards are fused:
    test_distributed.py.)"""
    model = make_model(torch.float32)
    eager_model = copy.deepcopy(model)
    compiled = torch.optim.AdamW(model.parameters(), **HYPER, foreach=foreach)
    eager = torch.optim.AdamW(eager_model.parameters(), **HYPER, foreach=foreach)
    with torch._dynamo.config.patch(force_parameter_static_shapes=False):
        step_side_by_side(compiled, eager, model, eager_model, dynamic=True)
    assert any(isinstance(s, torch.SymInt) for g in graphs for n in g.nodes if n.op == "placeholder"
               and isinstance(n.meta.get("val"), torch.Tensor) for s in n.meta["val"].shape)
    notes = registry.current().notes
    assert not any("failed" in n for n in notes), notes
    assert registry.current().replacements["adamw"] == 1 or (notes and all(n.startswith("adamw: left") for n in notes))
    assert_same_state(compiled, eager, model, eager_model)


def test_param_groups_get_one_call_each(graphs):
    model = make_model(torch.float32)
    weights, biases = [p for p in model.parameters() if p.dim() == 2], [p for p in model.parameters() if p.dim() == 1]
    groups = [{"params": weights}, {"params": biases, "weight_decay": 0.0, "lr": 0.01}]
    compiled = torch.optim.AdamW(groups, **HYPER, foreach=True)
    eager_model = copy.deepcopy(model)
    eager = torch.optim.AdamW([{"params": [p for p in eager_model.parameters() if p.dim() == 2]},
                               {"params": [p for p in eager_model.parameters() if p.dim() == 1],
                                "weight_decay": 0.0, "lr": 0.01}], **HYPER, foreach=True)
    step_side_by_side(compiled, eager, model, eager_model)
    assert registry.current().replacements["adamw"] == 2
    assert sum(n.target is FUSED for g in graphs for n in g.nodes) == 2
    assert_same_state(compiled, eager, model, eager_model)


@pytest.mark.parametrize("codegen", [False, True], ids=["aten", "inductor"])
def test_parameters_at_different_steps_fail_loudly(graphs, codegen):
    # A parameter without a grad is skipped, so its step counter lags; one fused call has one step.
    model = make_model(torch.float32)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, **HYPER, foreach=False)
    backend = PassBackend(PASSES, codegen=codegen)
    step = torch.compile(opt.step, backend=backend)
    params[0].grad = torch.randn_like(params[0])
    with backend.active():
        step()
    for p in params:
        p.grad = torch.randn_like(p)
    with backend.active(), pytest.raises(RuntimeError, match="different steps"):
        step()


def test_with_inductor(graphs):
    """Real Inductor codegen on a small graph: torch.optim's single-tensor form, two parameters (so
    the in-graph check that their step counters agree is compiled too)."""
    model = torch.nn.Linear(5, 3)
    states = train("torch", model, steps=2, codegen=True)
    check_fused(graphs, 1, states, torch.float32)


def test_lerp_decomposed_with_where_is_fused(graphs, monkeypatch):
    """torch 2.11's Inductor decomposes single-tensor ``lerp`` as torch's reference does: a mask
    ``|w| >= 0.5`` on the constant weight and two ``where``s (the form the pass met on the H200;
    its foreach form adds and multiplies, as 2.13's does). With that decomposition forced here the
    update is still proven and fused."""
    table = dict(aten_graphs.select_decomp_table())
    for op in (torch.ops.aten.lerp.Scalar, torch.ops.aten.lerp.Tensor):
        table[op] = torch._refs.lerp
    monkeypatch.setattr(aten_graphs, "select_decomp_table", lambda: table)
    seen_where = []
    run_fuse = passes.adamw.fuse_adamw

    def fuse(graph):
        seen_where.append(any(passes.adamw._op_name(n.target) == "where" for n in graph.nodes))
        return run_fuse(graph)

    spied = dataclasses.replace(registry._PASSES[passes.adamw.NAME], fn=fuse)
    monkeypatch.setitem(registry._PASSES, passes.adamw.NAME, spied)
    states = train("torch", make_model(torch.float32), steps=3)
    assert seen_where and all(seen_where)
    check_fused(graphs, 1, states, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["reference", "torch", "torch_foreach"])
def test_gpu_bf16_with_inductor(graphs, kind):
    model = reference.build_model(PRESETS["tiny"], "cuda", torch.bfloat16)
    states = train(kind, model, steps=3, codegen=True)
    check_fused(graphs, 2 if kind == "reference" else 1, states, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_train_step_reference_model(graphs):
    """The harness step on the reference model and optimizer: same losses and parameters as eager."""
    cfg = PRESETS["tiny"]
    model = reference.build_model(cfg, "cuda", torch.bfloat16)
    eager_model = copy.deepcopy(model)
    compiled = compile_stack.compile_step(
        make_train_step(model, reference.cross_entropy, reference.AdamW(model.parameters())), passes=PASSES)
    eager = make_train_step(eager_model, reference.cross_entropy, reference.AdamW(eager_model.parameters()))
    for _ in range(3):
        inputs, targets = (torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), device="cuda") for _ in range(2))
        torch.testing.assert_close(compiled(inputs, targets), eager(inputs, targets), rtol=2e-2, atol=2e-2)
    # compile_step traces the step counter as a symbol from the start: one optimizer graph.
    assert registry.current().replacements["adamw"] == 1
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, **EAGER_TOL[torch.bfloat16])
