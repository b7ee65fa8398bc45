"""Small helpers shared by the tests."""
import os

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64; NaN anywhere fails loudly."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert torch.isfinite(a).all(), "result has NaN/Inf"
    denom = e.norm().item()
    return (a - e).norm().item() / (denom if denom > 0 else 1.0)


INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()


def dynamo_graph(fn, *args) -> torch.fx.GraphModule:
    """The one graph Dynamo captures from ``fn(*args)`` (fresh caches), as a backend receives it."""
    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=grab, fullgraph=True)(*args)
    (gm,) = graphs
    return gm


def record_graphs(monkeypatch, stage: str = "joint") -> list:
    """A list that collects each graph as our passes of ``stage`` leave it, from now on in this test."""
    from passes import registry

    graphs, run_stage = [], registry.StagePass.__call__

    def recording(self, graph):
        run_stage(self, graph)
        if self.stage == stage:
            graphs.append(graph)

    monkeypatch.setattr(registry.StagePass, "__call__", recording)
    return graphs


def eager_and_compiled(model, step, passes: list[str], codegen: bool = False):
    """``step(model)`` run eagerly, then ``step`` of the model compiled with our ``passes`` (fresh
    Dynamo caches, an empty pass report): the two results, to compare."""
    from compile_stack.backend import PassBackend
    from passes import registry

    eager = step(model)
    torch._dynamo.reset()
    registry.current().clear()
    backend = PassBackend(passes=passes, codegen=codegen)
    compiled_model = torch.compile(model, backend=backend)
    with backend.active():
        compiled = step(compiled_model)
    return eager, compiled
