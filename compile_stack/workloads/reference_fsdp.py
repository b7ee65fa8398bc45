"""The reference model's data-parallel train step over N processes: FSDP2 sharding, our passes and ops.

    torchrun --nproc-per-node 2 run_step.py --compile

Each rank takes batch/world sequences of the global batch. Parameters,
gradients and AdamW moments are sharded across the ranks (ZeRO-3) with
FSDP2's ``fully_shard``: one FSDP group per Block, and the root group (the
embedding, the final norm and the LM head). FSDP2 all-gathers a group's
parameters before its forward and again before its backward, and
reduce-scatters its gradients after; it issues these on its own streams, and
we prefetch the next group, so communication runs under compute.

Where compilation stops, and why:

- FSDP2's hooks stay eager: they run around each group's forward. Compiled
  are each Block's ``forward`` (one Dynamo graph per block and its
  AOTAutograd backward; all blocks share one compiled graph), the embedding
  lookup, and the head with the loss — ``cross_entropy(lm_head(norm(x)), y)``
  in ONE graph, so our fused LM-head + cross-entropy pass still applies.
  These are ``regional.BlockwiseLoss``'s pieces, which spell out the
  model's forward (embedding, blocks, norm, head): the structure
  docs/reference.md §2 fixes.
- The optimizer runs on the local shards. Dynamo cannot trace ``p.data -= …``
  on a DTensor (``set_`` fails under fake tensors, before any pass of ours
  runs), and on plain tensors our AdamW pass and kernel see the update.
  ``LocalShards`` gives the optimizer tensors that alias each DTensor
  parameter's local shard, and hands them the local gradient shard before
  every step; in-place updates land in FSDP2's sharded storage.

Semantics: each rank's loss is the mean over its own tokens, FSDP2 averages
gradients over the ranks, so with equal shares per rank the gradient is the
full-batch mean's and AdamW sees exactly it. The step returns the loss
averaged over ranks: the full-batch loss.
"""
import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from compile_stack.capture.optimizer_step import CompiledOptimizerStep
from compile_stack.capture.step import StepOptions, backend_factory
from compile_stack.distributed.sharding import full_params, mean_over_ranks, shard_groups
from compile_stack.workloads.reference import Transformer
from compile_stack.workloads.regional import BlockwiseLoss
from custom_ops.checks import require


def shard_model(model: Transformer, reshard_after_forward: bool = True) -> BlockwiseLoss:
    """Shard ``model`` in place with FSDP2 (a group per block, then the root); return the root.

    Every rank must pass the same weights; rank 0's are broadcast to make sure.
    Blocks prefetch their neighbour's parameters (the next block in forward,
    the previous one in backward) so its all-gather overlaps this block's compute.
    """
    require(isinstance(model, Transformer), "model", "a compile_stack.workloads.reference.Transformer", type(model).__name__)
    return shard_groups(list(model.blocks), BlockwiseLoss(model), reshard_after_forward)


class LocalShards:
    """Plain tensors aliasing each DTensor parameter's local shard, for the optimizer.

    Made after the first backward (FSDP2 settles its sharded storage at its
    lazy init, in the first forward). ``load_grads`` gives each alias its local
    gradient shard.
    """

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        with torch.no_grad():
            self.tensors = [p.to_local().detach() for p in params]

    def load_grads(self) -> None:
        with torch.no_grad():
            for p, t in zip(self.params, self.tensors):
                local = p.to_local()
                if local.data_ptr() != t.data_ptr():
                    raise RuntimeError("FSDP2 moved a parameter's local shard; the optimizer's alias is stale")
                # detach(): a non-view alias. FSDP2's gradient shards are views into one reduce-scatter
                # buffer; as views Dynamo would trace them from that buffer, with symbolic offsets.
                t.grad = None if p.grad is None else p.grad.to_local().detach()


class DistributedTrainStep:
    """Callable ``step(inputs, targets) -> loss`` on this rank's batch share; returns the global loss.

    ``model`` is the unsharded model (same weights on every rank; it is
    sharded in place); ``make_optimizer(tensors)`` builds the optimizer over
    the local shards (e.g. ``reference.AdamW``); ``options`` say how to
    compile (None: eager).
    """

    def __init__(self, model: Transformer, make_optimizer: Callable, options: StepOptions | None,
                 reshard_after_forward: bool = True):
        require(callable(make_optimizer), "make_optimizer", "a callable building the optimizer from tensors",
                type(make_optimizer).__name__)
        self.sharded = shard_model(model, reshard_after_forward)
        self.make_optimizer = make_optimizer
        self.shards = None
        self.optimizer = None
        self.optimizer_step = None
        self.backend = None
        self.optimizer_backend = None
        if options is not None:
            backend = backend_factory(options, inspect=dist.get_rank() == 0)
            self.backend, self.optimizer_backend = backend(name="model"), backend(name="optimizer")
            self.sharded.compile_pieces(self.backend)

    def _build_optimizer(self) -> None:
        self.shards = LocalShards(list(self.sharded.parameters()))
        self.optimizer = self.make_optimizer(self.shards.tensors)
        self.optimizer_step = self.optimizer.step
        if self.optimizer_backend is not None:
            self.optimizer_step = CompiledOptimizerStep(self.optimizer, self.optimizer_backend).call

    def __call__(self, inputs, targets):
        with self.backend.active() if self.backend else contextlib.nullcontext():
            self.sharded.zero_grad(set_to_none=True)
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            loss = self.sharded(inputs, targets)
            loss.backward()
        if self.optimizer is None:
            self._build_optimizer()
        self.shards.load_grads()
        self.optimizer_step()
        return mean_over_ranks(loss)


def gather_full_params(step_or_model) -> dict[str, torch.Tensor]:
    """Full parameters by the unsharded model's names (a collective: call on every rank)."""
    root = step_or_model.sharded if isinstance(step_or_model, DistributedTrainStep) else step_or_model
    require(isinstance(root, BlockwiseLoss) and isinstance(root, FSDPModule), "step_or_model",
            "a DistributedTrainStep or the BlockwiseLoss shard_model returned", type(root).__name__)
    return full_params(root.model)
