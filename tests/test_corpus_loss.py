"""User-style corpus: the many ways people write an LM head and its cross-entropy.

Every model and loss here is written the way users write them, one idiom varied
at a time, independently of compile_stack/reference.py. ``run_case`` (see
tests/user_corpus.py) steps each eagerly and compiled (our passes, no code
generation) and asserts they agree and what the cross_entropy pass replaced.
Losses that are not plain cross-entropy (label smoothing, focal loss, a z-loss
term, an arbitrary float weight per token) must be left alone, with a note.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compile_stack
from passes import registry
from tests.user_corpus import SEQ, VOCAB, adamw, batches, make_train_step, run_case

D = 32
REPLACED, LEFT_ALONE = {"cross_entropy": 1}, {"cross_entropy": 0}


# --- models: embedding, a small MLP, and the head spelled one way each ----------------------


class LM(nn.Module):
    """Embedding -> Linear+tanh -> head. ``head`` picks how the vocabulary projection is written."""

    def __init__(self, head="linear", bias=False, tied=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.mlp = nn.Sequential(nn.Linear(D, D), nn.Tanh())
        self.head_kind = head
        self.head = nn.Linear(D, VOCAB, bias=bias)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.mlp(self.embed(ids))
        w = self.head.weight
        if self.head_kind == "linear":
            return self.head(h)
        if self.head_kind == "matmul":
            return h @ w.T
        if self.head_kind == "F.linear":
            return F.linear(h, w)
        if self.head_kind == "einsum":
            return torch.einsum("bsd,vd->bsv", h, w)
        raise ValueError(self.head_kind)


def model(**kw):
    return lambda: LM(**kw)


# --- losses ------------------------------------------------------------------------------------


def ce_flat_mean(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def ce_flat_sum(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")


def ce_ignore_last(logits, targets):
    targets = targets.clone()
    targets[:, -1] = -100  # padding at the end of every row
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def ce_class_dim_1(logits, targets):
    return F.cross_entropy(logits.transpose(1, 2), targets)


def ce_shifted(logits, targets):
    shift_logits = logits[:, :-1, :].contiguous()
    shift_labels = targets[:, 1:].contiguous()
    return F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


def log_softmax_gather(logits, targets):
    logp = F.log_softmax(logits, dim=-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).mean()


def log_softmax_nll(logits, targets):
    logp = torch.log_softmax(logits.view(-1, VOCAB), dim=1)
    return F.nll_loss(logp, targets.view(-1))


def log_softmax_then_flat_nll(logits, targets):
    return F.nll_loss(F.log_softmax(logits, dim=-1).view(-1, VOCAB), targets.view(-1))


def log_softmax_then_flat_gather(logits, targets):
    logp = logits.float().log_softmax(-1).view(-1, logits.shape[-1])
    return -logp.gather(1, targets.view(-1, 1)).mean()


def log_softmax_index(logits, targets):
    logp = logits.reshape(-1, VOCAB).log_softmax(-1)
    y = targets.reshape(-1)
    return -logp[torch.arange(y.numel()), y].mean()


def neg_log_softmax_pick(logits, targets):
    nll = -F.log_softmax(logits, dim=-1)
    return nll.gather(2, targets[..., None]).sum() / targets.numel()


def logsumexp_minus_picked(logits, targets):
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (torch.logsumexp(logits, dim=-1) - picked).mean()


def one_hot_times_logp(logits, targets):
    logp = F.log_softmax(logits, dim=-1)
    return -(F.one_hot(targets, VOCAB) * logp).sum(-1).mean()


def hand_log_softmax(logits, targets):
    x = logits.view(-1, VOCAB)
    x = x - x.max(dim=-1, keepdim=True).values
    logp = x - x.exp().sum(-1, keepdim=True).log()
    return -logp[torch.arange(x.shape[0]), targets.view(-1)].sum()


def masked_mean(logits, targets):
    mask = (targets != 3).float()  # token 3 is padding
    per_token = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return (per_token * mask).sum() / mask.sum()


def masked_flat_mean_all(logits, targets):
    mask = torch.ones_like(targets, dtype=torch.float32)
    mask[:, :2] = 0  # no loss on the prompt
    losses = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), reduction="none")
    return (losses * mask.view(-1)).mean()


# must be left alone


def log_softmax_flat_positions(logits, targets):
    """Cross-entropy, but picked from rows of all positions' vocabularies (a view that merges them):
    the op takes whole vocabulary rows."""
    logp = F.log_softmax(logits, dim=-1).view(logits.shape[0], -1)
    return -logp.gather(1, targets + torch.arange(targets.shape[1]) * VOCAB).mean()


def label_smoothing(logits, targets):
    return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), label_smoothing=0.1)


def focal_loss(logits, targets, gamma=2.0):
    logp = F.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (-(1 - logp.exp()) ** gamma * logp).mean()


def z_loss(logits, targets):
    ce = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
    return ce + 1e-4 * torch.logsumexp(logits, dim=-1).pow(2).mean()


def weighted_tokens(logits, targets):
    weight = torch.linspace(0.5, 1.5, targets.shape[-1])  # a float weight per position, not a 0/1 mask
    per_token = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return (per_token * weight).mean()


# --- cases ---------------------------------------------------------------------------------


CASES = {
    # the head, loss fixed to the plain flattened mean
    "linear": (model(), ce_flat_mean, REPLACED),
    "linear_bias": (model(bias=True), ce_flat_mean, REPLACED),
    "matmul_T": (model(head="matmul"), ce_flat_mean, REPLACED),
    "F_linear": (model(head="F.linear"), ce_flat_mean, REPLACED),
    "einsum": (model(head="einsum"), ce_flat_mean, REPLACED),
    "tied": (model(tied=True), ce_flat_mean, REPLACED),
    # the loss, head fixed to nn.Linear
    "ce_sum": (model(), ce_flat_sum, REPLACED),
    "ce_ignore_index": (model(), ce_ignore_last, REPLACED),
    "ce_class_dim_1": (model(), ce_class_dim_1, REPLACED),
    "ce_shifted": (model(), ce_shifted, REPLACED),
    "log_softmax_gather": (model(), log_softmax_gather, REPLACED),
    "log_softmax_nll": (model(), log_softmax_nll, REPLACED),
    "log_softmax_index": (model(), log_softmax_index, REPLACED),
    "log_softmax_then_flat_nll": (model(), log_softmax_then_flat_nll, REPLACED),
    "log_softmax_then_flat_gather": (model(), log_softmax_then_flat_gather, REPLACED),
    "neg_log_softmax_pick": (model(), neg_log_softmax_pick, REPLACED),
    "logsumexp_minus_picked": (model(), logsumexp_minus_picked, REPLACED),
    "one_hot": (model(), one_hot_times_logp, REPLACED),
    "hand_log_softmax": (model(), hand_log_softmax, REPLACED),
    "masked_mean": (model(), masked_mean, REPLACED),
    "masked_mean_all": (model(), masked_flat_mean_all, REPLACED),
}
LEFT = {
    "label_smoothing": label_smoothing,
    "focal_loss": focal_loss,
    "z_loss": z_loss,
    "weighted_tokens": weighted_tokens,
    "log_softmax_flat_positions": log_softmax_flat_positions,
}


@pytest.mark.parametrize("name", CASES)
def test_replaced(name):
    make_model, loss_fn, expect = CASES[name]
    run_case(make_model, loss_fn, expect=expect, notes=["cross_entropy"] if expect == LEFT_ALONE else [])


@pytest.mark.parametrize("name", LEFT)
def test_left_alone(name):
    run_case(model(), LEFT[name], expect=LEFT_ALONE, notes=["cross_entropy"])


def test_symbolic_sequence_length():
    """A second sequence length recompiles with a symbolic seq; the pass still fires and matches eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    ours, theirs = LM(), LM()
    theirs.load_state_dict(ours.state_dict())
    opt, eager_opt = adamw(ours.parameters()), adamw(theirs.parameters())

    compiled = compile_stack.compile_step(make_train_step(ours, ce_shifted, opt), codegen=False)
    eager = make_train_step(theirs, ce_shifted, eager_opt)
    counts = []
    for seq in (SEQ, SEQ + 5, SEQ + 9):
        registry.current().clear()
        (inputs, targets), = batches(1, seq=seq)
        torch.testing.assert_close(compiled(inputs, targets), eager(inputs, targets), rtol=1e-4, atol=1e-5)
        counts.append(int(registry.current().replacements.get("cross_entropy", 0)))
    assert counts[:2] == [1, 1], (counts, registry.current().notes)  # the third call reuses the symbolic graph
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head, loss_fn", [("matmul", ce_flat_mean), ("linear", masked_mean)])
def test_bf16_count(head, loss_fn):
    torch._dynamo.reset()
    registry.current().clear()
    m = LM(head=head).to(torch.bfloat16)
    step = make_train_step(m, loss_fn, adamw(m.parameters()))
    (inputs, targets), = batches(1)
    compile_stack.compile_step(step, codegen=False)(inputs, targets)
    assert registry.current().replacements.get("cross_entropy", 0) == 1, registry.current().notes


def test_logits_kept_past_backward_are_left_alone_and_said_so():
    """A step that keeps the logits past ``backward()`` (here for a token accuracy after the update)
    needs them as the graph's output: the fused loss, which never forms them, is not used, and the
    note says why; the step still equals eager."""
    def train_step_with_accuracy(model, optimizer):
        def train_step(inputs, targets):
            optimizer.zero_grad(set_to_none=True)
            logits = model(inputs)
            loss = ce_flat_mean(logits, targets)
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                accuracy = (logits.argmax(-1) == targets).float().mean()
            return loss, accuracy
        return train_step

    torch._dynamo.reset()
    registry.current().clear()
    torch.manual_seed(0)
    ours, theirs = LM(), LM()
    theirs.load_state_dict(ours.state_dict())
    compiled = compile_stack.compile_step(train_step_with_accuracy(ours, adamw(ours.parameters())), codegen=False)
    eager = train_step_with_accuracy(theirs, adamw(theirs.parameters()))
    for inputs, targets in batches(2):
        for got, expected in zip(compiled(inputs, targets), eager(inputs, targets)):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert registry.current().replacements["cross_entropy"] == 0
    assert any("the logits leave the graph too" in n for n in registry.current().notes), registry.current().notes
