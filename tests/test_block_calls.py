"""compile_stack.capture.blocks: how block calls are routed while the compiled step runs."""
import pytest
import torch
import torch.nn as nn

import compile_stack
from compile_stack.capture import blocks
from tests.user_corpus import batches, fresh_gpt, make_train_step, mean_cross_entropy


class Opaque:
    """An object no graph node can take (as a transformers ``Cache``)."""


@pytest.mark.parametrize("values, passable", [
    ((torch.ones(2), None, 3, 0.5, True, "causal", torch.float16), True),
    (((torch.ones(2), torch.ones(2)), [torch.ones(1), None]), True),  # RoPE's (cos, sin), a list
    (({"mask": torch.ones(2), "scale": None},), True),
    (((torch.ones(2), (torch.ones(2), [Opaque()])),), False),  # nested deep inside
    (({"cache": Opaque()},), False),
    (({1: torch.ones(2)},), False),  # a key no keyword can be
    ((Opaque(),), False),
    ((), True),
])
def test_what_a_block_call_node_can_take(values, passable):
    assert blocks._passable(values) is passable


def test_blocks_are_routed_only_while_the_step_runs():
    """While routed, each block is of a subclass of its own class (so isinstance holds) that knows
    its call; afterwards, error or not, each is as it was."""
    model = fresh_gpt(layers=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = compile_stack.compile_step(make_train_step(model, mean_cross_entropy, optimizer), codegen=False)
    (calls,) = step.block_calls
    cls = type(calls.blocks[0])
    before = [dict(vars(b)) for b in calls.blocks]
    with pytest.raises(RuntimeError, match="inside"):
        with calls.routed():
            assert all(type(b) is calls.routed_class and isinstance(b, cls) for b in calls.blocks)
            assert [b._routed_call[1] for b in calls.blocks] == [0, 1, 2]
            raise RuntimeError("inside")
    for inputs, targets in batches(2):
        step(inputs, targets)
    assert all(type(b) is cls for b in calls.blocks)
    assert [vars(b).keys() for b in calls.blocks] == [d.keys() for d in before]


class Echo(nn.Module):
    """A block taking an extra keyword."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, memo=None):
        return x + torch.tanh(self.proj(x))


class WithMemo(nn.Module):
    def __init__(self, memo):
        super().__init__()
        self.embed, self.blocks, self.head = nn.Embedding(37, 8), nn.ModuleList(Echo() for _ in range(3)), nn.Linear(8, 37)
        self.memo = memo

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, memo=self.memo)
        return self.head(x)


@pytest.mark.parametrize("memo", [None, Opaque()])
def test_a_call_no_node_can_take_is_traced_where_made_and_matches_eager(memo):
    torch.manual_seed(0)
    model, eager = WithMemo(memo), WithMemo(memo)
    eager.load_state_dict(model.state_dict())
    step = compile_stack.compile_step(lambda x, y: mean_cross_entropy(model(x), y), codegen=False)
    (inputs, targets), = batches(1)
    torch.testing.assert_close(step(inputs, targets), mean_cross_entropy(eager(inputs), targets))
    (calls,) = step.block_calls
    routed = len(calls.fake_outputs) > 0  # a block call node ran on fakes
    assert routed is (memo is None)
