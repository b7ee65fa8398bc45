"""Gradient accumulation written as a loop in the step: the loss is fused, the step equals eager."""
import copy
import linecache

import pytest
import torch
import torch.nn.functional as F

import compile_stack
from compile_stack.capture import accumulation_loops
from compile_stack.memory_plan.ledger import gradients_to_come_bytes
from passes import registry
from tests.user_corpus import STATE_TOLERANCE, TOLERANCE, batches, fresh_gpt, state_tensors


def over_a_list(model, optimizer, micro_batches):
    """The common form: a list of micro-batches, the loss inline, a running total for the log."""
    def train_step():
        total = 0.0
        for inputs, targets in micro_batches:
            logits = model(inputs)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)) / len(micro_batches)
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total
    return train_step


def over_chunks(model, optimizer, micro_batches):
    """One batch cut into chunks, a hand-written loss, a counter the step shares with its caller,
    the loss of the last micro-batch returned."""
    inputs = torch.cat([x for x, _ in micro_batches])
    targets = torch.cat([y for _, y in micro_batches])
    accum = len(micro_batches)
    seen = 0

    def train_step():
        nonlocal seen
        optimizer.zero_grad()
        for x, y in zip(inputs.chunk(accum), targets.chunk(accum)):
            log_probs = F.log_softmax(model(x).float(), dim=-1)
            loss = -log_probs.gather(-1, y.unsqueeze(-1)).mean() / accum
            loss.backward()
            seen += 1
        optimizer.step()
        return loss.detach() * seen / seen
    return train_step


@pytest.mark.parametrize("make_step", [over_a_list, over_chunks])
def test_an_accumulation_loop_fuses_its_loss_and_equals_eager(make_step):
    model = fresh_gpt()
    eager_model = copy.deepcopy(model)
    micro_batches = batches(2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_optimizer = torch.optim.AdamW(eager_model.parameters(), lr=1e-2)
    compiled = compile_stack.compile_step(make_step(model, optimizer, micro_batches), codegen=False)
    eager = make_step(eager_model, eager_optimizer, micro_batches)
    for _ in range(3):
        torch.testing.assert_close(compiled(), eager(), **TOLERANCE)
    for got, expected in zip(state_tensors(optimizer) + list(model.parameters()),
                             state_tensors(eager_optimizer) + list(eager_model.parameters())):
        torch.testing.assert_close(got, expected, **STATE_TOLERANCE)
    assert registry.current().replacements["cross_entropy"] == 1  # the body's graph, every micro-batch
    assert registry.current().replacements["attention"] == 2  # the blocks' graph, compiled once
    assert any(n.startswith("step: 1 loop body calling backward()") for n in registry.current().notes)
    assert not any("ran the step's own code eagerly" in n for n in registry.current().notes)


class Loss:
    """Stands for a loss tensor: counts its backward() calls."""

    def __init__(self, log, value):
        self.log, self.value = log, value

    def backward(self):
        self.log.append(self.value)


def test_the_outlined_step_computes_what_the_step_did():
    """Names the body shares with the step (a total, a value carried from the previous iteration,
    the last iteration's value read after the loop, one a comprehension's ``:=`` binds) behave as
    before; one only the body uses stays its own; line numbers are the step's."""
    log = []

    def step(values, scale=2):
        total, previous = 0, None
        for v in values:
            if v < 0:
                continue
            scratch = v * scale
            carried = previous if previous is not None else 0
            previous = scratch
            Loss(log, scratch + carried).backward()
            total += scratch
            _ = [last := s for s in (scratch, carried) if s]  # binds last in the step's scope
        return total, previous, log[-1], last

    rewritten = accumulation_loops.outlined(step)
    assert rewritten is not None and rewritten.__code__.co_firstlineno == step.__code__.co_firstlineno
    for values in ([1, -2, 3, 4], [5], [-1, 7]):
        log.clear()
        expected, expected_log = step(values), list(log)
        log.clear()
        assert rewritten(values) == expected and log == expected_log
    (body,) = accumulation_loops.body_codes(rewritten.__code__)
    assert set(body.co_freevars) >= {"total", "previous"} and "scratch" in body.co_varnames


def _break_out(losses):
    for loss in losses:
        loss.backward()
        if loss is None:
            break


def _no_backward(xs):
    for x in xs:
        x.step()


def _returns_inside(losses):
    for loss in losses:
        loss.backward()
        return loss


@pytest.mark.parametrize("fn", [_break_out, _no_backward, _returns_inside, lambda losses: [x.backward() for x in losses],
                                print])
def test_steps_outlining_cannot_keep_equal_are_left_as_written(fn):
    assert accumulation_loops.outlined(fn) is None


def test_a_step_whose_source_is_not_what_runs_is_left_as_written(tmp_path, monkeypatch):
    """The source file edited after the step was defined: rewriting it would run other code."""
    script = tmp_path / "users_script.py"
    script.write_text("def step(losses):\n    for loss in losses:\n        loss.backward()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__("users_script")
    assert accumulation_loops.outlined(module.step) is not None
    script.write_text("def step(losses):\n    for loss in losses:\n        loss.backward()\n        print(loss)\n")
    linecache.checkcache(str(script))
    assert accumulation_loops.outlined(module.step) is None


def test_the_gradients_to_come_count_for_an_accumulating_step():
    trained, frozen, done = (torch.nn.Parameter(torch.zeros(3, 5)) for _ in range(3))
    frozen.requires_grad_(False)
    done.grad = torch.zeros_like(done)
    assert gradients_to_come_bytes([trained, frozen, done]) == 3 * 5 * 4
