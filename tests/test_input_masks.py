"""Mask-shaped graph inputs rebuilt in the graph (compile_stack/input_masks.py): which tensors are
one diagonal split, that the rebuilt graph computes exactly the input, and which inputs stay."""
import pytest
import torch

from compile_stack.backend import input_masks
from compile_stack.backend.input_masks import diagonal_split
from torch_internals import aot

T = 7
ONES = torch.ones(T, T)
NEG = float("-inf")


@pytest.mark.parametrize("mask, diagonal, a, b", [
    (ONES.tril(), 0, 1.0, 0.0),  # nanoGPT's buffer
    (ONES.tril().bool(), 0, True, False),
    (ONES.triu(1).bool(), 0, False, True),  # True = masked
    (ONES.triu(), -1, 0.0, 1.0),
    (torch.zeros(T, T).masked_fill(ONES.triu(1).bool(), NEG), 0, 0.0, NEG),  # additive
    (torch.full((T, T), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16).triu(1), 0, 0.0,
     torch.finfo(torch.bfloat16).min),
    (torch.full((T, T), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1), 0, 0.0,
     torch.finfo(torch.float64).min),
    (ONES.tril(2).bool(), 2, True, False),
    (ONES.tril().view(1, 1, T, T).expand(2, 3, T, T), 0, 1.0, 0.0),
    (torch.ones(T, T + 4).tril(4), 4, 1.0, 0.0),  # more keys than queries
    (torch.ones(T, T, dtype=torch.bool), None, True, True),  # all true: no mask at all
])
def test_diagonal_splits_are_found_exactly(mask, diagonal, a, b):
    split = diagonal_split(mask)
    assert (split.diagonal, split.a, split.b, split.shape, split.dtype) == (diagonal, a, b, tuple(mask.shape), mask.dtype)
    graph = torch.fx.Graph()
    graph.output(input_masks._build(graph, split))
    rebuilt = torch.fx.GraphModule(torch.nn.Module(), graph)()
    assert rebuilt.dtype == mask.dtype and torch.equal(rebuilt, mask)


@pytest.mark.parametrize("mask", [
    ONES.tril() - ONES.tril(-3),  # a sliding window: two diagonals
    torch.stack([ONES.tril(), ONES.tril(1)]),  # differs between leading indices
    torch.randn(T, T),
    torch.zeros(T, T),  # a float of one value: as likely data
    ONES.tril().t().contiguous()[:, :1],  # one column
    torch.tensor([[1.0, 0.0], [1.0, 1.0]]).repeat(3, 3),  # a repeated pattern, not one split
])
def test_other_tensors_are_not_splits(mask):
    assert diagonal_split(mask) is None


def test_a_large_mask_is_checked_a_block_of_rows_at_a_time(monkeypatch):
    monkeypatch.setattr(input_masks, "CHECK_ROWS", 3)
    mask = torch.ones(10, 10).tril()
    assert diagonal_split(mask).diagonal == 0
    mask[8, 2] = 0  # in the last block of rows only
    assert diagonal_split(mask) is None


def test_only_plain_read_only_mask_inputs_are_candidates():
    class Uses(torch.nn.Module):
        def forward(self, mask, ids, weight, grad_mask, modified):
            modified.add_(1)
            return mask.sum() + ids.sum() + weight.sum() + grad_mask.sum() + modified.sum()

    gm = torch.fx.symbolic_trace(Uses())
    tril = ONES.tril()
    inputs = [tril, tril.long(), torch.nn.Parameter(tril.clone()), tril.clone().requires_grad_(), tril.clone()]
    assert list(input_masks.find(gm, inputs)) == [0]


def test_a_rebuilt_mask_keeps_the_graph_cacheable():
    """The nodes that build the mask carry Dynamo's example values: without them AOTAutograd's
    cache bypassed the graph (a method call on a node with none), so a warm start compiled again."""
    seen = {}

    def backend(gm, example_inputs):
        found = input_masks.find(gm, example_inputs)
        input_masks.rebuild(gm, found)
        seen["found"], seen["refusal"] = found, aot.cache_refusal(gm)
        seen["values"] = [n.meta.get("example_value") for n in gm.graph.nodes if n.op.startswith("call")]
        return gm

    mask = torch.ones(2, 1, T, T, dtype=torch.bool).tril()
    x = torch.randn(2, 3, T, 4)
    fn = torch.compile(lambda q, m: torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=m),
                       backend=backend, fullgraph=True)
    torch.testing.assert_close(fn(x, mask), torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True))
    assert list(seen["found"]) == [1] and seen["refusal"] is None
    assert all(v is not None for v in seen["values"])
