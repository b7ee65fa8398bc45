"""``--compare stock``: the step a PyTorch user would build from stock parts.

Same model and weights layout as the reference (it runs on a reference
``Transformer``'s parameters), computed the way the stock anchor of
REFERENCE.md §4 is: ``torch.compile`` per block, ``F.scaled_dot_product_attention``,
activation checkpointing per block, the LM head and cross-entropy in
checkpointed token chunks, and ``torch.optim.AdamW(fused=True)``. Its
optimizer is torch's (eps inside the bias correction), as a stock user's
would be; the comparison is of speed and memory, not of bit-equal updates.
"""
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from compile_stack.reference import Block, Transformer

CE_CHUNK_TOKENS = 8192


def _block_forward(block: Block, x):
    attn = block.attn
    batch, seq, d_model = x.shape
    a = block.norm1(x)

    def heads(w):
        return F.linear(a, w).view(batch, seq, attn.heads, d_model // attn.heads).transpose(1, 2)

    q, k, v = attn.rope(heads(attn.q_proj.weight)), attn.rope(heads(attn.k_proj.weight)), heads(attn.v_proj.weight)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + F.linear(o.transpose(1, 2).reshape(batch, seq, d_model), attn.o_proj.weight)
    a = block.norm2(x)
    ffn = block.ffn
    return x + F.linear(F.silu(F.linear(a, ffn.w1.weight)) * F.linear(a, ffn.w3.weight), ffn.w2.weight)


class StockStep:
    """``step(inputs, targets) -> loss`` with stock PyTorch parts on ``model``'s parameters."""

    def __init__(self, model: Transformer, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        self.model = model
        self.block_fn = torch.compile(_block_forward)
        fused = next(model.parameters()).is_cuda
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused
        )

    def _chunk_loss(self, hidden, targets):
        logits = F.linear(hidden, self.model.lm_head.weight).float()
        return F.cross_entropy(logits, targets, reduction="sum")

    def loss(self, inputs, targets):
        model = self.model
        x = model.embedding[inputs]
        for block in model.blocks:
            x = checkpoint(self.block_fn, block, x, use_reentrant=False)
        hidden = model.norm(x).flatten(0, 1)
        targets = targets.flatten()
        total = sum(
            checkpoint(self._chunk_loss, hidden[i : i + CE_CHUNK_TOKENS], targets[i : i + CE_CHUNK_TOKENS], use_reentrant=False)
            for i in range(0, hidden.shape[0], CE_CHUNK_TOKENS)
        )
        return total / hidden.shape[0]

    def __call__(self, inputs, targets):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(inputs, targets)
        loss.backward()
        self.optimizer.step()
        return loss
