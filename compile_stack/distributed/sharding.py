"""FSDP2 sharding by the model's repeated blocks, and the loss and parameters over ranks."""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from compile_stack.capture.blocks import block_list
from custom_ops.checks import require


def shard_groups(blocks: list[nn.Module], root: nn.Module, reshard_after_forward: bool = True) -> nn.Module:
    """``fully_shard`` each of ``blocks`` (each prefetching its neighbour), then ``root``; return it.

    The blocks must be submodules of ``root``. Rank 0's weights are broadcast first.
    ``reshard_after_forward`` is the blocks'. The root keeps FSDP2's own rule, no reshard after
    forward: its forward spans the whole model's and its backward needs its parameters at once, so
    resharding them in between freed nothing at the peak and gathered the embedding and LM head
    (2.5 GB in bf16 at the full size) again for nothing.
    """
    require(dist.is_initialized(), "model", "a process group set up first (setup_distributed())", "none")
    with torch.no_grad():
        for t in [*root.parameters(), *root.buffers()]:
            dist.broadcast(t, src=0)
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    for prev, nxt in zip(blocks, blocks[1:]):
        prev.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([prev])
    return fully_shard(root)


def mean_over_ranks(loss: torch.Tensor) -> torch.Tensor:
    """Each rank's mean loss over its equal share of the batch, averaged: the full batch's loss."""
    total = loss.detach().clone()
    dist.all_reduce(total)  # SUM: gloo has no AVG
    return total / dist.get_world_size()


def shard(model: nn.Module, reshard_after_forward: bool = True) -> nn.Module:
    """Shard any model in place with FSDP2: a group per repeated block (``blocks.block_list``),
    then the root; return it. ``compile_step`` then runs the hooks around its compiled pieces
    (``capture/fsdp_modules.py``), as for a model the user sharded with ``fully_shard`` themselves.
    Build the optimizer afterwards, over the sharded parameters."""
    require(isinstance(model, nn.Module), "model", "a torch.nn.Module", type(model).__name__)
    return shard_groups(block_list(model), model, reshard_after_forward)


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s parameters by name, each gathered whole (a collective: call on every rank)."""
    with torch.no_grad():
        return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for name, p in module.named_parameters()}
