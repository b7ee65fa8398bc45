"""AOTAutograd internals: the boxed calling convention, the min-cut partitioner and its config."""
import contextlib

from torch._functorch import config as _config
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

__all__ = ["make_boxed_func", "min_cut_rematerialization_partition", "config_patch"]


def config_patch(**options) -> contextlib.AbstractContextManager:
    """AOTAutograd's config (``activation_memory_budget``, ``force_non_lazy_backward_lowering``)
    changed for a ``with`` block."""
    return _config.patch(**options)
