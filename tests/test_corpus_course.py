"""The issue's motivating case: a whole model, loss and optimizer in a systems course's plain style.

Written independently of ``compile_stack/reference.py``, every part the way such a course writes
it: einops ``einsum`` linear layers, an embedding by indexing, RMSNorm with an fp32 upcast, RoPE
from cos/sin buffers indexed by token positions, attention by einsum with a ``triu`` mask applied
by ``masked_fill`` and a softmax by hand, heads split by ``rearrange``, SwiGLU; cross-entropy by
max subtraction and ``logsumexp``; AdamW keeping ``t``, ``m`` and ``v`` in ``self.state[p]``,
created on first use with ``state.get``, and updating ``p.data`` without ``no_grad``.
Before this package recognised these spellings, none of the three was replaced and the optimizer
did not compile at all ("cannot mutate tensors with frozen storage").
"""
import math

import pytest
import torch
import torch.nn as nn

from tests.user_corpus import SEQ, VOCAB, run_case

einops = pytest.importorskip("einops")
einsum, rearrange = einops.einsum, einops.rearrange


class Linear(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        std = math.sqrt(2 / (d_in + d_out))
        self.weight = nn.Parameter(nn.init.trunc_normal_(torch.empty(d_out, d_in), std=std, a=-3 * std, b=3 * std))

    def forward(self, x):
        return einsum(x, self.weight, "... d_in, d_out d_in -> ... d_out")


class Embedding(nn.Module):
    def __init__(self, vocab, d):
        super().__init__()
        self.weight = nn.Parameter(nn.init.trunc_normal_(torch.empty(vocab, d), a=-3, b=3))

    def forward(self, token_ids):
        return self.weight[token_ids]


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        rms = torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True) + self.eps)
        return (x / rms * self.weight).to(dtype)


class RoPE(nn.Module):
    def __init__(self, theta, d_k, max_seq_len):
        super().__init__()
        freqs = 1.0 / theta ** (torch.arange(0, d_k, 2).float() / d_k)
        angles = torch.outer(torch.arange(max_seq_len).float(), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x, token_positions):
        cos, sin = self.cos[token_positions], self.sin[token_positions]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return rotated.flatten(-2)


def softmax(x, dim):
    x = x - x.max(dim=dim, keepdim=True).values
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


def scaled_dot_product_attention(q, k, v, mask):
    scores = einsum(q, k, "... q d, ... k d -> ... q k") / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    return einsum(softmax(scores, dim=-1), v, "... q k, ... k d -> ... q d")


class CausalMultiHeadSelfAttention(nn.Module):
    def __init__(self, d_model, num_heads, rope):
        super().__init__()
        self.num_heads, self.rope = num_heads, rope
        self.q_proj, self.k_proj = Linear(d_model, d_model), Linear(d_model, d_model)
        self.v_proj, self.output_proj = Linear(d_model, d_model), Linear(d_model, d_model)

    def forward(self, x):
        seq_len = x.shape[-2]
        q, k, v = (rearrange(p(x), "... s (h d) -> ... h s d", h=self.num_heads)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        positions = torch.arange(seq_len, device=x.device)
        q, k = self.rope(q, positions), self.rope(k, positions)
        mask = ~torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=x.device), diagonal=1)
        out = scaled_dot_product_attention(q, k, v, mask)
        return self.output_proj(rearrange(out, "... h s d -> ... s (h d)"))


class SwiGLU(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(d_model, d_ff), Linear(d_ff, d_model), Linear(d_model, d_ff)

    def forward(self, x):
        a = self.w1(x)
        return self.w2(a * torch.sigmoid(a) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, d_model, num_heads, d_ff, rope):
        super().__init__()
        self.ln1, self.attn = RMSNorm(d_model), CausalMultiHeadSelfAttention(d_model, num_heads, rope)
        self.ln2, self.ffn = RMSNorm(d_model), SwiGLU(d_model, d_ff)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class TransformerLM(nn.Module):
    def __init__(self, vocab_size=VOCAB, context_length=SEQ, d_model=32, num_layers=2, num_heads=2, d_ff=48):
        super().__init__()
        rope = RoPE(10000.0, d_model // num_heads, context_length)
        self.token_embeddings = Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(TransformerBlock(d_model, num_heads, d_ff, rope) for _ in range(num_layers))
        self.ln_final, self.lm_head = RMSNorm(d_model), Linear(d_model, vocab_size)

    def forward(self, token_ids):
        x = self.token_embeddings(token_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_final(x))


def cross_entropy(logits, targets):
    logits = logits - logits.max(dim=-1, keepdim=True).values
    log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    picked = torch.gather(log_probs, -1, targets.unsqueeze(-1)).squeeze(-1)
    return -picked.mean()


class AdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def step(self, closure=None):
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                t = state.get("t", 1)
                m = state.get("m", torch.zeros_like(p.data))
                v = state.get("v", torch.zeros_like(p.data))
                g = p.grad.data
                m = beta1 * m + (1 - beta1) * g
                v = beta2 * v + (1 - beta2) * g**2
                lr_t = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t)
                p.data -= lr_t * m / (torch.sqrt(v) + eps)
                p.data -= lr * wd * p.data
                state["t"], state["m"], state["v"] = t + 1, m, v


def test_course_style_model_loss_and_optimizer_all_replaced_and_equal_to_eager():
    # The optimizer compiles twice: the first step sees no state (created there), the next ones do.
    run_case(TransformerLM, cross_entropy, AdamW, expect={"rope": 4, "attention": 2, "cross_entropy": 1, "adamw": 2})
