"""Inductor internals: compile entry points, config, graph-pass hooks, caches, code output."""
import contextlib

from torch._inductor import config as _config
from torch._inductor import cpu_vec_isa
from torch._inductor.compile_fx import compile_fx, graph_returns_tuple, make_graph_return_tuple
from torch._inductor.custom_graph_pass import CustomGraphPass, CustomPartitionerFn, get_hash_for_files
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.fx_passes.joint_graph import early_patterns
from torch._inductor.fx_passes.post_grad import remove_noop_ops
from torch._inductor.graph import GraphLowering
from torch._inductor.pattern_matcher import stable_topological_sort
from torch._inductor.runtime import cache_dir_utils

__all__ = ["compile_fx", "graph_returns_tuple", "make_graph_return_tuple", "CustomGraphPass",
           "CustomPartitionerFn", "get_hash_for_files", "select_decomp_table", "early_patterns",
           "remove_noop_ops", "stable_topological_sort", "config_patch",
           "cache_dir", "forget_vec_isas", "output_code_writer"]


def config_patch(options: dict | None = None, **more) -> contextlib.AbstractContextManager:
    """Inductor's config changed for a ``with`` block."""
    return _config.patch({**(options or {}), **more})


def cache_dir() -> str:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR`` or its default)."""
    return cache_dir_utils.cache_dir()


def forget_vec_isas() -> None:
    """Forget what Inductor found of the host's vector ISAs: its list, and the AVX-512 classes'
    own answers, which they keep per ISA whatever ``cpp.vec_isa_ok`` says when next asked."""
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    for isa in cpu_vec_isa.supported_vec_isa_list:
        if (cache_clear := getattr(type(isa).__bool__, "cache_clear", None)) is not None:
            cache_clear()


@contextlib.contextmanager
def output_code_writer(write):
    """While active, Inductor hands the source of each graph's output code to ``write(code)``
    instead of its own (debug-only) saver."""
    previous = GraphLowering.save_output_code
    GraphLowering.save_output_code = staticmethod(write)
    try:
        yield
    finally:
        GraphLowering.save_output_code = previous
