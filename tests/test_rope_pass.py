"""The RoPE pass: rotations as people write them become cstack.rope; anything else stays.

Each case compiles a small model (two projections, heads split off them, both rotated, then
Q·Kᵀ) with PassBackend(codegen=False) and checks the op in the forward graph, the count of
replacements (q and k), and the loss and gradients against eager. The spellings follow the
public code they are modelled on, written here independently.
"""
import math

import einops
import pytest
import torch
import torch.nn as nn

import passes.rope  # noqa: F401  (registers the pass)
from passes.registry import current, register_pass
from tests.helpers import eager_and_compiled, rel_err

SEQ, HEADS, HEAD_DIM = 12, 2, 16
GRAPHS: list[torch.fx.Graph] = []
ROPE = torch.ops.cstack.rope.default


@register_pass("rope_test_probe", stage="post_grad")
def _probe(graph: torch.fx.Graph) -> int:
    GRAPHS.append(graph)
    return 0


def half_angles(seq, dim, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)
    return torch.outer(torch.arange(seq).float(), inv)


class Tables(nn.Module):
    """cos and sin of each position's angles as [seq, D/2] buffers (each spelling reads them its way)."""

    def __init__(self, dim, seq=64):
        super().__init__()
        angles = half_angles(seq, dim)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)


class PairsThenHalves(Tables):
    """Interleaved pairs in, first-of-pair then second-of-pair out; the buffers sliced to the sequence."""

    def forward(self, x):
        cos, sin = self.cos[: x.shape[-2]], self.sin[: x.shape[-2]]
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class EinopsPairs(Tables):
    """A course's form: interleaved pairs taken by einops, the rotated halves concatenated."""

    def forward(self, x):
        cos, sin = self.cos[: x.shape[-2]], self.sin[: x.shape[-2]]
        x1, x2 = einops.rearrange(x, "... (d two) -> two ... d", two=2).unbind(0)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class RotateHalf(nn.Module):
    """HF's Llama: full-width tables made in the forward from inv_freq and positions."""

    def __init__(self, dim):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, x):
        position_ids = torch.arange(x.shape[-2], device=x.device)[None, :].expand(x.shape[0], -1)
        freqs = (self.inv_freq[None, :, None] @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype).unsqueeze(1), emb.sin().to(x.dtype).unsqueeze(1)
        return (x * cos) + (rotate_half(x) * sin)


class ChunkHalves(Tables):
    """GPT-NeoX style written out: halves by chunk, half-width tables as long as the sequence."""

    def __init__(self, dim):
        super().__init__(dim, SEQ)

    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * self.cos - b * self.sin, b * self.cos + a * self.sin], dim=-1)


class StackFlatten(Tables):
    """A course's RoPE: interleaved in and out (stack, flatten), tables gathered by positions."""

    def forward(self, x):
        positions = torch.arange(x.shape[-2])
        cos, sin = self.cos[positions], self.sin[positions]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class UnbindUpcast(Tables):
    """Pairs by unflatten + unbind, math in fp32, cast back at the end, the sin term first."""

    def __init__(self, dim):
        super().__init__(dim, SEQ)

    def forward(self, x):
        even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        out = torch.stack([-odd * self.sin + even * self.cos, odd * self.cos + even * self.sin], -1)
        return out.flatten(-2).type_as(x)


def gpt_fast_rotary(x, freqs_cis):
    """gpt-fast's: x [B, S, H, D] before the heads move, cos and sin in one [S, D/2, 2] table."""
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack([xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
                          xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1]], -1)
    return x_out2.flatten(3).type_as(x)


def complex_rotary(x, freqs_cis):
    """Meta's Llama and torchtitan: pairs as complex numbers times a complex table."""
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, x_.shape[1], 1, x_.shape[-1])
    return torch.view_as_real(x_ * freqs_cis).flatten(3).type_as(x)


class SequenceMajorHeads(nn.Module):
    """RoPE on [B, S, H, D], heads moved afterwards; ``cis``: a complex table, or its real view."""

    def __init__(self, rotary, complex_table, dim=HEAD_DIM, heads=HEADS):
        super().__init__()
        self.heads, self.dim, self.rotary = heads, dim, rotary
        self.q = nn.Linear(heads * dim, heads * dim, bias=False)
        self.k = nn.Linear(heads * dim, heads * dim, bias=False)
        angles = half_angles(SEQ, dim)
        cis = torch.polar(torch.ones_like(angles), angles)
        self.register_buffer("cis", cis if complex_table else torch.view_as_real(cis).clone())

    def forward(self, x):
        b, s, _ = x.shape
        q = self.rotary(self.q(x).view(b, s, self.heads, self.dim), self.cis).transpose(1, 2)
        k = self.rotary(self.k(x).view(b, s, self.heads, self.dim), self.cis).transpose(1, 2)
        return q @ k.transpose(-2, -1) / math.sqrt(self.dim)


class Heads(nn.Module):
    def __init__(self, rotary, dim=HEAD_DIM, heads=HEADS):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.q = nn.Linear(heads * dim, heads * dim, bias=False)
        self.k = nn.Linear(heads * dim, heads * dim, bias=False)
        self.rotary = rotary

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.heads, self.dim).transpose(1, 2)
        q, k = self.rotary(q), self.rotary(k)
        return q @ k.transpose(-2, -1) / math.sqrt(self.dim)


def _run(model, dtype=torch.float32, codegen=False):
    if dtype != torch.float32:
        model = model.to(dtype)
    x = torch.randn(2, SEQ, model.heads * model.dim, dtype=dtype)

    def step(m):
        loss = m(x).float().square().mean()
        return loss.detach(), torch.autograd.grad(loss, list(m.parameters()))

    GRAPHS.clear()
    return eager_and_compiled(model, step, ["rope", "rope_test_probe"], codegen)


def _rope_calls(graphs):
    return [n for g in graphs for n in g.nodes if n.target is ROPE]


def _close(eager, compiled, tol):
    assert rel_err(compiled[0], eager[0]) <= tol
    for ge, gc in zip(eager[1], compiled[1], strict=True):
        assert rel_err(gc, ge) <= tol


@pytest.mark.parametrize("rotary, layout", [
    (PairsThenHalves, (True, False)),
    (EinopsPairs, (True, False)),
    (RotateHalf, (False, False)),
    (ChunkHalves, (False, False)),
    (StackFlatten, (True, True)),
    (UnbindUpcast, (True, True)),
])
def test_spellings_become_the_op(rotary, layout):
    eager, compiled = _run(Heads(rotary(HEAD_DIM)))
    assert current().replacements["rope"] == 2, current().notes
    calls = _rope_calls(GRAPHS)
    assert len(calls) == 2 and all(tuple(c.args[3:6]) == (*layout, False) for c in calls)
    _close(eager, compiled, 1e-5)


@pytest.mark.parametrize("rotary, complex_table", [(gpt_fast_rotary, False), (complex_rotary, True)])
def test_sequence_major_spellings_become_the_op(rotary, complex_table):
    eager, compiled = _run(SequenceMajorHeads(rotary, complex_table))
    assert current().replacements["rope"] == 2, current().notes
    calls = _rope_calls(GRAPHS)
    assert len(calls) == 2 and all(tuple(c.args[3:6]) == (True, True, False) for c in calls)
    _close(eager, compiled, 1e-5)


@pytest.mark.parametrize("model", [lambda: Heads(PairsThenHalves(HEAD_DIM)),
                                   lambda: SequenceMajorHeads(complex_rotary, True)])
def test_inductor_code_runs_the_op(model):
    """Through Inductor's code generation: the op reads the heads in place, the tables as given
    (a complex table's parts as strided views)."""
    eager, compiled = _run(model(), codegen=True)
    assert current().replacements["rope"] == 2
    _close(eager, compiled, 1e-5)


def test_bf16_model_rounds_once():
    """bf16 projections and tables: the op returns bf16, as the graph did."""
    eager, compiled = _run(Heads(UnbindUpcast(HEAD_DIM)), torch.bfloat16)
    calls = _rope_calls(GRAPHS)
    assert len(calls) == 2 and all(c.meta["val"].dtype == torch.bfloat16 for c in calls)
    _close(eager, compiled, 2e-2)


class WrongSign(PairsThenHalves):
    """Rotated the other way round in the second half: not the op's rotation."""

    def forward(self, x):
        cos, sin = self.cos[: x.shape[-2]], self.sin[: x.shape[-2]]
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos - x1 * sin), dim=-1)


class NoPairs(PairsThenHalves):
    """Each element scaled by two tables: no pairs at all."""

    def forward(self, x):
        cos = torch.cat([self.cos, self.cos], -1)[: x.shape[-2]]
        sin = torch.cat([self.sin, self.sin], -1)[: x.shape[-2]]
        return x * cos - x * sin


class OneTable(PairsThenHalves):
    def forward(self, x):
        cos = self.cos[: x.shape[-2]]
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.cat((x1 * cos - x2 * cos, x2 * cos + x1 * cos), dim=-1)


@pytest.mark.parametrize("rotary, note", [
    (WrongSign, "not as a rotation of pairs"),
    (NoPairs, "not as a rotation of pairs"),
    (OneTable, None),
])
def test_other_math_is_left_alone(rotary, note):
    eager, compiled = _run(Heads(rotary(HEAD_DIM)))
    assert current().replacements["rope"] == 0 and not _rope_calls(GRAPHS)
    assert (note is None) == (not current().notes)
    if note:
        assert any(note in n for n in current().notes), current().notes
    _close(eager, compiled, 1e-5)


class RandomTables(PairsThenHalves):
    """Two draws each of two random expressions where a rotation has its two tables: written the
    same, but four different tables."""

    def forward(self, x):
        x1, x2 = x[..., ::2], x[..., 1::2]
        ra, rc = (torch.rand(x.shape[-2], x.shape[-1] // 2) for _ in range(2))
        rb, rd = (torch.rand(1, x.shape[-2], x.shape[-1] // 2) for _ in range(2))
        return torch.cat((x1 * ra - x2 * rb, x2 * rc + x1 * rd), dim=-1)


def test_random_tables_are_not_taken_for_one():
    _run(Heads(RandomTables(HEAD_DIM)))
    assert current().replacements["rope"] == 0 and not _rope_calls(GRAPHS)


def test_head_dim_without_a_kernel_is_left_alone_with_a_note():
    eager, compiled = _run(Heads(PairsThenHalves(12), dim=12))
    assert current().replacements["rope"] == 0
    assert any("D/2 a power of two" in n for n in current().notes), current().notes
    _close(eager, compiled, 1e-5)


def test_float64_is_left_alone_with_a_note():
    eager, compiled = _run(Heads(PairsThenHalves(HEAD_DIM)), torch.float64)
    assert current().replacements["rope"] == 0
    assert any("16/32-bit floats" in n for n in current().notes), current().notes
    _close(eager, compiled, 1e-12)


class ScaledRotation(PairsThenHalves):
    """The rotation of its input times a 0-d parameter (as an optimizer's update multiplies by its
    0-d lr): a scalar, not a table; the pass once failed on such a product."""

    def __init__(self, dim):
        super().__init__(dim)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return super().forward(x * self.scale)


def test_a_product_with_a_0d_tensor_is_not_a_table():
    eager, compiled = _run(Heads(ScaledRotation(HEAD_DIM)))
    assert current().replacements["rope"] == 2 and not current().notes, current().notes
    _close(eager, compiled, 1e-5)
