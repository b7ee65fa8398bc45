"""FSDP2-sharded models in a compiled step: FSDP2's hooks run eagerly, around compiled pieces.

Traced as it stands, a model sharded with ``fully_shard`` breaks Dynamo's graph
at every sharded module's call (the hooks are skipped code), so the root's
forward and the loss land in different graphs and the LM head's cross-entropy
is not fused. Instead, while the compiled step runs, the sharded modules'
forward hooks are hidden from Dynamo and run by us:

- the root's pre-forward (lazy init, the root group's all-gather) before the
  compiled step is called, so Dynamo traces the root's forward, the loss and
  everything between as one graph over the root's unsharded parameters;
- each sharded block's pre- and post-forward around its compiled forward, at
  run time, inside its block-call node (``blocks.py``): the block's all-gather,
  reshard and backward hooks are FSDP2's own;
- the root's post-forward after the last block's (it only registers FSDP2's
  backward bookkeeping; the root does not reshard after forward).

FSDP2's private entry points come from ``torch_internals.fsdp``.
"""
import contextlib

import torch

from torch_internals import fsdp
from torch_internals.fx import detect_fake_mode, tree_leaves

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


state_of = fsdp.state_of


def only_fsdp_hooks(module: torch.nn.Module) -> bool:
    """A module sharded by ``fully_shard`` whose only hooks (its own and its children's) are FSDP2's."""
    state = state_of(module)
    if state is None:
        return False
    for m in module.modules():
        own = state_of(m)
        hooks = [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]
        if m._backward_hooks or m._backward_pre_hooks or any(getattr(h, "__self__", None) is not own for h in hooks):
            return False
        if own is not None and m is not module:
            return False  # a sharded module inside the block: its hooks would need running as well
    return True


@contextlib.contextmanager
def hooks_hidden(modules):
    """While active, the forward hooks of ``modules`` are not there for Dynamo to see (nor run)."""
    saved = [(getattr(m, name), dict(getattr(m, name))) for m in modules for name in _HOOK_DICTS]
    for hooks, _ in saved:
        hooks.clear()
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.clear()
            hooks.update(items)


def unsharded_fakes(block: torch.nn.Module, args) -> dict[str, torch.Tensor]:
    """Fake tensors for ``block``'s parameters as its forward sees them, unsharded (full shape, the
    mixed-precision policy's dtype), and its buffers, in the fake mode of ``args``."""
    mode = detect_fake_mode(tree_leaves(args))
    dtype = fsdp.param_dtype(state_of(block))
    with mode:
        fakes = {n: torch.empty(p.shape, dtype=dtype or p.dtype, device=p.device, requires_grad=p.requires_grad)
                 for n, p in block.named_parameters()}
    fakes.update({n: mode.from_tensor(b) for n, b in block.named_buffers()})
    return fakes


def with_hooks(compiled, last: bool):
    """``compiled(block, *args, **kwargs)`` inside ``block``'s FSDP2 pre- and post-forward; after the
    ``last`` block's, the root's post-forward too."""

    def run(block, *args, **kwargs):
        state = state_of(block)
        args, kwargs = fsdp.pre_forward(state, block, args, kwargs)
        output = fsdp.post_forward(state, block, args, compiled(block, *args, **kwargs))
        root = fsdp.forward_root(state)
        if last and root is not None and root is not state:
            output = fsdp.root_post_forward(root, output)
        return output

    return run


class ShardedRoot:
    """A model ``fully_shard`` was applied to last (the root), run by a compiled step."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.state = state_of(model)
        # Every parameter sharded, as the optimizer holds them (before the first pre-forward unshards the root's).
        self.sharded = list(model.parameters())

    def before_step(self) -> None:
        """The root's pre-forward: its group all-gathered for the step's forward, traced or not."""
        fsdp.pre_forward(self.state, self.model, (), {})

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``model.zero_grad()`` while the root is unsharded: the sharded gradients too."""
        type(self.model).zero_grad(self.model, set_to_none)
        for p in self.sharded:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def routed(self):
        return hooks_hidden([self.model])
