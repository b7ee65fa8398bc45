"""Compile settings chosen for a cold start within the 10-minute budget.

- Inductor's FX-graph cache on, in the package's cache directory
  (``compile_stack/caches.py``).
- No max-autotune: Inductor's default heuristics; our own kernels use fixed
  tile tables instead of autotuning.
- A GPU graph's C++ kernels get no vector ISA (``cpp.vec_isa_ok``): they are
  scalar bookkeeping (Python floats Inductor turned into 0-d CPU tensors, such
  as an optimizer's bias correction), and Inductor's probe of the host's ISAs
  (a build and a Python process per ISA) cost ~30 s of every start on the H200.
  A CPU graph's kernels get the ISAs that probe finds, probed once per cache
  directory (``vec_isas.py``).
- ``activation_memory_budget`` (AOTAutograd's min-cut partitioner) is how the
  step trades memory for recomputation: 1.0 saves what the partitioner likes,
  lower values recompute more.
"""
import contextlib
import os

import torch

from compile_stack.memory_plan.options import check_memory_budget
from compile_stack.memory_plan.partitioner import LEAST_BUDGET
from torch_internals import aot, inductor

def inductor_options(on_gpu: bool = False) -> dict:
    """Inductor config for our compiles; ``on_gpu``: for a graph whose inputs live on a GPU."""
    options = {
        "max_autotune": False,
        "fx_graph_cache": True,
        # Compile Triton kernels in parallel worker processes.
        "compile_threads": max(1, min(32, os.cpu_count() or 1)),
    }
    if on_gpu:
        options["cpp.vec_isa_ok"] = False  # no ISA probe for its scalar C++ kernels (module docstring)
    return options


@contextlib.contextmanager
def inductor_config(on_gpu: bool = False):
    """``inductor_options(on_gpu)`` in force. Inductor remembers the host's vector ISAs for the
    process once it has looked; a GPU graph looks afresh (finding none, without the probe) and
    its look is forgotten after it, so a CPU graph compiled later in the process still gets its
    vector ISA."""
    if on_gpu:
        inductor.forget_vec_isas()
    try:
        with inductor.config_patch(inductor_options(on_gpu)):
            yield
    finally:
        if on_gpu:
            inductor.forget_vec_isas()


def on_gpu(example_inputs) -> bool:
    """Whether a graph's inputs include a tensor on a GPU (CUDA)."""
    return any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)


@contextlib.contextmanager
def memory_budget(budget: float | None):
    """Set AOTAutograd's activation memory budget (None: leave the default)."""
    if budget is None:
        yield
        return
    check_memory_budget(budget)
    with aot.config_patch(activation_memory_budget=max(budget, LEAST_BUDGET)):
        yield
