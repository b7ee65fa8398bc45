"""AOTAutograd internals: the boxed calling convention, the min-cut partitioner and its config,
its cache's check of a graph's nodes."""
import contextlib

import torch
from torch._functorch import config as _config
from torch._functorch._aot_autograd import autograd_cache as _autograd_cache
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

__all__ = ["make_boxed_func", "min_cut_rematerialization_partition", "config_patch", "cache_refusal"]


def config_patch(**options) -> contextlib.AbstractContextManager:
    """AOTAutograd's config (``activation_memory_budget``, ``force_non_lazy_backward_lowering``)
    changed for a ``with`` block."""
    return _config.patch(**options)


def cache_refusal(gm: torch.fx.GraphModule) -> str | None:
    """Why AOTAutograd's cache would bypass ``gm`` for one of its nodes, or None if it takes them."""
    try:
        for node in gm.graph.nodes:
            _autograd_cache.check_node_safe(node)
    except _autograd_cache.BypassAOTAutogradCache as e:
        return str(e)
    return None
