"""The reference model, loss and optimizer, written the plain way.

This is the slow input the package must make fast *without editing it*:
attention materializes the S×S scores with a hand-written softmax, the loss
builds the full logits and a hand-written log-softmax, and AdamW is a Python
loop of tensor ops per parameter. Semantics follow docs/reference.md §2.
"""
import math

import torch
import torch.nn as nn

from compile_stack.workloads.config import ModelConfig


def trunc_normal_(t: torch.Tensor, std: float) -> torch.Tensor:
    return nn.init.trunc_normal_(t, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Linear(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(trunc_normal_(torch.empty(d_out, d_in), math.sqrt(2 / (d_in + d_out))))

    def forward(self, x):
        return x @ self.weight.T


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        in_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight).to(in_dtype)


class RotaryEmbedding(nn.Module):
    """RoPE on pairs (x[2i], x[2i+1]); outputs all first-of-pair components, then all second."""

    def __init__(self, head_dim: int, max_seq: int, theta: float = 10000.0):
        super().__init__()
        freqs = theta ** (-torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(max_seq).float(), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):
        seq = x.shape[-2]
        cos, sin = self.cos[:seq], self.sin[:seq]
        x_even, x_odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], dim=-1)


def causal_attention(q, k, v):
    """softmax(QKᵀ/√d + causal mask) V, the way it is written on a whiteboard."""
    seq, head_dim = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
    mask = torch.tril(torch.ones(seq, seq, dtype=torch.bool, device=q.device))
    scores = torch.where(mask, scores, float("-inf"))
    scores = scores - scores.max(dim=-1, keepdim=True).values
    weights = torch.exp(scores)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights @ v


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads = cfg.heads
        self.q_proj = Linear(cfg.d_model, cfg.d_model)
        self.k_proj = Linear(cfg.d_model, cfg.d_model)
        self.v_proj = Linear(cfg.d_model, cfg.d_model)
        self.o_proj = Linear(cfg.d_model, cfg.d_model)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.seq)

    def forward(self, x):
        batch, seq, d_model = x.shape

        def split_heads(t):
            return t.view(batch, seq, self.heads, d_model // self.heads).transpose(1, 2)

        q = self.rope(split_heads(self.q_proj(x)))
        k = self.rope(split_heads(self.k_proj(x)))
        v = split_heads(self.v_proj(x))
        out = causal_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, d_model))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = Linear(cfg.d_model, cfg.d_ff)
        self.w2 = Linear(cfg.d_ff, cfg.d_model)
        self.w3 = Linear(cfg.d_model, cfg.d_ff)

    def forward(self, x):
        a = self.w1(x)
        return self.w2(a * torch.sigmoid(a) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.d_model)
        self.ffn = FeedForward(cfg)

    def forward(self, x):
        h = x + self.attn(self.norm1(x))
        return h + self.ffn(self.norm2(h))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embedding = nn.Parameter(trunc_normal_(torch.empty(cfg.vocab, cfg.d_model), 1.0))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.d_model)
        self.lm_head = Linear(cfg.d_model, cfg.vocab)

    def forward(self, ids):
        x = self.embedding[ids]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def cross_entropy(logits, targets):
    """Mean over tokens of −log_softmax(logits)[target], log-softmax by hand in the logits' dtype."""
    logits = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    log_probs = shifted - torch.log(torch.exp(shifted).sum(dim=-1, keepdim=True))
    return -log_probs.gather(1, targets.unsqueeze(1)).mean()


class AdamW:
    """AdamW as in the reference: decay with lr first, eps outside the bias correction."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        self.params = list(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.t = 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        self.t += 1
        beta1, beta2 = self.betas
        alpha = self.lr * math.sqrt(1 - beta2**self.t) / (1 - beta1**self.t)
        for p, m, v in zip(self.params, self.m, self.v):
            if p.grad is None:
                continue
            g = p.grad
            p.data -= self.lr * self.weight_decay * p.data
            m.mul_(beta1).add_((1 - beta1) * g)
            v.mul_(beta2).add_((1 - beta2) * g * g)
            p.data -= alpha * m / (torch.sqrt(v) + self.eps)


def build_model(cfg: ModelConfig, device, dtype=torch.bfloat16) -> Transformer:
    """The reference model in its training dtype (bf16 by default), initialized on ``device``
    (an 8B model's fp32 initialization on the host alone takes minutes)."""
    with torch.device(device):
        return Transformer(cfg).to(dtype=dtype)
