"""User-style corpus: attention written the many ways people write it.

Each case is a small language model (embeddings, two pre-norm blocks, a head) whose attention
module is written in one idiom, everything else plain. ``run_case`` checks the compiled train step
equals eager and that the attention pass replaced every layer (or, for a must-not-replace case,
none of them, with a note saying why). Written independently of ``compile_stack/reference.py``.
"""
import contextlib
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compile_stack
from passes import registry
from tests import user_corpus
from tests.user_corpus import (SEQ, STATE_TOLERANCE, TOLERANCE, VOCAB, batches, make_train_step,
                               mean_cross_entropy)

D_MODEL, HEADS, LAYERS = 32, 2, 2  # head dim 16


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def run_case(make_model, **kw):
    """The harness with plain SGD by default: compiling AdamW's step costs more than these models
    (2-core CI), and AdamW's 1/sqrt(v) turns rounding noise in an exactly-zero gradient (the key
    bias of nn.MultiheadAttention's in-projection) into whole steps."""
    kw.setdefault("make_optimizer", sgd)
    return user_corpus.run_case(make_model, **kw)


class Block(nn.Module):
    """Pre-norm attention with a residual; no MLP: it adds a quarter to each case's compile time
    on a 2-core machine and nothing to what the attention pass sees."""

    def __init__(self, attn, d):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), attn

    def forward(self, x):
        return x + self.attn(self.ln1(x))


class LM(nn.Module):
    def __init__(self, make_attn, d=D_MODEL, heads=HEADS, layers=LAYERS):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(Block(make_attn(d, heads), d) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class QKV(nn.Module):
    """The projections most cases share: q, k, v as [B, H, T, hd] by view + transpose."""

    def __init__(self, d, h):
        super().__init__()
        self.h, self.hd = h, d // h
        # No bias on q/k/v: a key bias has an exactly-zero gradient, whose rounding noise AdamW's
        # 1/sqrt(v) turns into whole steps that differ between any two runs.
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)

    def split(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        return [t.view(B, T, self.h, self.hd).transpose(1, 2) for t in (q, k, v)]

    def merge(self, y):
        B, H, T, hd = y.shape
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, H * hd))


# --------------------------------------------------------------------------- replaced: one per layer


class NanoGPT(QKV):
    """nanoGPT: a tril buffer sliced to T, masked_fill(== 0, -inf), F.softmax (the buffer reaches the
    block's graph as an input; compile_stack/input_masks.py rebuilds it in the graph)."""

    def __init__(self, d, h):
        super().__init__(d, h)
        self.register_buffer("bias", torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ))

    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.split(x)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        return self.merge(att @ v)


class TrilFloatMask(QKV):
    """A float tril of ones built in forward, `/ math.sqrt(d)`, masked where == 0."""

    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.split(x)
        att = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.hd)
        mask = torch.tril(torch.ones(T, T))
        att = att.masked_fill(mask == 0, float("-inf"))
        return self.merge(torch.matmul(F.softmax(att, dim=-1), v))


class EinsumHeadsLast(nn.Module):
    """Heads split by view only ([B, T, H, hd]), scores and output by einsum, triu(diagonal=1) bool."""

    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, self.h, C // self.h) for p in (self.q, self.k, self.v))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / (C // self.h) ** 0.5
        future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
        out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)
        return self.o(out.reshape(B, T, C))


class Einops(nn.Module):
    """einops: rearrange for heads, einops.einsum for both products, an arange comparison mask."""

    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.to_qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        from einops import einsum, rearrange

        q, k, v = rearrange(self.to_qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.h)
        sim = einsum(q, k, "b h i d, b h j d -> b h i j") * q.shape[-1] ** -0.5
        i = torch.arange(x.shape[1])
        sim = torch.where(i[:, None] >= i[None, :], sim, float("-inf"))
        out = einsum(sim.softmax(dim=-1), v, "b h i j, b h j d -> b h i d")
        return self.out(rearrange(out, "b h t d -> b t (h d)"))


class MtTensorScale(QKV):
    """`.mT`, divided by `torch.sqrt(torch.tensor(d))`, a mask of unsqueezed aranges, torch.where."""

    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.split(x)
        att = (q @ k.mT) / torch.sqrt(torch.tensor(self.hd, dtype=torch.float32))
        pos = torch.arange(T)
        keep = pos.unsqueeze(0) <= pos.unsqueeze(1)
        att = torch.where(keep, att, float("-inf"))
        return self.merge(torch.softmax(att, -1) @ v)


class BmmFlatHeads(nn.Module):
    """Heads by reshape + permute onto [B*H, T, hd], scale folded into q, bmm, where(future, min, s)."""

    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.h
        qkv = self.qkv(x).reshape(B, T, 3, self.h, hd).permute(2, 0, 3, 1, 4).reshape(3, B * self.h, T, hd)
        q, k, v = qkv[0] * hd ** -0.5, qkv[1], qkv[2]
        att = torch.bmm(q, k.transpose(1, 2))
        pos = torch.arange(T)
        future = pos.view(1, T) > pos.view(T, 1)
        att = torch.where(future, torch.finfo(att.dtype).min, att)
        y = torch.bmm(att.softmax(-1), v)
        return self.proj(y.view(B, self.h, T, hd).permute(0, 2, 1, 3).reshape(B, T, C))


class AdditiveMaskHandSoftmax(QKV):
    """An additive -inf triu mask, softmax written out with the max subtracted."""

    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.split(x)
        att = q @ k.transpose(-1, -2) * self.hd ** -0.5
        att = att + torch.full((T, T), float("-inf")).triu(1)
        att = torch.exp(att - att.max(dim=-1, keepdim=True).values)
        att = att / att.sum(dim=-1, keepdim=True)
        return self.merge(att @ v)


class LargeNegativeNoMax(QKV):
    """`(1 - tril) * -1e9` added, softmax written out without subtracting the max."""

    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.split(x)
        att = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
        att = att + (1.0 - torch.tril(torch.ones(T, T))) * -1e9
        e = att.exp()
        return self.merge((e / e.sum(-1, keepdim=True)) @ v)


class ExpandedMaskTensorFill(QKV):
    """A mask of expanded aranges, masked_fill with a tensor value."""

    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.split(x)
        att = q @ k.transpose(-2, -1) * (1 / math.sqrt(self.hd))
        rows = torch.arange(T)[:, None].expand(T, T)
        cols = torch.arange(T)[None, :].expand(T, T)
        att = att.masked_fill(~(cols <= rows), torch.tensor(float("-inf")))
        return self.merge(att.softmax(-1) @ v)


class TemperatureOnQ(QKV):
    """A learned temperature multiplied into q before the product."""

    def __init__(self, d, h):
        super().__init__(d, h)
        self.temperature = nn.Parameter(torch.tensor(1.0 / math.sqrt(d // h)))

    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.split(x)
        att = (q * self.temperature) @ k.transpose(-2, -1)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).tril().logical_not(), float("-inf"))
        return self.merge(F.softmax(att, dim=-1) @ v)


class NoMask(QKV):
    """Bidirectional attention: no mask at all."""

    def forward(self, x):
        q, k, v = self.split(x)
        return self.merge(F.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.hd), dim=-1) @ v)


class GQARepeatInterleave(nn.Module):
    """Grouped-query attention: 4 query heads of 16, 2 k/v heads repeated by repeat_interleave."""

    def __init__(self, d, h):
        super().__init__()
        self.h, self.kvh, self.hd = 4, 2, 16
        self.wq = nn.Linear(d, self.h * self.hd, bias=False)
        self.wkv = nn.Linear(d, 2 * self.kvh * self.hd, bias=False)
        self.wo = nn.Linear(self.h * self.hd, d, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q = self.wq(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k, v = self.wkv(x).view(B, T, 2, self.kvh, self.hd).permute(2, 0, 3, 1, 4)
        k, v = (t.repeat_interleave(self.h // self.kvh, dim=1) for t in (k, v))
        att = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
        att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        return self.wo((att.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1))


class GQAExpand(GQARepeatInterleave):
    """Grouped-query attention: k/v heads repeated by expand + reshape (Llama's repeat_kv)."""

    def forward(self, x):
        B, T, C = x.shape
        q = self.wq(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k, v = self.wkv(x).view(B, T, 2, self.kvh, self.hd).permute(2, 0, 3, 1, 4)
        rep = self.h // self.kvh
        k, v = (t[:, :, None].expand(B, self.kvh, rep, T, self.hd).reshape(B, self.h, T, self.hd) for t in (k, v))
        att = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.hd)
        pos = torch.arange(T)
        att = att + torch.where(pos[None, :] > pos[:, None], float("-inf"), 0.0)
        return self.wo(torch.matmul(F.softmax(att, dim=-1), v).transpose(1, 2).reshape(B, T, -1))


class SdpaCausal(QKV):
    def forward(self, x):
        return self.merge(F.scaled_dot_product_attention(*self.split(x), is_causal=True))


class SdpaBoolMask(QKV):
    def forward(self, x):
        T = x.shape[1]
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        return self.merge(F.scaled_dot_product_attention(*self.split(x), attn_mask=mask))


class SdpaAdditiveMask(QKV):
    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.merge(F.scaled_dot_product_attention(*self.split(x), attn_mask=mask))


class SdpaGQA(GQARepeatInterleave):
    def forward(self, x):
        B, T, C = x.shape
        q = self.wq(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k, v = self.wkv(x).view(B, T, 2, self.kvh, self.hd).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class TorchMHA(nn.Module):
    """nn.MultiheadAttention with a causal float mask (its weights path: baddbmm, softmax, bmm)."""

    def __init__(self, d, h):
        super().__init__()
        self.mha = nn.MultiheadAttention(d, h, batch_first=True)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        out, _ = self.mha(x, x, x, attn_mask=mask)
        return out


class EncoderLayerLM(nn.Module):
    """nn.TransformerEncoderLayer blocks with a causal mask (no dropout)."""

    def __init__(self, is_causal=False):
        super().__init__()
        self.is_causal = is_causal
        self.tok, self.pos = nn.Embedding(VOCAB, D_MODEL), nn.Embedding(SEQ, D_MODEL)
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, 4 * D_MODEL, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T))
        mask = nn.Transformer.generate_square_subsequent_mask(T)
        return self.head(self.encoder(x, mask=mask, is_causal=self.is_causal))


class TemperatureOnScores(QKV):
    """A learned temperature multiplying the scores (the pass moves it onto q; its grad is kept)."""

    def __init__(self, d, h):
        super().__init__(d, h)
        self.logit_scale = nn.Parameter(torch.tensor(0.25))

    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.split(x)
        att = (q @ k.transpose(-2, -1)) * self.logit_scale
        att = att.masked_fill(torch.tril(torch.ones(T, T)) == 0, float("-inf"))
        return self.merge(F.softmax(att, dim=-1) @ v)


class TemperatureDividesScores(QKV):
    """A learned temperature dividing the scores before the mask, mask added as a float bias."""

    def __init__(self, d, h):
        super().__init__(d, h)
        self.tau = nn.Parameter(torch.ones(1) * 3.0)

    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.split(x)
        att = torch.matmul(q, k.transpose(-2, -1)) / self.tau
        att = att + nn.Transformer.generate_square_subsequent_mask(T)
        return self.merge(att.softmax(-1) @ v)


class UpcastSoftmax(QKV):
    """Softmax in fp32, cast back to the activations' dtype."""

    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.split(x)
        att = (q @ k.transpose(-2, -1)) * self.hd ** -0.5
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        att = F.softmax(att.float(), dim=-1).to(q.dtype)
        return self.merge(att @ v)


REPLACED = {
    "tril_float_mask": TrilFloatMask,
    "einsum_heads_last": EinsumHeadsLast,
    "einops": Einops,
    "mT_tensor_scale": MtTensorScale,
    "bmm_flat_heads": BmmFlatHeads,
    "additive_mask_hand_softmax": AdditiveMaskHandSoftmax,
    "large_negative_no_max": LargeNegativeNoMax,
    "expanded_mask_tensor_fill": ExpandedMaskTensorFill,
    "temperature_on_q": TemperatureOnQ,
    "temperature_on_scores": TemperatureOnScores,
    "temperature_divides_scores": TemperatureDividesScores,
    "no_mask": NoMask,
    "gqa_repeat_interleave": GQARepeatInterleave,
    "gqa_expand": GQAExpand,
    "sdpa_causal": SdpaCausal,
    "sdpa_bool_mask": SdpaBoolMask,
    "sdpa_additive_mask": SdpaAdditiveMask,
    "sdpa_gqa": SdpaGQA,
    "torch_mha": TorchMHA,
}


@pytest.mark.parametrize("name", list(REPLACED))
def test_replaced(name):
    if name == "einops":
        pytest.importorskip("einops")
    run_case(lambda: LM(REPLACED[name]), expect={"attention": LAYERS})



def test_encoder_layer_is_causal():
    """The mask made once outside the layers, with the is_causal hint: MHA then calls SDPA is_causal."""
    run_case(lambda: EncoderLayerLM(is_causal=True), expect={"attention": LAYERS})


@pytest.mark.parametrize("make_model", [lambda: LM(NanoGPT), EncoderLayerLM], ids=["nanogpt_buffer", "encoder_layer"])
def test_mask_from_a_graph_input(make_model):
    """A mask that reaches the block's graph as an input: nanoGPT's buffer, and the float mask
    ``generate_square_subsequent_mask`` makes outside the layers (a new tensor every step)."""
    run_case(make_model, expect={"attention": LAYERS})


def test_a_mask_buffer_changed_after_compiling_runs_uncompiled():
    """The compiled block assumed the buffer's values; once they are a sliding window instead, the
    step warns and gives eager's result (the call runs the captured graph uncompiled)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LM(NanoGPT)
    eager_model = copy.deepcopy(model)
    compiled = compile_stack.compile_step(make_train_step(model, mean_cross_entropy, sgd(model.parameters())),
                                          codegen=False)
    eager = make_train_step(eager_model, mean_cross_entropy, sgd(eager_model.parameters()))
    window = torch.ones(SEQ, SEQ).tril() - torch.ones(SEQ, SEQ).tril(-3)
    for i, (inputs, targets) in enumerate(batches(3)):
        if i == 1:
            for m in (model, eager_model):
                for block in m.blocks:
                    block.attn.bias.copy_(window)
        with pytest.warns(UserWarning, match="no longer holds") if i == 1 else contextlib.nullcontext():
            loss = compiled(inputs, targets)
        torch.testing.assert_close(loss, eager(inputs, targets), **TOLERANCE)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, **STATE_TOLERANCE)


# --------------------------------------------------------------------------- left alone, with a note


class TemperatureAfterMask(QKV):
    """A learned temperature dividing the already-masked scores: were it negative, the masked
    entries would win, so the pass cannot assume the causal mask survives it."""

    def __init__(self, d, h):
        super().__init__(d, h)
        self.tau = nn.Parameter(torch.tensor(4.0))

    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.split(x)
        att = (q @ k.transpose(-2, -1)).masked_fill(torch.tril(torch.ones(T, T)) == 0, -1e9) / self.tau
        return self.merge(F.softmax(att, dim=-1) @ v)


class SlidingWindow(QKV):
    """Causal, but each query sees only the last 4 keys."""

    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.split(x)
        att = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        att = att.masked_fill((j > i) | (j <= i - 4), float("-inf"))
        return self.merge(F.softmax(att, dim=-1) @ v)


class PaddingMaskLM(LM):
    """Causal attention that also masks padding keys (token 0): the mask depends on the data."""

    def __init__(self):
        super().__init__(PaddedCausal)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        pad = (idx == 0)[:, None, None, :]
        for block in self.blocks:
            x = x + block.attn(block.ln1(x), pad)
        return self.head(self.norm(x))


class PaddedCausal(QKV):
    def forward(self, x, pad):
        T = x.shape[1]
        q, k, v = self.split(x)
        att = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1) | pad, float("-inf"))
        return self.merge(F.softmax(att, dim=-1) @ v)


LEFT_ALONE = {
    "temperature_after_mask": (lambda: LM(TemperatureAfterMask), "after the mask"),
    "sliding_window": (lambda: LM(SlidingWindow), "not causal"),
    "padding_mask": (PaddingMaskLM, "graph input"),  # depends on the tokens
}


@pytest.mark.parametrize("name", list(LEFT_ALONE))
def test_left_alone(name):
    make_model, why = LEFT_ALONE[name]
    run_case(make_model, expect={"attention": 0}, notes=["attention", why])


# --------------------------------------------------------------------------- counts only


def compiled_counts(make_model, dtype=torch.float32, steps=1) -> dict:
    """Compile and run the train step (no comparison with eager); the pass report's counts and notes.
    For what eager cannot match bitwise or closely (dropout's random draws, bf16)."""
    torch._dynamo.reset()
    registry.current().clear()
    torch.manual_seed(0)
    model = make_model().to(dtype)
    step = compile_stack.compile_step(make_train_step(model, mean_cross_entropy, sgd(model.parameters())),
                                      codegen=False)
    for inputs, targets in batches(steps):
        assert torch.isfinite(step(inputs, targets))
    return dict(registry.current().replacements), list(registry.current().notes)


class FunctionalDropout(QKV):
    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.split(x)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
        att = att.masked_fill(torch.tril(torch.ones(T, T)) == 0, float("-inf"))
        att = F.dropout(F.softmax(att, dim=-1), 0.1, training=self.training)
        return self.merge(att @ v)


class ModuleDropout(QKV):
    def __init__(self, d, h):
        super().__init__(d, h)
        self.attn_dropout = nn.Dropout(0.1)

    def forward(self, x):
        T = x.shape[1]
        q, k, v = self.split(x)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(torch.tril(torch.ones(T, T)).view(1, 1, T, T) == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        return self.merge(att @ v)


@pytest.mark.parametrize("attn", [FunctionalDropout, ModuleDropout], ids=["F.dropout", "nn.Dropout"])
def test_dropout_left_alone(attn):
    counts, notes = compiled_counts(lambda: LM(attn))
    assert counts.get("attention", 0) == 0
    assert any("attention" in n and "dropout" in n for n in notes), notes


@pytest.mark.parametrize("attn", [UpcastSoftmax, TemperatureOnScores, SdpaCausal],
                         ids=lambda a: a.__name__)
def test_bf16_counts(attn):
    counts, notes = compiled_counts(lambda: LM(attn), torch.bfloat16)
    assert counts.get("attention", 0) == LAYERS, notes
