"""Fake tensors, pytree, FX graph-module internals, op overloads and the C bindings we read."""
import torch
from torch._guards import detect_fake_mode
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

__all__ = ["detect_fake_mode", "OpOverload", "is_fake", "unset_fake_temporarily", "tree_flatten",
           "tree_leaves", "tree_unflatten", "get_data_attr", "set_grad_enabled", "sym_sqrt",
           "storage_use_count", "force_recompile"]

# ``param.data`` as Dynamo records it in a graph (a call of this function).
get_data_attr = torch._C._autograd._get_data_attr
# ``torch.no_grad()`` / ``enable_grad`` as Dynamo records them in a graph.
set_grad_enabled = torch._C._set_grad_enabled
# ``math.sqrt`` of a symbolic float as Dynamo records it.
sym_sqrt = torch._sym_sqrt


def storage_use_count(tensor: torch.Tensor) -> int:
    """How many references hold ``tensor``'s storage (the one this call makes included)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def force_recompile(gm: torch.fx.GraphModule) -> None:
    """Give a lazily generated graph module its code now (a lazy module's code changes at its first
    call, which fails the guards Dynamo took on it)."""
    _LazyGraphModule.force_recompile(gm)
