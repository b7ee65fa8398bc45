"""The activation memory budget chosen per graph (compile_stack/budget.py).

A two-block MLP model is compiled through our backend without code
generation, with a ledger of a chosen capacity standing in for a device: ample
memory keeps the budget-1.0 plan; less makes the backend search down and keep
a plan that fits; too little is refused with what would fit. Every plan gives
eager's gradients.
"""
import gc
import importlib
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from compile_stack.memory_plan.ledger import SCRATCH_BYTES, MemoryLedger, lazy_optimizer_state_bytes
from compile_stack.backend import PassBackend
from compile_stack.capture.step import plan_refusal
from compile_stack.memory_plan import MemoryPlan
from compile_stack.memory_plan.fit import MemoryPlanError
from passes import registry


class Mlp(nn.Module):
    def __init__(self, d=16, ff=64):
        super().__init__()
        self.up, self.down = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x):
        h = self.up(x)
        return x + self.down(F.gelu(h) * torch.sigmoid(h) + h.tanh())


def ledger(capacity: float) -> MemoryLedger:
    return MemoryLedger(capacity, allocated=lambda: 0, future_state=lambda: 0)


def compiled_grads(model, x, book: MemoryLedger):
    backend = PassBackend(passes=[], codegen=False, plan=MemoryPlan(book))
    model.zero_grad(set_to_none=True)
    torch.compile(model, backend=backend)(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.fixture
def case():
    torch._dynamo.reset()
    registry.current().clear()
    model = nn.Sequential(Mlp(), Mlp())
    x = torch.randn(4, 33, 16, requires_grad=True)
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    return model, x, expected


def plan_at(capacity: float, case):
    model, x, expected = case
    torch._dynamo.reset()
    registry.current().clear()
    book = ledger(capacity)
    grads = compiled_grads(model, x, book)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)
    (saved,) = book.reserved.values()
    return saved, book


def test_ample_memory_keeps_the_budget_one_plan(case):
    saved, book = plan_at(1e15, case)
    assert saved > 0 and book.working == saved
    assert any("activation memory budget 1" in n for n in registry.current().notes)


def test_less_memory_searches_down_to_a_plan_that_fits(case):
    full, _ = plan_at(1e15, case)
    capacity = SCRATCH_BYTES + full + 0.6 * full  # room for one working set and 60% of the full plan
    saved, book = plan_at(capacity, case)
    assert saved <= 0.6 * full
    note = next(n for n in registry.current().notes if n.startswith("memory:"))
    budget = float(note.rsplit(" ", 1)[1])
    assert 0 < budget < 1


def test_too_little_memory_is_refused_with_what_would_fit(case):
    """Not a warning and a run out of memory after the compile: one message, before Inductor runs."""
    full, _ = plan_at(1e15, case)
    with pytest.raises(Exception) as raised:
        plan_at(SCRATCH_BYTES + full + 1, case)
    refused = plan_refusal(raised.value)
    assert isinstance(refused, MemoryPlanError)
    message = str(refused)
    assert "does not fit" in message and "even at the least activation memory budget" in message
    assert "Would fit: " in message and "the tokens per step (a smaller batch or sequence)" in message


def test_other_graphs_reservations_and_state_to_come_are_subtracted():
    book = MemoryLedger(100 * 2**30, allocated=lambda: 10 * 2**30, future_state=lambda: 20 * 2**30)
    book.reserve("head", 5 * 2**30, working=2**30)
    assert book.available("block", working=3 * 2**30) == 100 * 2**30 - 10 * 2**30 - 20 * 2**30 - 5 * 2**30 \
        - 3 * 2**30 - SCRATCH_BYTES
    book.reserve("block", 7 * 2**30, working=3 * 2**30)
    # A recompile of "block" replaces its own reservation; the larger working set stays.
    assert book.available("block", working=0) == 100 * 2**30 - 35 * 2**30 - 3 * 2**30 - SCRATCH_BYTES


def test_allocations_during_the_step_count_as_of_its_start():
    allocated = [10 * 2**30]
    book = MemoryLedger(100 * 2**30, allocated=lambda: allocated[0], future_state=lambda: 0)
    book.at_step_start()
    allocated[0] += 60 * 2**30  # the blocks' saved activations, reserved by the blocks' graph
    book.reserve("block", 60 * 2**30, working=2**30)
    assert book.available("head", working=0) == 100 * 2**30 - 10 * 2**30 - 60 * 2**30 - 2**30 - SCRATCH_BYTES


def test_state_the_first_step_creates_counts_once():
    """An optimizer's moments, created lazily by the first step's update: state to come at the
    step's start, allocated by its end. The shares settled after that step (plan_share.py) count
    them once; counted as neither, the last blocks took 22 GiB that torch.optim.AdamW's moments
    held, and a user's full-size step ran out of memory at its second call."""
    allocated, to_come = [10 * 2**30], [20 * 2**30]
    book = MemoryLedger(100 * 2**30, allocated=lambda: allocated[0], future_state=lambda: to_come[0])
    book.at_step_start()
    at_start = book.available("block", working=0)
    allocated[0], to_come[0] = 30 * 2**30, 0  # the update created them
    assert book.available("block", working=0) == at_start == 100 * 2**30 - 30 * 2**30 - SCRATCH_BYTES


def test_lazy_state_counts_two_moments_per_parameter_without_state():
    a, b = nn.Parameter(torch.zeros(10)), nn.Parameter(torch.zeros(3, 4))
    opt = torch.optim.AdamW([a, b])
    assert lazy_optimizer_state_bytes([opt]) == 2 * 4 * (10 + 12)
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    opt.step()
    assert lazy_optimizer_state_bytes([opt]) == 0


def test_the_ledger_does_not_keep_the_optimizer_alive():
    """Dynamo's caches keep our backends and their ledger; the model's state must still be freed."""
    model = nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters())
    book = MemoryLedger.for_device(torch.device("cpu"), [opt])
    assert book.future_state() == 2 * 4 * 12
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None and book.future_state() == 0


def test_no_ledger_for_a_step_on_the_cpu():
    model = nn.Linear(3, 3)
    assert MemoryPlan.for_step([torch.optim.SGD(model.parameters())], [model]) is None


def test_a_fixed_budget_wins_over_the_ledger():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert PassBackend(memory_budget=0.5, plan=MemoryPlan(ledger(1.0))).plan is None


@pytest.mark.parametrize("module", ["partitioner", "ledger", "offload", "share", "records"])
def test_the_plan_identity_changes_with_the_code_that_decides_or_records_plans(module, monkeypatch, tmp_path):
    """An edit to any of these files gives cached graphs and their plan records a new identity
    (their old entries are then missed, not misread)."""
    from compile_stack.memory_plan import partitioner

    target = importlib.import_module(f"compile_stack.memory_plan.{module}")
    before = partitioner.plan_code_hash()
    edited = tmp_path / f"{module}.py"
    edited.write_bytes(Path(target.__file__).read_bytes() + b"\n# edited\n")
    monkeypatch.setattr(target, "__file__", str(edited))  # for partitioner, the global plan_code_hash reads
    assert partitioner.plan_code_hash() != before


def test_an_allocation_failure_says_what_the_plan_expected():
    """The estimate wrong after all (a bug to fix): the error carries each graph's planned bytes."""
    import compile_stack

    class Plan:  # a step's plan as the compiled step asks it
        def step_starts(self, *args):
            pass

        step_ended = step_starts

        def notes(self):
            return ["block saves 3.00 GiB for its backward (4 call sites) at activation memory budget 0.5"]

    def step():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    compiled = compile_stack.compile_step(step, codegen=False)
    compiled.memory_plan = Plan()
    with pytest.raises(torch.OutOfMemoryError, match=r"(?s)Tried to allocate 2.00 GiB.*memory plan expected.*"
                                                     r"block saves 3.00 GiB"):
        compiled()
