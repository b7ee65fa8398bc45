"""The reference model's loss compiled piece by piece, for its FSDP2 step only.

In one process ``compile_step`` finds and compiles any model's repeated blocks
(``capture/blocks.py``). Under FSDP2 the hooks around each block split the forward
there, and this spelled-out form is what keeps the reference model's LM head
and loss in one graph (``reference_fsdp.py``).

``BlockwiseLoss`` computes the same
``cross_entropy(model(inputs), targets).sum()`` from three compiled pieces:
the embedding lookup, a block's forward (one graph that every block reuses:
Dynamo keys it on the code, and the parameters are graph inputs), and the
final norm, LM head and loss in one graph, so the cross-entropy pass still
sees the projection and the loss together. The glue between the pieces is a
Python loop over the blocks; no tensor op runs outside compiled code.

The price: this spells out the reference ``Transformer.forward`` (embedding,
blocks, norm, head), so it serves models of that structure only.
"""
import torch
import torch.nn as nn

from compile_stack.workloads.reference import Transformer, cross_entropy
from custom_ops.checks import require


class BlockwiseLoss(nn.Module):
    """``cross_entropy(model(inputs), targets).sum()`` from separately compiled pieces."""

    def __init__(self, model: Transformer):
        super().__init__()
        require(isinstance(model, Transformer), "model", "a compile_stack.workloads.reference.Transformer", type(model).__name__)
        self.model = model
        self.embed = self._embed
        self.head_loss = self._head_loss

    def _embed(self, inputs):
        return self.model.embedding[inputs]

    def _head_loss(self, x, targets):
        return cross_entropy(self.model.lm_head(self.model.norm(x)), targets).sum()

    def compile_pieces(self, backend) -> None:
        """Compile the embedding, each block's forward and the head + loss with ``backend``."""
        self.embed = torch.compile(self._embed, backend=backend, fullgraph=True)
        self.head_loss = torch.compile(self._head_loss, backend=backend, fullgraph=True)
        for block in self.model.blocks:
            block.forward = torch.compile(block.forward, backend=backend, fullgraph=True)

    def forward(self, inputs, targets):
        x = self.embed(inputs)
        for block in self.model.blocks:
            x = block(x)
        return self.head_loss(x, targets)
