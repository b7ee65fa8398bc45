"""The cross_entropy joint pass: LM head + cross-entropy → cstack::linear_cross_entropy_fwd.

Each idiom is compiled with PassBackend(codegen=False) (our passes, eager aten graphs):
one replacement, our op in the forward graph, no tensor as large as the [T, V] logits
in either partitioned graph, and the same loss and gradients as eager. Variants that
are not plain cross-entropy stay as written, with a note.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import passes.cross_entropy  # noqa: F401  (registers the pass)
from compile_stack.backend import PassBackend
from compile_stack.workloads.config import PRESETS
from compile_stack.workloads.reference import build_model, cross_entropy
from passes.registry import current, register_pass
from tests.helpers import HAS_CUDA, rel_err

FWD_OP = torch.ops.cstack.linear_cross_entropy_fwd.default
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # relative error of loss and gradients vs eager

_partitioned = []  # per compiled graph: list of (target, val) of its nodes


@register_pass("_test_record_partitions", stage="post_grad")
def _record_partitions(graph: torch.fx.Graph) -> int:
    """Keep what each partitioned (forward / backward) graph computes."""
    _partitioned.append([(n.target, n.meta.get("val")) for n in graph.nodes])
    return 0


class TinyLM(nn.Module):
    """Embedding, one bias-free linear, an LM head spelled one of several ways."""

    def __init__(self, vocab: int, d: int, head: str):
        super().__init__()
        self.embedding = nn.Parameter(torch.randn(vocab, d))
        self.proj = nn.Linear(d, d, bias=False)
        self.lm_head = nn.Parameter(torch.randn(vocab, d) / d**0.5)
        self.head = head

    def forward(self, ids):
        x = self.proj(self.embedding[ids])  # [B, S, d]
        if self.head == "matmul":
            return x @ self.lm_head.T
        if self.head == "linear":
            return F.linear(x, self.lm_head)
        if self.head == "einsum":
            return torch.einsum("bsd,vd->bsv", x, self.lm_head)
        if self.head == "flat":  # hidden reshaped to [T, d] before the projection
            return x.reshape(-1, x.shape[-1]) @ self.lm_head.T
        raise ValueError(f"head: unknown {self.head!r}")


def _flat(logits, targets):
    return logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)


def hand_amax_sum(logits, targets):
    logits, targets = _flat(logits, targets)
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    log_probs = shifted - torch.log(torch.exp(shifted).sum(dim=-1, keepdim=True))
    return -log_probs.gather(1, targets.unsqueeze(1)).sum()


def hand_logsumexp_mean(logits, targets):
    logits, targets = _flat(logits, targets)
    log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return -log_probs.gather(1, targets.unsqueeze(1)).mean()


def library_mean(logits, targets):
    return F.cross_entropy(*_flat(logits, targets))


def library_sum_ignore(logits, targets):
    return F.cross_entropy(*_flat(logits, targets), ignore_index=7, reduction="sum")


def log_softmax_nll_scaled(logits, targets):
    logits, targets = _flat(logits, targets)
    return 3.7 * F.nll_loss(F.log_softmax(logits.float(), dim=-1), targets)


def reference_loss(logits, targets):
    return cross_entropy(logits, targets).sum()


def label_smoothing(logits, targets):
    return F.cross_entropy(*_flat(logits, targets), label_smoothing=0.1)


def extra_logits_term(logits, targets):
    return F.cross_entropy(*_flat(logits, targets)) + 1e-3 * logits.float().pow(2).mean()


def _inputs(vocab, batch, seq):
    ids = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))
    targets[0, :5] = 7  # ignored by library_sum_ignore, plain class elsewhere
    targets[0, 5], targets[1, 0] = 0, vocab - 1
    return ids, targets


def _run(model, loss_fn, ids, targets, backend=None):
    """Loss and parameter gradients, eager or compiled with ``backend``."""
    model.zero_grad(set_to_none=True)
    fn = lambda i, t: loss_fn(model(i), t)  # noqa: E731
    if backend is not None:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend=backend, fullgraph=True)
    loss = fn(ids, targets)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _compile_and_compare(model, loss_fn, ids, targets, dtype, passes=("cross_entropy",)):
    eager_loss, eager_grads = _run(model, loss_fn, ids, targets)
    current().clear()
    _partitioned.clear()
    backend = PassBackend(passes=[*passes, "_test_record_partitions"], codegen=False)
    loss, grads = _run(model, loss_fn, ids, targets, backend)
    assert rel_err(loss, eager_loss) < TOL[dtype]
    for name, g, e in zip([n for n, _ in model.named_parameters()], grads, eager_grads):
        assert rel_err(g, e) < TOL[dtype], name
    return _partitioned


def _largest_tensor(graphs) -> int:
    return max(v.numel() for graph in graphs for _, v in graph if isinstance(v, torch.Tensor))


def _has_fwd_op(graph) -> bool:
    return any(target is FWD_OP for target, _ in graph)


@pytest.mark.parametrize(
    "head, loss_fn, dtype",
    [
        ("matmul", reference_loss, torch.float32),
        ("matmul", reference_loss, torch.bfloat16),
        ("linear", library_mean, torch.float32),
        ("einsum", library_sum_ignore, torch.bfloat16),
        ("flat", library_sum_ignore, torch.float32),
        ("linear", hand_amax_sum, torch.bfloat16),
        ("flat", hand_logsumexp_mean, torch.float32),
        ("einsum", hand_logsumexp_mean, torch.bfloat16),
        ("matmul", log_softmax_nll_scaled, torch.bfloat16),
    ],
    ids=lambda p: getattr(p, "__name__", str(p)),
)
def test_idiom_replaced(head, loss_fn, dtype):
    vocab, d, batch, seq = 389, 24, 3, 29  # T = 87, V = 389: no power of two
    model = TinyLM(vocab, d, head).to(dtype)
    ids, targets = _inputs(vocab, batch, seq)
    graphs = _compile_and_compare(model, loss_fn, ids, targets, dtype)
    assert current().replacements["cross_entropy"] == 1
    assert len(graphs) == 2 and _has_fwd_op(graphs[0]) and not _has_fwd_op(graphs[1])
    # Nothing in forward or backward is as large as the logits; the biggest is a [V, d] weight (gradient).
    assert _largest_tensor(graphs) == vocab * d


@pytest.mark.parametrize("loss_fn", [label_smoothing, extra_logits_term], ids=lambda f: f.__name__)
def test_non_matching_left_alone_with_note(loss_fn):
    vocab, d = 311, 16
    model = TinyLM(vocab, d, "matmul")
    ids, targets = _inputs(vocab, 2, 24)
    graphs = _compile_and_compare(model, loss_fn, ids, targets, torch.float32)
    assert current().replacements["cross_entropy"] == 0
    assert not any(_has_fwd_op(g) for g in graphs)
    assert _largest_tensor(graphs) >= 2 * 24 * vocab
    assert any(n.startswith("cross_entropy: left") for n in current().notes), current().notes


def test_a_loss_over_logits_from_another_graph_is_left_alone_with_a_note():
    """The loss compiled apart from the LM head (the logits an input of its graph, as when FSDP2's hooks
    break the graph at the model's call): nothing to fuse with, and the report says why."""
    logits = torch.randn(2, 24, 97, requires_grad=True)
    targets = torch.randint(0, 97, (2, 24))
    current().clear()
    torch._dynamo.reset()
    loss = torch.compile(library_mean, backend=PassBackend(passes=["cross_entropy"], codegen=False),
                         fullgraph=True)(logits, targets)
    loss.backward()
    expected = logits.detach().clone().requires_grad_()
    library_mean(expected, targets).backward()
    torch.testing.assert_close(logits.grad, expected.grad)
    assert current().replacements["cross_entropy"] == 0
    assert any(n.startswith("cross_entropy: left the cross-entropy over") and "another graph" in n
               for n in current().notes), current().notes


class BiasedLM(nn.Module):
    """A user's model: an embedding, then ``nn.Linear(d, V, bias=True)`` as the LM head (addmm in the
    joint graph), or its parameters spelled ``x @ W.T + b`` (mm, then an add of the bias)."""

    def __init__(self, vocab: int, d: int, head: str):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.lm_head = nn.Linear(d, vocab, bias=True)
        self.head = head

    def forward(self, ids):
        x = self.embedding(ids)
        return self.lm_head(x) if self.head == "linear" else x @ self.lm_head.weight.T + self.lm_head.bias


@pytest.mark.parametrize(
    "head, loss_fn, dtype",
    [("linear", library_mean, torch.float32), ("add", library_sum_ignore, torch.float32),
     ("linear", hand_logsumexp_mean, torch.bfloat16)],
    ids=lambda p: getattr(p, "__name__", str(p)),
)
def test_head_with_bias_replaced(head, loss_fn, dtype):
    """The bias goes into the op, and its gradient (a sum of the logits gradient over rows) comes from it."""
    vocab, d = 53, 8
    model = BiasedLM(vocab, d, head).to(dtype)
    ids, targets = _inputs(vocab, 2, 9)
    graphs = _compile_and_compare(model, loss_fn, ids, targets, dtype)
    assert current().replacements["cross_entropy"] == 1
    assert _has_fwd_op(graphs[0]) and _largest_tensor(graphs) == vocab * d


def test_bias_used_elsewhere_too_keeps_its_other_gradient():
    """A penalty on the bias as well: its gradient is the op's plus the penalty's, as in eager."""
    vocab, d = 53, 8
    model = BiasedLM(vocab, d, "linear")
    ids, targets = _inputs(vocab, 2, 9)
    loss_fn = lambda logits, t: library_mean(logits, t) + 0.1 * model.lm_head.bias.pow(2).sum()  # noqa: E731
    _compile_and_compare(model, loss_fn, ids, targets, torch.float32)
    assert current().replacements["cross_entropy"] == 1


def test_head_with_bias_and_logits_used_elsewhere_left_alone_with_note():
    vocab, d = 53, 8
    model = BiasedLM(vocab, d, "add")
    ids, targets = _inputs(vocab, 2, 9)
    graphs = _compile_and_compare(model, extra_logits_term, ids, targets, torch.float32)
    assert current().replacements["cross_entropy"] == 0 and not any(_has_fwd_op(g) for g in graphs)
    assert any(n.startswith("cross_entropy: left") for n in current().notes), current().notes


def test_frozen_hidden_only_weight_gradient():
    """The head's input needs no gradient: only d(weight) is rewired, logits still vanish."""
    vocab, d = 257, 16
    hidden = torch.randn(2, 20, d)
    weight = nn.Parameter(torch.randn(vocab, d) / 4)
    targets = torch.randint(0, vocab, (2, 20))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = weight

        def forward(self, ids):
            return hidden @ self.weight.T

    graphs = _compile_and_compare(Head(), reference_loss, None, targets, torch.float32)
    assert current().replacements["cross_entropy"] == 1
    assert _largest_tensor(graphs) < 2 * 20 * vocab


def test_reference_model_tiny():
    """The reference model (bf16, naive attention, hand-written loss): exactly the head is rewritten."""
    cfg = PRESETS["tiny"]
    model = build_model(cfg, "cpu")
    ids, targets = (torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq)) for _ in range(2))
    graphs = _compile_and_compare(model, reference_loss, ids, targets, torch.bfloat16)
    assert current().replacements["cross_entropy"] == 1
    assert not [n for n in current().notes if n.startswith("cross_entropy")]  # attention's softmax is no LM head
    shapes = {tuple(v.shape) for graph in graphs for _, v in graph if isinstance(v, torch.Tensor)}
    T, V = cfg.tokens, cfg.vocab
    assert not {s for s in shapes if T * V <= torch.Size(s).numel()}


def test_graph_without_softmax_is_untouched():
    graph = torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1).graph
    before = str(graph)
    assert passes.cross_entropy.fuse_linear_cross_entropy(graph) == 0
    assert str(graph) == before


def test_real_inductor():
    """The one real Inductor compile: the op survives lowering and the numbers hold."""
    vocab, d = 97, 8
    model = TinyLM(vocab, d, "matmul")
    ids, targets = _inputs(vocab, 2, 9)
    eager_loss, eager_grads = _run(model, reference_loss, ids, targets)
    current().clear()
    backend = PassBackend(passes=["cross_entropy"], codegen=True)
    with backend.active():
        loss, grads = _run(model, reference_loss, ids, targets, backend)
    assert current().replacements["cross_entropy"] == 1
    assert rel_err(loss, eager_loss) < 1e-5
    for g, e in zip(grads, eager_grads):
        assert rel_err(g, e) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_bf16_memory_and_accuracy():
    """bf16 on the GPU through real Inductor: matches an fp32 eager run, and no logits-sized peak."""
    from custom_ops.linear_cross_entropy import chunk_tokens

    vocab, d, batch, seq = 32768, 512, 4, 2048  # T = 8192: bf16 logits 512 MiB
    model32 = TinyLM(vocab, d, "linear").cuda()
    model = TinyLM(vocab, d, "linear").cuda().to(torch.bfloat16)
    model.load_state_dict(model32.state_dict())
    ids, targets = (torch.randint(0, vocab, (batch, seq), device="cuda") for _ in range(2))
    ref_loss, ref_grads = _run(model32, reference_loss, ids, targets)

    current().clear()
    backend = PassBackend(passes=["cross_entropy"], codegen=True)
    step = torch.compile(lambda i, t: reference_loss(model(i), t), backend=backend, fullgraph=True)
    with backend.active(), chunk_tokens(1024):
        for _ in range(2):  # the first call compiles; the second is measured
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            loss = step(ids, targets)
            loss.backward()
            torch.cuda.synchronize()
    assert current().replacements["cross_entropy"] == 1
    logits_bytes = batch * seq * vocab * 2
    assert torch.cuda.max_memory_allocated() - base < logits_bytes / 2
    assert rel_err(loss, ref_loss) < 1e-2
    for p, e in zip(model.parameters(), ref_grads):
        assert rel_err(p.grad, e) < 3e-2


def library_mean_ignore(logits, targets):
    return F.cross_entropy(*_flat(logits, targets), ignore_index=7)


def where_masked_mean(logits, targets):
    logits, targets = _flat(logits, targets)
    keep = targets != 7
    rows = -(logits.log_softmax(-1).gather(1, torch.where(keep, targets, 0).unsqueeze(1)).squeeze(1))
    return torch.where(keep, rows, 0.0).sum() / keep.sum()


def multiply_masked_mean(logits, targets):
    logits, targets = _flat(logits, targets)
    keep = (targets != 7).float()
    rows = -(logits.log_softmax(-1).gather(1, targets.unsqueeze(1)).squeeze(1))
    return (rows * keep).sum() / keep.sum()


@pytest.mark.parametrize("loss_fn", [library_mean_ignore, where_masked_mean, multiply_masked_mean],
                         ids=lambda f: f.__name__)
def test_every_target_ignored_matches_eager_nan_for_nan(loss_fn):
    """A batch with no kept target: the mean is 0/0 = NaN, and d loss/d sum = 1/0. Eager's gradients
    are then 0 where the rows are masked by where (F.cross_entropy's ignore_index too) and NaN where
    masked by a multiply (0·inf); the fused op's must be the same, not NaN everywhere."""
    vocab, d = 37, 8
    model = TinyLM(vocab, d, "matmul")
    ids, targets = _inputs(vocab, 2, 6)
    targets.fill_(7)
    eager_loss, eager_grads = _run(model, loss_fn, ids, targets)
    current().clear()
    loss, grads = _run(model, loss_fn, ids, targets, PassBackend(passes=["cross_entropy"], codegen=False))
    assert current().replacements["cross_entropy"] == 1
    assert eager_loss.isnan() and loss.isnan()
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, equal_nan=True)
