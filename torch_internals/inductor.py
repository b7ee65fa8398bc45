"""Inductor internals: compile entry points, config, graph-pass hooks, caches, code output."""
import contextlib
import hashlib
import platform

import torch

from torch._inductor import config as _config
from torch._inductor import cpp_builder, cpu_vec_isa
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
           "cache_dir", "forget_vec_isas", "vec_isas_answered", "vec_isa_host", "probe_vec_isas",
           "assume_vec_isas", "output_code_writer"]


def config_patch(options: dict | None = None, **more) -> contextlib.AbstractContextManager:
    """Inductor's config changed for a ``with`` block."""
    return _config.patch({**(options or {}), **more})


def cache_dir() -> str:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR`` or its default)."""
    return cache_dir_utils.cache_dir()


def forget_vec_isas() -> None:
    """Forget what Inductor found of the host's vector ISAs: its list, each ISA's build check,
    and the AVX-512 classes' own answers, which they keep per ISA whatever ``cpp.vec_isa_ok``
    says when next asked."""
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    answers = [getattr(cpu_vec_isa.VecISA, "_VecISA__bool__impl", None)]
    answers += [type(isa).__bool__ for isa in cpu_vec_isa.supported_vec_isa_list]
    for answer in answers:
        if (cache_clear := getattr(answer, "cache_clear", None)) is not None:
            cache_clear()


def vec_isas_answered() -> bool:
    """Whether Inductor answers for the host's vector ISAs without its probe in this process:
    found or assumed already, or set by its ``cpp.vec_isa_ok``."""
    return _config.cpp.vec_isa_ok is not None or cpu_vec_isa.valid_vec_isa_list.cache_info().currsize > 0


def vec_isa_host() -> dict:
    """What Inductor's probe of the host's vector ISAs depends on: the torch build, the C++
    compiler (its path and version) and what the CPU reports of itself."""
    compiler = cpp_builder.get_cpp_compiler()
    version = cpp_builder.get_compiler_version_info(compiler)
    return {"torch": torch.__version__, "machine": platform.machine(), "compiler": compiler,
            "compiler_version": hashlib.sha256(version.encode()).hexdigest()[:16],
            "cpu": {k: str(v) for k, v in sorted(torch.cpu.get_capabilities().items())}}


def probe_vec_isas() -> list[str]:
    """The host's vector ISAs as Inductor finds them (a build and a Python process per ISA, once
    per process), by name."""
    return [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]


def assume_vec_isas(valid: list[str]) -> None:
    """Inductor's answer for the host's vector ISAs set to ``valid`` (names ``probe_vec_isas``
    gave) without its probe: each ISA's build check answers from ``valid``; the CPU's own flags
    still decide, as in Inductor's probe."""
    forget_vec_isas()
    check_build = cpu_vec_isa.VecISA.check_build
    cpu_vec_isa.VecISA.check_build = lambda isa, code: str(isa) in valid
    try:
        cpu_vec_isa.valid_vec_isa_list()
    finally:
        cpu_vec_isa.VecISA.check_build = check_build


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
