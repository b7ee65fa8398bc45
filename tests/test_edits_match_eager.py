"""Compiled step == eager step, NaN for NaN, under the edits a training loop makes between steps:
hand-edited hyperparameters (lr, weight decay, betas, eps, 0 included, changed every step) and
batches with none, some or all targets ignored. Fused AdamW and fused cross-entropy both run."""
import copy
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import compile_stack
from tests.user_models import MyAdamW

VOCAB, D, BATCH, SEQ = 11, 8, 2, 5  # a vocabulary larger than a batch's tokens: embedding rows with v = 0
CHOICES = {"lr": (0.0, 1e-3, 3e-2), "weight_decay": (0.0, 0.01, 0.5), "beta1": (0.0, 0.5, 0.9),
           "beta2": (0.9, 0.999), "eps": (0.0, 1e-8, 1e-3)}
# Not β₂ = 0 here (tests/test_adamw_op.py has it, from equal gradients): v then keeps no history and the
# update m/(|g| + eps) turns fp32 noise in a gradient near 0 (a 2% difference, between two correct
# gradients of a near-cancelling sum) into a step of lr·|m/g| on either side.


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.hidden = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(self.embed(x))))


def make_step(model, optimizer):
    def train_step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))
        loss.backward()
        optimizer.step()
        return loss
    return train_step


def edit(optimizers, rng: random.Random) -> dict:
    """Each hyperparameter set to a random choice (0 included) in every group of both optimizers."""
    values = {name: rng.choice(choices) for name, choices in CHOICES.items()}
    for opt in optimizers:
        for group in opt.param_groups:
            group.update(lr=values["lr"], weight_decay=values["weight_decay"], eps=values["eps"],
                         betas=(values["beta1"], values["beta2"]))
    return values


def batch(rng: random.Random, ignored: str):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    x = torch.randint(VOCAB, (BATCH, SEQ), generator=gen)
    y = torch.randint(VOCAB, (BATCH, SEQ), generator=gen)
    if ignored == "all":
        y.fill_(-100)
    elif ignored == "some":
        y[torch.rand(y.shape, generator=gen) < 0.5] = -100
    return x, y


def assert_same(actual, expected, what):
    """Equal to fp32 noise (grown by eps = 0 steps), NaN where eager has NaN and nowhere else."""
    torch.testing.assert_close(actual, expected, rtol=1e-3, atol=2e-5, equal_nan=True, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("make_optimizer", [torch.optim.AdamW, MyAdamW], ids=["torch.optim.AdamW", "hand-written"])
def test_random_edits_and_ignored_targets_match_eager(make_optimizer, seed):
    """Each step's hyperparameters drawn afresh (a new weight decay, beta or eps recompiles the
    optimizer step, lr does not); the seed picks one sequence of edits."""
    torch._dynamo.reset()
    rng = random.Random(f"edits {make_optimizer.__name__} {seed}")
    model = TinyLM()
    eager_model = copy.deepcopy(model)
    optimizer, eager_optimizer = make_optimizer(model.parameters()), make_optimizer(eager_model.parameters())
    step = compile_stack.compile_step(make_step(model, optimizer), codegen=False)
    eager_step = make_step(eager_model, eager_optimizer)
    masks = ["none", "some", "all", "none", "all", "some", "none"]
    for i, ignored in enumerate(masks):
        values = edit([optimizer, eager_optimizer], rng) if i else {}
        x, y = batch(rng, ignored)
        what = f"step {i} ({ignored} ignored, {values})"
        assert_same(step(x, y).detach(), eager_step(x, y).detach(), f"{what}: loss")
        for (name, p), q in zip(model.named_parameters(), eager_model.parameters()):
            assert_same(p.detach(), q.detach(), f"{what}: {name}")
    replaced = step.report.replacements
    assert replaced["cross_entropy"] >= 1 and replaced["adamw"] >= 1  # the fused ops ran


def test_lr_edits_do_not_recompile():
    """torch.optim's lr is a symbol from the first compile: a schedule (or a hand edit) is no recompile."""
    torch._dynamo.reset()
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = compile_stack.compile_step(make_step(model, optimizer), codegen=False)
    x, y = batch(random.Random(0), "none")
    step(x, y)
    step(x, y)
    compiled = counters["stats"]["unique_graphs"]
    for lr in (0.0, 3e-2, 0.0, 1e-4):
        optimizer.param_groups[0]["lr"] = lr
        step(x, y)
    assert counters["stats"]["unique_graphs"] == compiled


def relative_errors(model, reference) -> dict[str, float]:
    return {name: ((p.double() - q).norm() / q.norm()).item()
            for (name, p), q in zip(model.named_parameters(), reference.parameters())}


def test_compiled_bf16_is_as_close_to_float64_as_eager_bf16():
    """bf16 weights: the fused loss (fp32 log-sum-exp) and update (fp32 math, rounded once) keep the
    compiled step at least as close to the same step in float64 as eager bf16, whose every op
    rounds to bf16: compared at its worst tensor and over all weights."""
    torch._dynamo.reset()
    rng = random.Random("bf16")
    reference = TinyLM().double()
    eager_model, model = copy.deepcopy(reference).bfloat16(), copy.deepcopy(reference).bfloat16()
    steps = [make_step(m, torch.optim.AdamW(m.parameters(), lr=3e-2, weight_decay=0.1))
             for m in (reference, eager_model)]
    steps.append(compile_stack.compile_step(make_step(model, torch.optim.AdamW(model.parameters(), lr=3e-2,
                                                                               weight_decay=0.1)), codegen=False))
    for ignored in ("none", "some", "none", "none"):
        x, y = batch(rng, ignored)
        for step in steps:
            step(x, y)
    assert steps[-1].report.replacements["cross_entropy"] == 1 and steps[-1].report.replacements["adamw"] == 1
    eager, compiled = relative_errors(eager_model, reference), relative_errors(model, reference)
    assert max(compiled.values()) <= max(eager.values())
    assert sum(e**2 for e in compiled.values()) <= sum(e**2 for e in eager.values())
