"""FSDP2's per-module state: the hooks ``fully_shard`` registers, to run around compiled pieces.

``FSDPState`` keeps no public entry for its pre- and post-forward; ``capture/fsdp_modules.py`` runs
them itself, outside Dynamo's trace. Only names torch 2.11 and 2.13 share.
"""
import torch
from torch.distributed.fsdp import FSDPModule

__all__ = ["state_of", "pre_forward", "post_forward", "forward_root", "root_post_forward", "param_dtype"]


def state_of(module: torch.nn.Module):
    """The FSDP2 state of a module ``fully_shard`` was applied to, else None."""
    return module._get_fsdp_state() if isinstance(module, FSDPModule) else None


def pre_forward(state, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The module's FSDP2 pre-forward: the root's lazy init, the group's all-gather, backward hooks on the args."""
    return state._pre_forward(module, args, kwargs)


def post_forward(state, module, args: tuple, output):
    """The module's FSDP2 post-forward: reshard, pre-backward hooks on the output."""
    return state._post_forward(module, args, output)


def forward_root(state):
    """The state whose pre-forward started this forward (the root's), or None outside a forward."""
    return state._state_ctx.iter_forward_root


def root_post_forward(root, output):
    """The root's post-forward, on ``output`` (the root's module is its first)."""
    return root._post_forward(root._modules[0], (), output)


def param_dtype(state) -> torch.dtype | None:
    """The mixed-precision policy's compute dtype of the state's parameters (None: their own)."""
    return state._mp_policy.param_dtype
