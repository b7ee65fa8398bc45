"""compile_stack.block_fakes: a block's fake output reused for blocks that would give the same one."""
import dataclasses

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import compile_stack
from compile_stack.capture import blocks
from compile_stack.capture.block_fakes import FakeOutput, call_key
from tests.user_corpus import VOCAB, batches, fresh_gpt, make_train_step, mean_cross_entropy


def fake_runs(monkeypatch) -> list:
    """Each block run on fake tensors while Dynamo traces (the one place blocks.py reparametrizes)."""
    runs, reparametrize = [], blocks._reparametrize_module

    def counted(block, tensors):
        runs.append(block)
        return reparametrize(block, tensors)

    monkeypatch.setattr(blocks, "_reparametrize_module", counted)
    return runs


def test_identical_blocks_run_on_fakes_once_in_all_traces(monkeypatch):
    """Dynamo traces the forward twice (again after its graph break at backward()); 4 blocks would
    run on fake tensors 8 times, the first answers for all."""
    runs = fake_runs(monkeypatch)
    model = fresh_gpt(layers=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = compile_stack.compile_step(make_train_step(model, mean_cross_entropy, optimizer), codegen=False)
    for inputs, targets in batches(2):
        step(inputs, targets)
    (calls,) = step.block_calls
    assert len(runs) == 1
    assert len(calls.fake_outputs) == 1 and None not in calls.fake_outputs.values()


@dataclasses.dataclass
class Config:
    d_model: int
    norm: str


class Scaled(nn.Module):
    """A block whose plain attribute changes what it computes (and, with ``widen``, its output's shape)."""

    def __init__(self, scale: float, widen: bool = False):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale, self.widen = scale, widen

    def forward(self, x):
        y = x + self.scale * torch.tanh(self.proj(x))
        return torch.cat([y, y], dim=-1)[..., :8] * 2 if self.widen else y


class Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.embed, self.blocks, self.head = nn.Embedding(VOCAB, 8), nn.ModuleList(blocks), nn.Linear(8, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_blocks_differing_in_an_attribute_each_run_on_fakes_and_match_eager(monkeypatch):
    runs = fake_runs(monkeypatch)
    torch._dynamo.reset()
    torch.manual_seed(0)
    make = lambda: Stack([Scaled(0.5), Scaled(0.5), Scaled(2.0), Scaled(0.5, widen=True)])  # noqa: E731
    model, eager = make(), make()
    eager.load_state_dict(model.state_dict())
    step = compile_stack.compile_step(lambda x, y: mean_cross_entropy(model(x), y), codegen=False)
    (inputs, targets), = batches(1)
    torch.testing.assert_close(step(inputs, targets), mean_cross_entropy(eager(inputs), targets))
    assert [len(c.blocks) for c in step.block_calls] == [4]
    assert len(runs) == 3  # one per distinct block (0.5; 2.0; 0.5 widened), once over both traces


class InWeightDtype(nn.Module):
    """A block computing in its weight's dtype."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.proj(x.to(self.proj.weight.dtype)))


class Branching(Stack):
    """A forward whose Python, after the blocks, depends on their output's dtype (as Dynamo traced it)."""

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        if x.dtype == torch.float64:
            x = 2 * x.float()
        return self.head(x)


def test_a_block_cast_after_a_step_traces_the_step_again():
    """The block calls take no parameter: the blocks' tensor layout, a constant of their nodes, is
    what Dynamo guards, so blocks cast to float64 between steps are traced again (not run through
    the float32 trace, which would skip the doubling)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Branching([InWeightDtype() for _ in range(3)])
    eager = Branching([InWeightDtype() for _ in range(3)])
    eager.load_state_dict(model.state_dict())
    step = compile_stack.compile_step(lambda x, y: mean_cross_entropy(model(x), y), codegen=False)
    (inputs, targets), = batches(1)
    torch.testing.assert_close(step(inputs, targets), mean_cross_entropy(eager(inputs), targets))
    layout = blocks.tensor_layout(list(model.blocks))
    model.blocks.double(), eager.blocks.double()
    assert blocks.tensor_layout(list(model.blocks)) != layout
    torch.testing.assert_close(step(inputs, targets), mean_cross_entropy(eager(inputs), targets))


def test_the_layout_tells_metadata_and_sharing():
    a, b = InWeightDtype(), InWeightDtype()
    layout = blocks.tensor_layout([a, b])
    assert blocks.tensor_layout([InWeightDtype(), InWeightDtype()]) == layout  # values are no part of it
    b.proj.weight.requires_grad_(False)
    assert blocks.tensor_layout([a, b]) != layout
    b.proj.weight.requires_grad_(True)
    b.proj.weight = a.proj.weight  # tied across blocks
    assert blocks.tensor_layout([a, b]) != layout


def test_the_key_tells_what_decides_the_output():
    a, b, c = Scaled(0.5), Scaled(0.5), Scaled(2.0)
    with FakeTensorMode():
        x = torch.empty(2, 5, 8)
        key = call_key(a, (x,), {}, tuple(a.parameters()))
        assert key == call_key(b, (x,), {}, tuple(b.parameters()))
        assert key != call_key(c, (x,), {}, tuple(c.parameters()))
        assert key != call_key(a, (torch.empty(2, 6, 8),), {}, tuple(a.parameters()))
        assert key != call_key(a, (x.half(),), {}, tuple(a.parameters()))
        with torch.no_grad():
            assert key != call_key(a, (x,), {}, tuple(a.parameters()))
    a.config, b.config = Config(8, "rms"), Config(8, "rms")  # a config object: compared by its fields
    assert call_key(a, (torch.empty(2, 5, 8),), {}, tuple(a.parameters())) == \
        call_key(b, (torch.empty(2, 5, 8),), {}, tuple(b.parameters()))
    b.config = Config(8, "layer")
    assert call_key(a, (torch.empty(2, 5, 8),), {}, tuple(a.parameters())) != \
        call_key(b, (torch.empty(2, 5, 8),), {}, tuple(b.parameters()))
    a.helper = object()  # an attribute nothing can compare: no key, the block runs
    assert call_key(a, (torch.empty(2, 5, 8),), {}, tuple(a.parameters())) is None
    shapes = ShapeEnv()
    with FakeTensorMode(shape_env=shapes):  # a symbolic size: the output's would be an expression of it
        assert call_key(b, (torch.empty(shapes.create_unbacked_symint(), 8),), {}, tuple(b.parameters())) is None


def test_a_made_output_has_the_metadata_and_history_of_the_real_one():
    with FakeTensorMode():
        block = Scaled(0.5)
        x = torch.empty(3, 4, 8).transpose(0, 1).requires_grad_()
        real = block(x)
        made = FakeOutput.of((real, 7, None), (x,)).make((x,))
    out, seven, none = made
    assert (seven, none) == (7, None)
    assert (out.shape, out.stride(), out.dtype, out.requires_grad) == (real.shape, real.stride(), real.dtype, True)
    assert out.grad_fn is not None and not out._is_view() and is_fake(out)


@pytest.mark.parametrize("forward", [
    lambda x: x,  # the input itself
    lambda x: (x * 2).view(-1),  # a view
    lambda x: (x * 2)[1:],  # an offset into its storage
    lambda x: (lambda y: (y, y))(x * 2),  # one tensor twice
])
def test_outputs_that_are_not_fresh_tensors_are_not_reused(forward):
    with FakeTensorMode():
        x = torch.empty(3, 8)
        assert FakeOutput.of(forward(x), (x,)) is None


class Kernel(nn.Module):
    """A function wrapper held in a plain dict, not a submodule (as transformers' kernel wrappers)."""

    def __init__(self, power: int):
        super().__init__()
        self.power = power

    def forward(self, x):
        return x ** self.power


def test_a_module_held_in_a_container_is_keyed_by_what_it_holds():
    a, b = Scaled(0.5), Scaled(0.5)
    a.kernels, b.kernels = {"act": Kernel(2)}, {"act": Kernel(2)}
    x = torch.empty(2, 5, 8)
    key = call_key(a, (x,), {}, tuple(a.parameters()))
    assert key is not None and key == call_key(b, (x,), {}, tuple(b.parameters()))
    b.kernels["act"].power = 3
    assert call_key(b, (x,), {}, tuple(b.parameters())) != key
    b.kernels["act"] = Kernel(2).double()
    b.kernels["act"].register_buffer("table", torch.ones(3))
    assert call_key(b, (x,), {}, tuple(b.parameters())) != key
