"""Compile settings chosen for a cold start within the 10-minute budget.

- One cache directory for everything compiled (Inductor's FX-graph and
  AOTAutograd caches, and Triton's kernel cache): ``$COMPILE_STACK_CACHE``,
  default ``~/.cache/compile_stack``. ``use_cache_dir(fresh=True)`` empties it
  first, for a measured cold start.
- No max-autotune: Inductor's default heuristics; our own kernels use fixed
  tile tables instead of autotuning.
- ``activation_memory_budget`` (AOTAutograd's min-cut partitioner) is how the
  step trades memory for recomputation: 1.0 saves what the partitioner likes,
  lower values recompute more.
"""
import contextlib
import os
import shutil
from pathlib import Path

import torch

CACHE_ENV = "COMPILE_STACK_CACHE"


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "compile_stack"))


def use_cache_dir(path: Path | None = None, fresh: bool = False) -> Path:
    """Point Inductor's and Triton's caches at ``path`` (emptied first if ``fresh``).

    Must run before the first compile: both read the variables when they first
    need a cache directory.
    """
    path = Path(path) if path is not None else default_cache_dir()
    if fresh and path.exists():
        shutil.rmtree(path)
    (path / "inductor").mkdir(parents=True, exist_ok=True)
    (path / "triton").mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(path)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    return path


def inductor_options() -> dict:
    """Inductor config for our compiles (merged into torch.compile's ``options``)."""
    return {
        "max_autotune": False,
        "fx_graph_cache": True,
        # Compile Triton kernels in parallel worker processes.
        "compile_threads": max(1, min(32, os.cpu_count() or 1)),
    }


# At exactly 0 the partitioner saves only the graph's inputs, ignoring the
# must-save marks our passes put on their ops' outputs (so it would recompute
# attention); the smallest positive budget keeps the marks and saves nothing else.
_LEAST_BUDGET = 1e-6


@contextlib.contextmanager
def memory_budget(budget: float | None):
    """Set AOTAutograd's activation memory budget (None: leave the default)."""
    if budget is None:
        yield
        return
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"memory_budget: expected a fraction in [0, 1], got {budget}")
    with torch._functorch.config.patch(activation_memory_budget=max(budget, _LEAST_BUDGET)):
        yield
