"""A proven optimizer update (compile_stack/capture/proven_update.py): the first compile of an
optimizer's step records what it computes; a later step of an identical optimizer runs that
without Dynamo's trace, and equals eager. Whatever differs (the model's layout, a
hyper-parameter, the optimizer's code, torch's version, the passes) is traced again."""
import importlib.util
import sys
import textwrap

import pytest
import torch

import compile_stack
from compile_stack.capture.optimizer_step import CompiledOptimizerStep
from compile_stack.capture.optimizer_layout import Layout, describe, source_path
from compile_stack.workloads.reference import AdamW

LR = 0.02  # read as a global by GlobalLrSGD


class GlobalLrSGD:
    """Reads its learning rate from a module global: Dynamo bakes it in with a guard on it."""

    def __init__(self, params):
        self.params = list(params)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        for p in self.params:
            p.sub_(LR * p.grad)


def build(optimizer_factory, width=6, seed=0):
    """A small MLP of its own, its optimizer, a batch and the plain train step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, width), torch.nn.Tanh(), torch.nn.Linear(width, 3))
    optimizer = optimizer_factory(model.parameters())
    x, y = torch.randn(7, 5), torch.randn(7, 3)

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return model, optimizer, train_step


def run(optimizer_factory, cache, steps=3, compiled=True, between=None, **options):
    """``steps`` steps of a fresh model and optimizer, compiled as in a new process (Dynamo holding
    no compile of an earlier run's step), with ``between(optimizer, i)`` before each later step."""
    torch._dynamo.reset()
    options = dict(options)
    model, optimizer, step = build(optimizer_factory, **options.pop("build", {}))
    if compiled:
        step = compile_stack.compile_step(step, cache_dir=cache, codegen=False, **options)
    for i in range(steps):
        if between is not None and i:
            between(optimizer, i)
        step()
    return model, optimizer, step


def proven(step) -> bool:
    return step.optimizer_steps[0].proven is not None


def assert_matches_eager(model, eager_model):
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def torch_adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


@pytest.mark.parametrize("factory", [lambda ps: AdamW(ps, lr=0.01), torch_adamw], ids=["hand_written", "torch_optim"])
def test_a_second_identical_optimizer_runs_the_proven_update_untraced(tmp_path, factory):
    first = run(factory, tmp_path)[2]
    assert not proven(first) and first.optimizer_backend.graphs == 1
    model, optimizer, second = run(factory, tmp_path)
    assert proven(second), second.report.notes
    assert second.optimizer_backend.graphs == 0, "the optimizer's step was compiled again"
    assert second.report.replacements["adamw"] == 1, "the proven update's pass counts are reported"
    assert any("earlier compile proved" in n for n in second.report.notes)
    eager_model, eager_optimizer, _ = run(factory, tmp_path, compiled=False)
    assert_matches_eager(model, eager_model)
    if isinstance(optimizer, AdamW):
        assert optimizer.t == eager_optimizer.t == 3  # the step counter, stored from the graph's output
        torch.testing.assert_close(optimizer.v, eager_optimizer.v, rtol=1e-5, atol=1e-9)
    else:  # the state the first step creates, then its step counts
        for p, q in zip(optimizer.param_groups[0]["params"], eager_optimizer.param_groups[0]["params"]):
            assert optimizer.state[p]["step"].item() == eager_optimizer.state[q]["step"].item() == 3
            torch.testing.assert_close(optimizer.state[p]["exp_avg_sq"], eager_optimizer.state[q]["exp_avg_sq"],
                                       rtol=1e-5, atol=1e-9)


def test_a_scheduled_lr_is_read_at_each_step(tmp_path):
    schedulers = {}

    def factory(params):
        optimizer = torch_adamw(params)
        schedulers[id(optimizer)] = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0 / (1 + i))
        return optimizer

    def between(optimizer, i):
        schedulers[id(optimizer)].step()

    run(factory, tmp_path, between=between)
    model, _, second = run(factory, tmp_path, between=between)
    assert proven(second) and second.optimizer_backend.graphs == 0
    assert_matches_eager(model, run(factory, tmp_path, compiled=False, between=between)[0])


@pytest.mark.parametrize("change", ["layout", "hyper_parameter", "torch_version", "passes"])
def test_what_differs_is_traced_again(tmp_path, monkeypatch, change):
    factory = lambda ps: AdamW(ps, lr=0.01)  # noqa: E731
    run(factory, tmp_path)
    options = {}
    if change == "layout":
        options["build"] = {"width": 8}
    elif change == "hyper_parameter":
        factory = lambda ps: AdamW(ps, lr=0.03)  # noqa: E731
    elif change == "torch_version":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    else:
        options["passes"] = ["adamw", "param_data"]
    model, _, second = run(factory, tmp_path, **options)
    assert not proven(second) and second.optimizer_backend.graphs == 1
    assert_matches_eager(model, run(factory, tmp_path, compiled=False, build=options.get("build", {}))[0])
    third = run(factory, tmp_path, **options)[2]  # what the second recorded serves the third
    assert proven(third)


OPTIMIZER_CODE = """
import torch

class Momentum:
    def __init__(self, params):
        self.params = list(params)
        self.buf = [torch.zeros_like(p) for p in self.params]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        for p, b in zip(self.params, self.buf):
            b.mul_(0.9).add_(p.grad)
            p.sub_({lr} * b)
"""


def load_optimizer_module(path, lr):
    path.write_text(textwrap.dedent(OPTIMIZER_CODE.format(lr=lr)))
    spec = importlib.util.spec_from_file_location("proven_update_momentum", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_changed_optimizer_code_is_traced_again(tmp_path, monkeypatch):
    path = tmp_path / "momentum.py"
    monkeypatch.delitem(sys.modules, "proven_update_momentum", raising=False)
    first = load_optimizer_module(path, 0.1).Momentum
    run(first, tmp_path / "cache")
    assert proven(run(first, tmp_path / "cache")[2]), "the unchanged code's update is reused"
    edited = load_optimizer_module(path, 0.05).Momentum  # the same class in the same file, another update
    model, _, second = run(edited, tmp_path / "cache")
    assert not proven(second)
    assert_matches_eager(model, run(edited, tmp_path, compiled=False)[0])


def test_a_changed_hyper_parameter_mid_run_goes_back_to_tracing(tmp_path):
    factory = lambda ps: AdamW(ps, lr=0.01)  # noqa: E731

    def between(optimizer, i):
        if i == 2:
            optimizer.lr = 0.005

    run(factory, tmp_path)
    model, _, second = run(factory, tmp_path, steps=4, between=between)
    assert not proven(second), "the third step's layout no longer matches the proven update"
    assert second.optimizer_backend.graphs == 1
    assert_matches_eager(model, run(factory, tmp_path, steps=4, compiled=False, between=between)[0])


def test_an_optimizer_reading_a_global_is_never_replayed(tmp_path):
    first = run(GlobalLrSGD, tmp_path)[2]
    assert any("traced in every process" in n and "G[" in n for n in first.report.notes), first.report.notes
    model, _, second = run(GlobalLrSGD, tmp_path)
    assert not proven(second)
    assert any("traced in every process" in n for n in second.report.notes), "the first run's refusal is kept"
    assert_matches_eager(model, run(GlobalLrSGD, tmp_path, compiled=False)[0])


def test_layout_describes_values_tensors_and_sharing():
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    optimizer = torch.optim.SGD(params, lr=0.1)
    layout = Layout(optimizer)
    lr = (("attr", "param_groups"), ("item", 0), ("item", "lr"))
    assert layout.entries[lr] == ("float", 0.1)
    first = (("attr", "param_groups"), ("item", 0), ("item", "params"), ("item", 0))
    assert layout.entries[first][:4] == ("tensor", (3, 2), (2, 1), "torch.float32")
    assert layout.entries[first + (("grad",),)] == ("NoneType", None)
    assert layout.masked({lr})[lr] == ("float", "volatile")
    assert describe(lr) == ".param_groups[0]['lr']"
    view = params[0].detach()[1:]  # another tensor of the first parameter's storage
    optimizer.extra = [view]
    shared = Layout(optimizer).entries[(("attr", "extra"), ("item", 0))]
    assert shared[7] == first and shared[8] == 2, "the view is recorded as sharing the parameter's storage"
    assert Layout(optimizer).opaque == []
    optimizer.model = torch.nn.Linear(2, 2)  # a step could read anything of it: never compared, never replayed
    assert Layout(optimizer).opaque == ["Linear at .model"]


def test_source_path_reads_the_optimizers_own_sources():
    self_source = CompiledOptimizerStep.SELF_SOURCE
    assert source_path("L['self'].param_groups[0]['lr']", self_source) == (
        ("attr", "param_groups"), ("item", 0), ("item", "lr"))
    assert source_path("L['fn'].__self__.t", self_source) == (("attr", "t"),)
    assert source_path("G['LR']", self_source) is None
    assert source_path("L['self'].state[list(dict.keys(L['self'].state))[0]]", self_source) is None
