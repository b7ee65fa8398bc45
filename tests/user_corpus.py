"""The harness of the user-style corpus (``tests/test_corpus_*.py``).

A case is a user's own model, loss and optimizer, written independently of
``compile_stack/reference.py``. ``run_case`` builds two copies from one seed,
steps one eagerly and one through ``compile_stack.compile_step`` (our passes,
aten graphs run without code generation, so a case takes seconds) on a new
batch each step, and asserts:

- what each pass replaced (``expect``: pass name -> count; attention counts
  every layer whose attention runs our op) and that the notes mention what
  ``notes`` lists (the must-not-replace cases);
- that the compiled step equals the eager one: the loss of every step, and
  after the last step the gradients, parameters and every tensor of the
  optimizer's state.
"""
import copy
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

import compile_stack
from passes import registry
from tests import user_models

VOCAB, SEQ, BATCH = 37, 12, 2  # odd sizes: nothing lines up by accident
TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # fp32 losses and gradients; a wrong rewrite moves them by O(1)
# Parameters and moments: Adam divides by √v, so where a gradient is near 0 a rounding difference in it
# moves that element by up to a step's size (lr) in either run; 2e-4 is 2% of one step at lr 1e-2.
STATE_TOLERANCE = dict(rtol=1e-4, atol=2e-4)


def mean_cross_entropy(logits, targets):
    """The leaderboard's loss: F.cross_entropy over flattened tokens, mean."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def fresh_gpt(layers: int = 2):
    """``tests.user_models``' GPT at a tiny size, from seed 0, with Dynamo and the pass report reset."""
    torch._dynamo.reset()
    registry.current().clear()
    torch.manual_seed(0)
    return user_models.build_gpt(vocab_size=VOCAB, context_length=16, d_model=32, num_layers=layers, num_heads=2,
                                 d_ff=48)


def batches(steps: int, vocab: int = VOCAB, seq: int = SEQ, batch: int = BATCH):
    generator = torch.Generator().manual_seed(1234)
    return [(torch.randint(vocab, (batch, seq), generator=generator),
             torch.randint(vocab, (batch, seq), generator=generator)) for _ in range(steps)]


def make_train_step(model, loss_fn, optimizer, clip: float | None = None, scheduler=None):
    """The user's train step, the leaderboard's way (plus optional clipping and a scheduler)."""

    def train_step(inputs, targets):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets).sum()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        return loss

    return train_step


def state_tensors(obj) -> list[torch.Tensor]:
    """Every tensor an optimizer holds (its attributes, param groups and state, walked in order)."""
    found = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk({k: v for k, v in sorted(vars(obj).items()) if k != "defaults"})
    return found


def run_case(
    make_model: Callable[[], torch.nn.Module],
    loss_fn: Callable = mean_cross_entropy,
    make_optimizer: Callable[[Iterable], object] = adamw,
    *,
    expect: dict[str, int],
    notes: Iterable[str] = (),
    steps: int = 3,
    clip: float | None = None,
    make_scheduler: Callable | None = None,
    vocab: int = VOCAB,
    seq: int = SEQ,
    cache_dir=None,
) -> dict:
    """Eager vs compiled on copies of one model; returns the pass report's counts. ``cache_dir``:
    caches of the test's own, where what it checks is Dynamo's trace of the optimizer (a proven
    update recorded by an earlier test would run instead)."""
    torch._dynamo.reset()
    registry.current().clear()
    torch.manual_seed(0)
    model = make_model()
    eager_model = copy.deepcopy(model)
    optimizer, eager_optimizer = make_optimizer(model.parameters()), make_optimizer(eager_model.parameters())
    schedulers = [make_scheduler(o) for o in (optimizer, eager_optimizer)] if make_scheduler else []
    compiled = compile_stack.compile_step(make_train_step(model, loss_fn, optimizer, clip), codegen=False,
                                          cache_dir=cache_dir)
    eager = make_train_step(eager_model, loss_fn, eager_optimizer, clip)
    for i, (inputs, targets) in enumerate(batches(steps, vocab, seq)):
        loss = compiled(inputs, targets)
        eager_loss = eager(inputs, targets)
        torch.testing.assert_close(loss, eager_loss, **TOLERANCE, msg=lambda m: f"step {i + 1} loss: {m}")
        for scheduler in schedulers:
            scheduler.step()
    for (name, p), q in zip(model.named_parameters(), eager_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOLERANCE, msg=lambda m: f"grad of {name}: {m}")
        torch.testing.assert_close(p, q, **STATE_TOLERANCE, msg=lambda m: f"{name}: {m}")
    ours, theirs = state_tensors(optimizer), state_tensors(eager_optimizer)
    assert len(ours) == len(theirs)
    for k, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, **STATE_TOLERANCE, msg=lambda m: f"optimizer state tensor {k}: {m}")
    counts = dict(registry.current().replacements)
    got = {name: int(counts.get(name, 0)) for name in expect}
    assert got == expect, f"replacements {got}, expected {expect}; notes: {registry.current().notes}"
    for fragment in notes:
        assert any(fragment in n for n in registry.current().notes), \
            f"no note mentions {fragment!r}; notes: {registry.current().notes}"
    return counts
