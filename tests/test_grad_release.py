"""A step's own zero-grad, traced by Dynamo: the last step's gradients are gone before the forward runs."""
import copy
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compile_stack
from compile_stack.backend.grad_release import grads_set_to_none
from passes import registry
from tests.user_corpus import TOLERANCE, batches, fresh_gpt, mean_cross_entropy

# Weak references to the gradients the previous step left; the probe counts those still alive
# when the compiled forward reaches it.
OLD_GRADS: list[weakref.ref] = []
ALIVE: list[int] = []


@torch.library.custom_op("cstack_test::count_old_grads", mutates_args=())
def count_old_grads(tokens: torch.Tensor) -> torch.Tensor:
    ALIVE.append(sum(ref() is not None for ref in OLD_GRADS))
    return tokens.clone()


@count_old_grads.register_fake
def _(tokens):
    return torch.empty_like(tokens)


def zero_grads(params):
    for p in params:
        p.grad = None


def loop_at_the_top(model, optimizer):
    def train_step(inputs, targets):
        for p in model.parameters():
            p.grad = None
        loss = mean_cross_entropy(model(count_old_grads(inputs)), targets)
        loss.backward()
        optimizer.step()
        return loss
    return train_step


def helper_and_list(model, optimizer):
    params = list(model.parameters())

    def train_step(inputs, targets):
        zero_grads(params)
        logits = model(count_old_grads(inputs))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        loss.backward()
        optimizer.step()
        return loss
    return train_step


def run(make_step, steps: int = 3, codegen: bool = False):
    """The step compiled and eagerly, from one seed; the compiled step's probe counts."""
    model = fresh_gpt()
    eager_model = copy.deepcopy(model)
    compiled = compile_stack.compile_step(make_step(model, torch.optim.SGD(model.parameters(), lr=1e-2)),
                                          codegen=codegen)
    eager = make_step(eager_model, torch.optim.SGD(eager_model.parameters(), lr=1e-2))
    ALIVE.clear()
    for inputs, targets in batches(steps):
        OLD_GRADS[:] = [weakref.ref(p.grad) for p in model.parameters() if p.grad is not None]
        loss = compiled(inputs, targets)
        counted = len(ALIVE)
        torch.testing.assert_close(loss, eager(inputs, targets), **TOLERANCE)
        del ALIVE[counted:]  # the eager step's probe
    alive, ALIVE[:] = list(ALIVE), []
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, **TOLERANCE)
        torch.testing.assert_close(p.grad, q.grad, **TOLERANCE)
    return alive


@pytest.mark.parametrize("make_step", [loop_at_the_top, helper_and_list])
def test_a_hand_written_zero_grad_frees_the_gradients_before_the_forward(make_step):
    """Without the release every one of the 25 old gradients was alive in steps 2 and 3's forward."""
    assert run(make_step) == [0, 0, 0]
    assert registry.current().replacements["cross_entropy"] == 1


def test_the_release_holds_in_generated_code():
    assert run(loop_at_the_top, steps=2, codegen=True) == [0, 0]


def test_gradients_read_before_they_are_zeroed_keep_their_values():
    """A step that logs the old gradients' norm, then zeroes them: the graph takes them as inputs,
    and releasing the parameters' references early changes nothing it computes."""
    norms = []

    def make_step(model, optimizer):
        def train_step(inputs, targets):
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norm = torch.stack([g.norm() for g in grads]).norm() if grads else torch.zeros(())
            for p in model.parameters():
                p.grad = None
            loss = mean_cross_entropy(model(count_old_grads(inputs)), targets)
            loss.backward()
            optimizer.step()
            return loss + 0 * norm, norm
        return train_step

    def recording(model, optimizer):
        step = make_step(model, optimizer)

        def train_step(inputs, targets):
            loss, norm = step(inputs, targets)
            norms.append(norm.detach().clone())
            return loss
        return train_step

    run(recording)
    compiled_norms, eager_norms = norms[0::2], norms[1::2]
    assert eager_norms[1] > 0
    for got, expected in zip(compiled_norms, eager_norms):
        torch.testing.assert_close(got, expected, **TOLERANCE)


def test_gradients_set_to_zeros_are_left_alone():
    """``p.grad = torch.zeros_like(p)`` is not a release: the old gradients stay until the graph's
    stores replace them, and the new ones are the zeros the step asked for."""
    def make_step(model, optimizer):
        def train_step(inputs, targets):
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            loss = mean_cross_entropy(model(count_old_grads(inputs)), targets)
            loss.backward()
            optimizer.step()
            return loss
        return train_step

    assert run(make_step) == [0, 25, 25]


def test_no_release_outside_a_dynamo_trace():
    gm = torch.fx.symbolic_trace(nn.Linear(3, 3))
    assert grads_set_to_none(gm) == ([], [])
