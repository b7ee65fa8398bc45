"""A graph that Inductor compiled into the caches before is compiled again without Inductor's worker
processes (compile_stack/capture.py, ``compiled_marker``): the caches serve it, so the pool would
only start for nothing; a graph new to the caches still gets them."""
import pytest
import torch

import compile_stack
from compile_stack import capture, settings

POOL = settings.inductor_options()["compile_threads"]  # the worker count a graph to compile gets


@pytest.fixture
def threads_seen(monkeypatch, tmp_path):
    """Inductor's ``compile_threads`` at each compile of our backend, in a fresh cache directory."""
    settings.use_cache_dir(tmp_path)
    seen = []

    def spy(gm, example_inputs, **kwargs):
        seen.append(torch._inductor.config.compile_threads)
        return real(gm, example_inputs, **kwargs)

    real = capture.compile_fx
    monkeypatch.setattr(capture, "compile_fx", spy)
    return seen


def run_compiled(fn, *args):
    """A fresh Dynamo compiling ``fn`` with our backend, run forward and backward once."""
    torch._dynamo.reset()
    torch.compile(fn, backend=compile_stack.Backend([]))(*args).backward()


def affine_loss(x, w):
    return torch.tanh(x @ w).sum()


def scaled_loss(x, w):
    return torch.sigmoid(2 * x @ w).sum()


@pytest.mark.slow
def test_a_graph_compiled_before_compiles_without_the_worker_pool(threads_seen):
    x, w = torch.randn(4, 8), torch.randn(8, 3, requires_grad=True)
    run_compiled(affine_loss, x, w)
    run_compiled(affine_loss, x, w)
    run_compiled(scaled_loss, x, w)  # another graph: new to the caches
    assert threads_seen == [POOL, 1, POOL]
    assert len(list((capture.report_dir().parent / "cstack_compiled").glob("*.json"))) == 2


def test_the_marker_names_the_graph_its_plan_and_the_compilers():
    key = capture.report_dir() / "0123abcd.json"
    marker = capture.compiled_marker(key, "plan-a")
    assert marker == capture.compiled_marker(key, "plan-a")
    assert marker != capture.compiled_marker(capture.report_dir() / "4567ef01.json", "plan-a")
    assert marker != capture.compiled_marker(key, "plan-a:richer")


def test_another_torch_or_triton_is_not_served_by_the_marker(monkeypatch):
    key = capture.report_dir() / "0123abcd.json"
    marker = capture.compiled_marker(key, None)
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert capture.compiled_marker(key, None) != marker
    monkeypatch.undo()
    monkeypatch.setattr(settings, "triton_version", lambda: "0.0.other")
    assert capture.compiled_marker(key, None) != marker
