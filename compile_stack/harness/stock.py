"""``--compare stock``: the step a PyTorch user would build from stock parts.

Same model and weights layout as the reference (it runs on a reference
``Transformer``'s parameters), computed the way the stock anchor of
docs/reference.md §4 is: ``torch.compile`` per block, ``F.scaled_dot_product_attention``,
activation checkpointing per block, the LM head and cross-entropy in
checkpointed token chunks, and ``torch.optim.AdamW(fused=True)``. Its
optimizer is torch's (eps inside the bias correction), as a stock user's
would be; the comparison is of speed and memory, not of bit-equal updates.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from compile_stack.distributed.sharding import mean_over_ranks, shard_groups
from compile_stack.workloads.reference import Block, Transformer

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


class StockBlock(nn.Module):
    """One block as a stock user runs it: the compiled block function, checkpointed.

    A module of its own so that FSDP2 can make it one sharding group, with the
    checkpoint inside the group (its recomputation sees the gathered weights).
    """

    def __init__(self, block: Block, block_fn):
        super().__init__()
        self.block = block
        self.block_fn = block_fn

    def forward(self, x):
        return checkpoint(self.block_fn, self.block, x, use_reentrant=False)


class StockLoss(nn.Module):
    """``loss(inputs, targets)``: the model's mean token loss, spelled with stock parts.

    It holds the model's pieces, not the model: every path to a block then runs
    through its ``StockBlock``, which FSDP2 needs to see each block in one group only.
    """

    def __init__(self, model: Transformer, backend: str = "inductor"):
        super().__init__()
        self.embedding, self.norm, self.lm_head = model.embedding, model.norm, model.lm_head
        block_fn = torch.compile(_block_forward, backend=backend)
        self.blocks = nn.ModuleList(StockBlock(block, block_fn) for block in model.blocks)

    def _chunk_loss(self, hidden, targets):
        logits = F.linear(hidden, self.lm_head.weight).float()
        return F.cross_entropy(logits, targets, reduction="sum")

    def forward(self, inputs, targets):
        x = self.embedding[inputs]
        for block in self.blocks:
            x = block(x)
        hidden = self.norm(x).flatten(0, 1)
        targets = targets.flatten()
        total = sum(
            checkpoint(self._chunk_loss, hidden[i : i + CE_CHUNK_TOKENS], targets[i : i + CE_CHUNK_TOKENS], use_reentrant=False)
            for i in range(0, hidden.shape[0], CE_CHUNK_TOKENS)
        )
        return total / hidden.shape[0]


class StockStep:
    """``step(inputs, targets) -> loss`` with stock PyTorch parts on ``model``'s parameters.

    ``sharded=True`` (under torchrun): FSDP2 shards the model as ours is sharded
    (a group per block, then the root), each rank steps on its share of the batch,
    and the step returns the loss averaged over the ranks. ``backend`` compiles the blocks.
    """

    def __init__(self, model: Transformer, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 sharded: bool = False, backend: str = "inductor"):
        self.loss = StockLoss(model, backend)
        if sharded:
            self.loss = shard_groups(list(self.loss.blocks), self.loss)
        self.sharded = sharded
        fused = next(model.parameters()).is_cuda
        self.optimizer = torch.optim.AdamW(
            self.loss.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused
        )

    def __call__(self, inputs, targets):
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(inputs, targets)
        loss.backward()
        self.optimizer.step()
        return mean_over_ranks(loss) if self.sharded else loss
