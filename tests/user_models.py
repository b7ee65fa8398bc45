"""A user's own model, loss and optimizer, written plainly and independently of the package's
reference model: what ``run_step.py --model/--loss/--optimizer`` and the leaderboard harness load
in the tests (``tests.user_models:build_gpt`` and so on)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.tril(torch.ones(T, T, device=x.device))
        att = att.masked_fill(mask == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff)
        self.out = nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model, num_heads, d_ff):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, num_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, d_ff)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, context_length, d_model, num_layers, num_heads, d_ff):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(context_length, d_model)
        self.layers = nn.ModuleList([Block(d_model, num_heads, d_ff) for _ in range(num_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))


def build_gpt(vocab_size, context_length, d_model, num_layers, num_heads, d_ff):
    return GPT(vocab_size, context_length, d_model, num_layers, num_heads, d_ff)


def token_loss(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class MyAdamW(torch.optim.Optimizer):
    """AdamW as a course writes it: state created on the first step, in ``self.state[p]``."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["t"] = 0
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.zeros_like(p)
                state["t"] += 1
                t, m, v, g = state["t"], state["m"], state["v"], p.grad
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                step_size = group["lr"] * math.sqrt(1 - beta2**t) / (1 - beta1**t)
                p.data -= step_size * m / (v.sqrt() + group["eps"])
                p.data -= group["lr"] * group["weight_decay"] * p.data


# ---- an einops-style model, as another course writes it: RMSNorm, SwiGLU, RoPE, no biases ----

from einops import einsum, rearrange  # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, d_model, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class EinopsAttention(nn.Module):
    def __init__(self, d_model, num_heads, context_length, theta=10000.0):
        super().__init__()
        self.num_heads = num_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Parameter(torch.randn(d_model, d_model) / math.sqrt(d_model))
                                              for _ in range(4))
        d_head = d_model // num_heads
        freqs = theta ** (-torch.arange(0, d_head, 2).float() / d_head)
        angles = torch.outer(torch.arange(context_length).float(), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def rope(self, x):
        seq = x.shape[-2]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        cos, sin = self.cos[:seq], self.sin[:seq]
        return rearrange(torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1), "... d two -> ... (d two)")

    def forward(self, x):
        q, k, v = (rearrange(einsum(x, w, "b s d, e d -> b s e"), "b s (h k) -> b h s k", h=self.num_heads)
                   for w in (self.wq, self.wk, self.wv))
        q, k = self.rope(q), self.rope(k)
        scores = einsum(q, k, "b h s k, b h t k -> b h s t") / math.sqrt(q.shape[-1])
        seq = x.shape[1]
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=x.device), diagonal=1)
        weights = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        out = rearrange(einsum(weights, v, "b h s t, b h t k -> b h s k"), "b h s k -> b s (h k)")
        return einsum(out, self.wo, "b s e, d e -> b s d")


class SwiGLU(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(d_ff, d_model) / math.sqrt(d_model))
        self.w3 = nn.Parameter(torch.randn(d_ff, d_model) / math.sqrt(d_model))
        self.w2 = nn.Parameter(torch.randn(d_model, d_ff) / math.sqrt(d_ff))

    def forward(self, x):
        gate = einsum(x, self.w1, "... d, f d -> ... f")
        return einsum(F.silu(gate) * einsum(x, self.w3, "... d, f d -> ... f"), self.w2, "... f, d f -> ... d")


class EinopsBlock(nn.Module):
    def __init__(self, d_model, num_heads, d_ff, context_length):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(d_model), RMSNorm(d_model)
        self.attn = EinopsAttention(d_model, num_heads, context_length)
        self.ffn = SwiGLU(d_model, d_ff)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class EinopsLM(nn.Module):
    def __init__(self, vocab_size, context_length, d_model, num_layers, num_heads, d_ff):
        super().__init__()
        self.token_embeddings = nn.Parameter(torch.randn(vocab_size, d_model) * 0.02)
        self.blocks = nn.ModuleList(EinopsBlock(d_model, num_heads, d_ff, context_length) for _ in range(num_layers))
        self.final_norm = RMSNorm(d_model)
        self.output = nn.Parameter(torch.randn(vocab_size, d_model) / math.sqrt(d_model))

    def forward(self, token_ids):
        x = self.token_embeddings[token_ids]
        for block in self.blocks:
            x = block(x)
        return einsum(self.final_norm(x), self.output, "b s d, v d -> b s v")


def build_einops_lm(vocab_size, context_length, d_model, num_layers, num_heads, d_ff):
    return EinopsLM(vocab_size, context_length, d_model, num_layers, num_heads, d_ff)


def einops_loss(logits, targets):
    """Mean token cross-entropy over the flattened tokens."""
    return F.cross_entropy(rearrange(logits, "b s v -> (b s) v"), rearrange(targets, "b s -> (b s)"))


def build_sharded_gpt(vocab_size, context_length, d_model, num_layers, num_heads, d_ff):
    """``build_gpt`` sharded as the FSDP2 tutorial does it, when a process group is up: ``fully_shard``
    on each block, then on the root (the user's own sharding; compile_step finds it)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = build_gpt(vocab_size, context_length, d_model, num_layers, num_heads, d_ff)
    if dist.is_initialized():
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model
