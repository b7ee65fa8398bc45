"""An optimizer's graph reaches AOTAutograd's cache in a form it accepts (compile_stack/capture.py):
what Dynamo records for ``p.data`` updates (``Tensor.set_`` called as a function, a local
version-counter function) is refused by the cache's check, so the graph was compiled from scratch
at every warm start; our pre-grad passes run before the check and rewrite it."""
import pytest
import torch

from compile_stack.backend import PassBackend
from tests.helpers import dynamo_graph

check_node_safe = pytest.importorskip("torch._functorch._aot_autograd.autograd_cache").check_node_safe


def hand_written_sgd_step(params, lr=0.1):
    with torch.no_grad():
        for p in params:
            p.data -= lr * p.grad  # Dynamo: get-data, isub, set_, version-counter fix-up
            p.data = p.data * 0.99  # Dynamo: set_ to a new tensor


def refused(gm: torch.fx.GraphModule) -> list[str]:
    out = []
    for node in gm.graph.nodes:
        try:
            check_node_safe(node)
        except Exception as e:  # the cache's own refusal (BypassAOTAutogradCache and others)
            out.append(f"{node.format_node()}: {e}")
    return out


def test_a_p_data_update_graph_is_cacheable_after_our_pre_grad_passes():
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(2)]
    for p in params:
        p.grad = torch.randn_like(p)
    gm = dynamo_graph(hand_written_sgd_step, params)
    assert refused(gm), "Dynamo's graph of a p.data update was expected to be refused by the cache as captured"
    PassBackend(codegen=False)._prepare(gm, masks={})
    assert refused(gm) == []
