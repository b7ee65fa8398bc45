"""User-written Muon optimizers through ``compile_step``: each compiles, equals eager, and every hidden
matrix's Newton–Schulz iterations become one ``newton_schulz`` call (``passes/newton_schulz``).

Counts as in ``test_corpus_optimizer``: over every optimizer graph compiled; state a hand-written
optimizer creates lazily on the first step means two graphs (the first step's and the rest's), each
rewritten. lr is small (3e-4, 1e-3) so that the bf16 iterations' rounding (the op's and eager's
differ by a few percent of an update) stays inside the corpus's fp32 tolerances.
"""
import pytest
import torch
from torch import nn

from tests.user_corpus import VOCAB, run_case

pytestmark = pytest.mark.filterwarnings("ignore")


def matrices_only():
    """Every parameter 2-D, as torch.optim.Muon requires: 3 matrices."""
    return nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, 48, bias=False), nn.ReLU(),
                         nn.Linear(48, VOCAB, bias=False))


def test_torch_optim_muon():
    # torch's own: `.T`, in-place normalisation, torch.addmm(A, A, A, beta=b, alpha=c), addmm(X, B, X, beta=a).
    # Dynamo makes torch.optim's state before tracing the step: one graph.
    run_case(matrices_only, make_optimizer=lambda ps: torch.optim.Muon(ps, lr=1e-3, weight_decay=0.1),
             expect={"newton_schulz": 3})


def orthogonalise(G, steps=5, eps=1e-7):
    """A user's quintic Newton–Schulz, batched-ready: ``transpose(-2, -1)``, ``torch.matmul``,
    normalised per matrix by a vector norm over its flattened entries."""
    coefficients = (3.4445, -4.7750, 2.0315)
    tall = G.size(-2) > G.size(-1)
    X = (G.transpose(-2, -1) if tall else G).to(torch.bfloat16)
    X = X / (torch.linalg.vector_norm(X.flatten(-2), dim=-1)[..., None, None] + eps)
    for _ in range(steps):
        gram = torch.matmul(X, X.transpose(-2, -1))
        poly = coefficients[1] * gram + coefficients[2] * torch.matmul(gram, gram)
        X = coefficients[0] * X + torch.matmul(poly, X)
    return X.transpose(-2, -1) if tall else X


class LerpMuon(torch.optim.Optimizer):
    """An Optimizer subclass with lazily created momentum, lerp'd, nesterov by a second lerp, and the
    update scaled by √max(1, rows/cols)."""

    def __init__(self, params, lr=3e-4, momentum=0.95, weight_decay=0.1):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = orthogonalise(p.grad.lerp(buf, group["momentum"]))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"] * max(1, p.size(-2) / p.size(-1)) ** 0.5)


class StackedMuon:
    """Not a torch Optimizer: momentum made up front, and matrices of one shape orthogonalised as a
    batch (one 3-D chain per shape)."""

    def __init__(self, params, lr=3e-4, momentum=0.9):
        self.params = [p for p in params if p.dim() == 2]
        self.lr, self.momentum = lr, momentum
        self.bufs = [torch.zeros_like(p) for p in self.params]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        for p, buf in zip(self.params, self.bufs):
            buf.mul_(self.momentum).add_(p.grad)
        shapes = {}
        for i, p in enumerate(self.params):
            shapes.setdefault(tuple(p.shape), []).append(i)
        for indices in shapes.values():
            updates = orthogonalise(torch.stack([self.bufs[i] for i in indices]))
            for i, update in zip(indices, updates):
                self.params[i].sub_(self.lr * update)


def test_lerp_muon_optimizer_subclass():
    run_case(matrices_only, make_optimizer=LerpMuon, expect={"newton_schulz": 6})


def square_pair():
    """Two 32×32 matrices, and the embedding and head, both 37×32: two batched chains."""
    return nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, 32, bias=False), nn.ReLU(),
                         nn.Linear(32, 32, bias=False), nn.Linear(32, VOCAB, bias=False))


def test_stacked_muon_batches_equal_shapes():
    run_case(square_pair, make_optimizer=StackedMuon, expect={"newton_schulz": 2})
