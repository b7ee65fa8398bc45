"""Mistakes a user makes in the code handed to run_step.py (tests/test_cli_errors.py): each is
refused in one line before anything is compiled."""
import torch
import torch.nn.functional as F

from tests.user_models import build_gpt, token_loss  # noqa: F401  (the right ones, beside the wrong)

NOT_CALLABLE = 42


def build_from_config(cfg):
    """A factory of its own signature, not --model's keywords."""
    raise AssertionError("never called")


def build_not_a_module(vocab_size, context_length, d_model, num_layers, num_heads, d_ff):
    return [torch.nn.Linear(d_model, vocab_size)]


def build_hidden_states(vocab_size, context_length, d_model, num_layers, num_heads, d_ff):
    """Returns hidden states [B, S, d_model], not logits: the head was forgotten."""
    return torch.nn.Embedding(vocab_size, d_model)


def build_failing_forward(vocab_size, context_length, d_model, num_layers, num_heads, d_ff):
    return torch.nn.Linear(d_model, vocab_size)  # applied to integer token ids


def loss_with_mask(logits, targets, mask):
    raise AssertionError("never called")


def loss_unflattened(logits, targets):
    """cross_entropy on [B, S, V] takes dim 1 as the classes: fails on the step's shapes."""
    return F.cross_entropy(logits, targets)


def loss_per_logit(logits, targets):
    """The log-probabilities of every class, not the targets': one value per logit."""
    return -torch.log_softmax(logits.float(), dim=-1)


def loss_as_float(logits, targets):
    return float(token_loss(logits, targets))


class OptimizerWithoutParams(torch.optim.Optimizer):
    def __init__(self, *, lr=1e-3):
        raise AssertionError("never called")


class NotAnOptimizer:
    def __init__(self, params):
        self.params = list(params)


class FailingOptimizer(torch.optim.SGD):
    def __init__(self, params):
        super().__init__(params, lr=-1.0)
