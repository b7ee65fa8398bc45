"""The attention pass: idioms rewritten into cstack.flash_attention (fwd + bwd), the rest left alone.

Each case compiles a small model with PassBackend(codegen=False) and checks: our op in the
partitioned graphs, no S×S tensor left in them, one replacement per layer, and loss and grads equal
to eager. S=40 is chosen so that no other tensor of these models has trailing dims 40×40.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import custom_ops.attention
import passes.attention  # noqa: F401  (registers the pass)
from compile_stack.backend import PassBackend
from compile_stack.workloads.config import PRESETS
from compile_stack.workloads.reference import build_model, causal_attention, cross_entropy
from passes.registry import current, register_pass
from tests.helpers import HAS_CUDA, eager_and_compiled, rel_err

S, HEADS, HEAD_DIM = 40, 2, 16
GRAPHS: list[torch.fx.Graph] = []


@register_pass("attention_test_probe", stage="post_grad")
def _probe(graph: torch.fx.Graph) -> int:
    """Records each partitioned graph (forward, backward or inference) after the joint pass."""
    GRAPHS.append(graph)
    return 0


def _tril(s):
    return torch.tril(torch.ones(s, s, dtype=torch.bool))


# ---- idioms that must be rewritten: q, k, v are [B, H, S, D]


def hand_fp32_upcast(q, k, v):
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    s = torch.where(_tril(q.shape[-2]), s, float("-inf")).float()
    w = torch.exp(s - s.amax(dim=-1, keepdim=True))
    return (w / w.sum(-1, keepdim=True)).to(q.dtype) @ v


def masked_fill_softmax_fp32(q, k, v):
    s = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def einsum_triu_bias(q, k, v):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = s + torch.triu(torch.full((q.shape[-2], q.shape[-2]), float("-inf"), dtype=q.dtype), 1)
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v)


def scaled_q_arange_mask(q, k, v):
    pos = torch.arange(q.shape[-2])
    s = (q / math.sqrt(q.shape[-1])) @ k.transpose(-2, -1)
    s = torch.where(pos[None, :] <= pos[:, None], s, torch.finfo(s.dtype).min)
    return F.softmax(s, dim=-1) @ v


def no_mask(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1) @ v


def flat_heads(q, k, v):
    """[N, S, D] tensors (heads folded into the batch)."""
    b, h, s, d = q.shape
    q, k, v = (t.reshape(b * h, s, d) for t in (q, k, v))
    out = causal_attention(q, k, v)
    return out.view(b, h, s, d)


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_no_mask_scaled(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, scale=0.2)


def tensor_scale_no_max_softmax(q, k, v):
    """A constant tensor scale, a -1e9 additive mask from a float tril, softmax without the max."""
    s = q @ k.mT / torch.sqrt(torch.tensor(q.shape[-1], dtype=torch.float32))
    s = s + (1.0 - torch.tril(torch.ones(q.shape[-2], q.shape[-2]))) * -1e9
    e = s.exp()
    return (e / e.sum(-1, keepdim=True)).to(v.dtype) @ v


def einsum_heads_last(q, k, v):
    """[B, S, H, D] einsums: the weights reach the bmm through permutes that cancel out."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    pos = torch.arange(q.shape[1])
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = torch.where(pos.view(1, -1) > pos.view(-1, 1), torch.tensor(float("-inf")), s)
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).transpose(1, 2)


def baddbmm_mask(q, k, v):
    """nn.MultiheadAttention's weights path: baddbmm(mask, q·scale, kᵀ)."""
    b, h, s, d = q.shape
    mask = torch.triu(torch.full((s, s), float("-inf"), dtype=q.dtype), diagonal=1)
    q, k, v = (t.reshape(b * h, s, d) for t in (q, k, v))
    w = torch.baddbmm(mask.unsqueeze(0), q * d ** -0.5, k.transpose(-2, -1)).softmax(-1)
    return torch.bmm(w, v).view(b, h, s, d)


def sdpa_bool_mask(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_tril(q.shape[-2]))


def sdpa_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k[:, :1], v[:, :1], is_causal=True, enable_gqa=True)


# ---- idioms that must be left alone


def dropout_after_softmax(q, k, v):
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    s = torch.where(_tril(q.shape[-2]), s, float("-inf"))
    return F.dropout(torch.softmax(s, -1), p=0.3, training=True) @ v


def triu_mask(q, k, v):
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).triu(), float("-inf"))
    return torch.softmax(s, -1) @ v


def sliding_window_mask(q, k, v):
    pos = torch.arange(q.shape[-2])
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    s = s.masked_fill((pos[None, :] > pos[:, None]) | (pos[None, :] < pos[:, None] - 8), float("-inf"))
    return torch.softmax(s, -1) @ v


def off_by_one_mask(q, k, v):
    """Keeps key <= query + 1: each query also sees the next key."""
    pos = torch.arange(q.shape[-2])
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    s = torch.where(pos[None, :] <= pos[:, None] + 1, s, float("-inf"))
    return torch.softmax(s, -1) @ v


class Model(nn.Module):
    """`layers` blocks of: q/k/v projections, `attn`, residual; input [B, S, H*D]."""

    def __init__(self, attn, layers=2, mask_input=False):
        super().__init__()
        d = HEADS * HEAD_DIM
        self.attn, self.mask_input = attn, mask_input
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d, bias=False) for _ in range(layers))

    def forward(self, x, mask=None):
        b, s, d = x.shape
        for proj in self.qkv:
            q, k, v = proj(x).view(b, s, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
            out = self.attn(q, k, v, mask) if self.mask_input else self.attn(q, k, v)
            x = x + out.transpose(1, 2).reshape(b, s, d)
        return x


def mask_tensor_input(q, k, v, mask):
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return torch.softmax(torch.where(mask, s, float("-inf")), -1) @ v


def _run(model, x, *extra, codegen=False, grad=True):
    """(loss, grads) eager and compiled; the compiled run's graphs land in GRAPHS."""
    def step(m):
        with torch.set_grad_enabled(grad):
            loss = m(x, *extra).float().square().mean()
        if not grad:
            return loss, []
        grads = torch.autograd.grad(loss, [p for p in m.parameters()])
        return loss.detach(), grads

    GRAPHS.clear()
    return eager_and_compiled(model, step, ["attention", "attention_test_probe"], codegen)


def _ops(graphs):
    return {n.target for g in graphs for n in g.nodes if n.op == "call_function"}


def _square_tensors(graphs, s=S):
    found = []
    for g in graphs:
        for n in g.nodes:
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dim() >= 2 and tuple(val.shape[-2:]) == (s, s):
                found.append(f"{n.name}{tuple(val.shape)}")
    return found


def _close(eager, compiled, tol):
    assert rel_err(compiled[0], eager[0]) <= tol
    for ge, gc in zip(eager[1], compiled[1], strict=True):
        assert rel_err(gc, ge) <= tol


def _input(dtype, b=2):
    return torch.randn(b, S, HEADS * HEAD_DIM, dtype=dtype)


@pytest.mark.parametrize(
    "attn, dtype",
    [
        (causal_attention, torch.float32),
        (causal_attention, torch.bfloat16),
        (hand_fp32_upcast, torch.bfloat16),
        (masked_fill_softmax_fp32, torch.bfloat16),
        (masked_fill_softmax_fp32, torch.float32),
        (einsum_triu_bias, torch.float32),
        (scaled_q_arange_mask, torch.float32),
        (no_mask, torch.float32),
        (flat_heads, torch.float32),
        (sdpa_causal, torch.float32),
        (sdpa_causal, torch.bfloat16),
        (sdpa_no_mask_scaled, torch.float32),
        (tensor_scale_no_max_softmax, torch.float32),
        (tensor_scale_no_max_softmax, torch.bfloat16),
        (einsum_heads_last, torch.float32),
        (baddbmm_mask, torch.float32),
        (sdpa_bool_mask, torch.float32),
        (sdpa_gqa, torch.float32),
    ],
    ids=lambda p: getattr(p, "__name__", str(p).replace("torch.", "")),
)
def test_rewritten_training(attn, dtype):
    model = Model(attn).to(dtype)
    eager, compiled = _run(model, _input(dtype))
    assert current().replacements["attention"] == 2
    assert len(GRAPHS) == 2  # forward and backward
    fwd_ops, bwd_ops = _ops(GRAPHS[:1]), _ops(GRAPHS[1:])
    assert torch.ops.cstack.flash_attention_fwd.default in fwd_ops
    assert torch.ops.cstack.flash_attention_bwd.default in bwd_ops
    assert torch.ops.aten.bmm.default not in fwd_ops | bwd_ops
    assert _square_tensors(GRAPHS) == []
    _close(eager, compiled, 1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("attn", [causal_attention, einsum_triu_bias, sdpa_causal], ids=lambda f: f.__name__)
def test_rewritten_inference(attn):
    model = Model(attn)
    eager, compiled = _run(model, _input(torch.float32), grad=False)
    assert current().replacements["attention"] == 2
    assert torch.ops.cstack.flash_attention_fwd.default in _ops(GRAPHS)
    assert _square_tensors(GRAPHS) == []
    _close(eager, compiled, 1e-4)


def test_only_q_needs_grad():
    """k and v frozen (computed from a detached input): dq still comes from our backward op."""
    def attn(q, k, v):
        return causal_attention(q, k.detach(), v.detach())

    model = Model(attn)
    eager, compiled = _run(model, _input(torch.float32))
    assert current().replacements["attention"] == 2
    assert torch.ops.cstack.flash_attention_bwd.default in _ops(GRAPHS)
    assert _square_tensors(GRAPHS) == []
    _close(eager, compiled, 1e-4)


def _noting_layouts(impl, seen: list):
    """``impl``, noting on each call which of its tensor arguments are contiguous."""
    def run(*args):
        seen.append([a.is_contiguous() for a in args if isinstance(a, torch.Tensor)])
        return impl(*args)
    return run


@pytest.mark.parametrize("batch", [1, 2])
def test_op_inputs_dense(batch, monkeypatch):
    """With one sequence, q, k and v reach the bmms as strided views of the fused projection; the
    pass copies them dense in the graph, the backward reads the forward's copies of q, k, v
    (placeholders of its graph), and Inductor hands the ops exactly these layouts. The output
    grad, the merged heads' gradient, is sequence-major and read in place; with two sequences the
    bmm's reshape has copied it dense already."""
    seen = []
    for name in ("torch_fwd", "torch_bwd"):
        monkeypatch.setattr(custom_ops.attention, name, _noting_layouts(getattr(custom_ops.attention, name), seen))
    model, x = Model(causal_attention, layers=1), _input(torch.float32, b=batch)
    eager, compiled = _run(model, x, codegen=True)  # may be a compile-cache hit: no graphs seen
    assert seen == [[True] * 3, [batch == 2] + [True] * 5]  # at run time: forward (q, k, v), backward (dO … lse)
    _close(eager, compiled, 1e-4)
    _run(model, x)
    fwd_graph, bwd_graph = GRAPHS
    (fwd,) = [n for n in fwd_graph.nodes if n.target is torch.ops.cstack.flash_attention_fwd.default]
    (bwd,) = [n for n in bwd_graph.nodes if n.target is torch.ops.cstack.flash_attention_bwd.default]
    for arg in (*fwd.args[:3], *bwd.args[1:6]):
        assert arg.meta["val"].is_contiguous(), (arg, arg.meta["val"].stride())
    assert custom_ops.attention.is_sequence_major(bwd.args[0].meta["val"]) == (batch == 1)
    assert all(arg.op == "placeholder" for arg in bwd.args[1:6])
    copied = [a.target is torch.ops.aten.clone.default for a in fwd.args[:3]]
    # Two sequences: the bmms' reshapes already copied q and v; k is the transpose of kᵀ's copy.
    assert copied == ([True] * 3 if batch == 1 else [False, True, False])


@pytest.mark.parametrize("attn, why", [(triu_mask, "not causal"), (off_by_one_mask, "not causal"),
                                       (sliding_window_mask, "not causal")],
                         ids=["triu_mask", "off_by_one_mask", "sliding_window_mask"])
def test_left_alone(attn, why):
    model = Model(attn, layers=1)
    eager, compiled = _run(model, _input(torch.float32))
    assert current().replacements["attention"] == 0
    assert torch.ops.cstack.flash_attention_fwd.default not in _ops(GRAPHS)
    assert any(n.startswith("attention:") and why in n for n in current().notes), current().notes
    _close(eager, compiled, 1e-4)


def test_mask_tensor_input_left_alone():
    model = Model(mask_tensor_input, layers=1, mask_input=True)
    mask = torch.rand(S, S) > 0.3
    mask.fill_diagonal_(True)
    eager, compiled = _run(model, _input(torch.float32), mask)
    assert current().replacements["attention"] == 0
    assert any("graph input" in n for n in current().notes), current().notes
    _close(eager, compiled, 1e-4)


def test_dropout_left_alone():
    """Dropout draws differ between eager and compiled runs, so only the outcome is compared."""
    model = Model(dropout_after_softmax, layers=1)
    _, compiled = _run(model, _input(torch.float32))
    assert current().replacements["attention"] == 0
    assert torch.ops.cstack.flash_attention_fwd.default not in _ops(GRAPHS)
    assert any("dropout?" in n for n in current().notes), current().notes
    assert torch.isfinite(compiled[0])


def test_reference_model_tiny():
    cfg = PRESETS["tiny"].with_overrides(seq=48)  # seq != d_model: no weight looks like scores
    model = build_model(cfg, "cpu", torch.bfloat16)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
    targets = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, targets):
            return cross_entropy(self.model(ids), targets)

    eager, compiled = _run(WithLoss(), ids, targets)
    assert current().replacements["attention"] == cfg.layers
    assert torch.ops.cstack.flash_attention_bwd.default in _ops(GRAPHS)
    assert _square_tensors(GRAPHS, cfg.seq) == []
    # bf16 softmax by hand in eager vs fp32 inside the op.
    _close(eager, compiled, 3e-2)


def test_real_inductor_smallest():
    model = Model(causal_attention, layers=1)
    eager, compiled = _run(model, _input(torch.float32, b=1), codegen=True)
    assert current().replacements["attention"] == 1
    _close(eager, compiled, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_reference_attention_bf16():
    """Realistic shape through real Inductor on the GPU: our Triton kernels, fwd + bwd."""
    q, k, v = (torch.randn(2, 8, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    torch._dynamo.reset()
    current().clear()
    backend = PassBackend(passes=["attention"])
    with backend.active():
        out = torch.compile(causal_attention, backend=backend)(q, k, v)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    assert current().replacements["attention"] == 1
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*ref, is_causal=True)
    expected_grads = torch.autograd.grad(expected.square().sum(), ref)
    assert rel_err(out, expected) <= 1e-2
    for g, e in zip(grads, expected_grads, strict=True):
        assert rel_err(g, e) <= 2e-2


@pytest.mark.parametrize("values, causal", [
    (torch.ones(6, 6, dtype=torch.bool).tril(), True),
    (torch.full((6, 6), float("-inf")).triu(1).view(1, 1, 6, 6), True),
    (torch.ones(6, 6).tril(1), False),  # one key ahead
    (torch.ones(6, 6, dtype=torch.bool).tril() & ~torch.ones(6, 6, dtype=torch.bool).tril(-3), None),  # window
])
def test_constant_mask_values(values, causal):
    """A constant tensor the graph holds is read as a diagonal split of the grid, or not at all."""
    from passes.attention import _KEEP_CAUSAL, Piecewise, _tensor_value
    value = _tensor_value(values)
    if causal is None:
        assert value is None
    else:
        assert isinstance(value, Piecewise) and (value.pred == _KEEP_CAUSAL) == causal


def test_layout_chain_order():
    """Permutes that cancel keep the element order as a whole; a transpose does not."""
    from passes.attention import _chain_keeps_order

    aten, graph = torch.ops.aten, torch.fx.Graph()

    def node(target, args, shape):
        n = graph.call_function(target, args) if target else graph.placeholder("x")
        n.meta["val"] = torch.empty(shape, device="meta")
        return n

    x = node(None, (), (2, 3, 5, 5))
    u = node(aten.unsqueeze.default, (x, 4), (2, 3, 5, 5, 1))
    p1 = node(aten.permute.default, (u, [0, 2, 1, 4, 3]), (2, 5, 3, 1, 5))
    p2 = node(aten.permute.default, (p1, [0, 2, 1, 4, 3]), (2, 3, 5, 5, 1))
    v = node(aten.view.default, (p2, [6, 5, 5]), (6, 5, 5))
    assert _chain_keeps_order([u, p1, p2, v])
    assert not _chain_keeps_order([u, p1])
    t = node(aten.permute.default, (v, [0, 2, 1]), (6, 5, 5))
    assert not _chain_keeps_order([t])


# ---- heads split off separate projections and merged after: no copies around the op


def merge_transpose_reshape(out):
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


def merge_contiguous_view(out):
    b, h, s, d = out.shape
    return out.transpose(1, 2).contiguous().view(b, s, h * d)


def merge_permute_flatten(out):
    return out.permute(0, 2, 1, 3).flatten(2)


def merge_after_scaling(out):
    """Something between the op and the merge: the output's layout cannot simply flow through."""
    return merge_transpose_reshape(out * 0.5)


class SplitHeads(nn.Module):
    """Separate q/k/v/o projections, heads split by view + transpose and merged by ``merge``."""

    def __init__(self, attn, merge):
        super().__init__()
        d = HEADS * HEAD_DIM
        self.attn, self.merge = attn, merge
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        return x + self.o(self.merge(self.attn(q, k, v)))


def _path_copies(node, step):
    """The dense copies (clone nodes) met going from ``node`` through views and permutes (``step``:
    to a node's input or its one user) until a matmul."""
    copies = []
    while node is not None and node.target not in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        if node.target is torch.ops.aten.clone.default:
            copies.append(node.name)
        node = step(node)
    return copies


def _up(node):
    return node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None


def _down(node):
    return next(iter(node.users)) if len(node.users) == 1 else None


@pytest.mark.parametrize("attn", [causal_attention, sdpa_causal])
@pytest.mark.parametrize("merge", [merge_transpose_reshape, merge_contiguous_view, merge_permute_flatten])
@pytest.mark.parametrize("batch", [1, 2])
def test_split_heads_read_and_merged_in_place(attn, merge, batch, monkeypatch):
    """v reaches the op as the projection's own sequence-major view, the op's output reaches the
    output projection, dv the v projection's backward, and the output's gradient the backward op,
    without a dense copy on the way (before: one each, 0.26-0.29 ms apiece at the 8B step's size);
    the op sees those layouts at run time, and loss and grads equal eager's."""
    seen = []
    for name in ("torch_fwd", "torch_bwd"):
        impl = getattr(custom_ops.attention, name)
        monkeypatch.setattr(custom_ops.attention, name,
                            lambda *a, impl=impl: seen.append([custom_ops.attention.is_sequence_major(t)
                                                               for t in a if isinstance(t, torch.Tensor)]) or impl(*a))
    model, x = SplitHeads(attn, merge), _input(torch.float32, b=batch)
    eager, compiled = _run(model, x, codegen=True)
    assert seen == [[False, False, True], [True, False, False, True, True, False]]  # (q, k, v), (dO, q, k, v, out, lse)
    _close(eager, compiled, 1e-4)
    _run(model, x)
    assert current().replacements["attention"] == 1
    fwd_graph, bwd_graph = GRAPHS
    (fwd,) = [n for n in fwd_graph.nodes if n.target is torch.ops.cstack.flash_attention_fwd.default]
    (bwd,) = [n for n in bwd_graph.nodes if n.target is torch.ops.cstack.flash_attention_bwd.default]
    out = next(u for u in fwd.users if u.args[1] == 0)
    dv = next(u for u in bwd.users if u.args[1] == 2)
    assert _path_copies(fwd.args[2], _up) == []
    assert _path_copies(_down(out), _down) == []
    assert _path_copies(_down(dv), _down) == []
    assert _path_copies(bwd.args[0], _up) == []


def test_merge_after_other_ops_keeps_a_copy():
    """An op between attention and the merge: the output is copied into the layout the graph had
    (which the op's users were traced with), and the result is still right."""
    model = SplitHeads(causal_attention, merge_after_scaling)
    eager, compiled = _run(model, _input(torch.float32))
    assert current().replacements["attention"] == 1
    _close(eager, compiled, 1e-4)
