"""Compile settings chosen for a cold start within the 10-minute budget.

- One cache directory for everything compiled (Inductor's FX-graph and
  AOTAutograd caches, and Triton's kernel cache): ``$COMPILE_STACK_CACHE``,
  default ``~/.cache/compile_stack``. ``use_cache_dir(fresh=True)`` deletes what
  the package put there first (``CACHE_SUBDIRS``), for a measured cold start;
  anything else in the directory is left alone.
- No max-autotune: Inductor's default heuristics; our own kernels use fixed
  tile tables instead of autotuning.
- A GPU graph's C++ kernels get no vector ISA (``cpp.vec_isa_ok``): they are
  scalar bookkeeping (Python floats Inductor turned into 0-d CPU tensors, such
  as an optimizer's bias correction), and Inductor's probe of the host's ISAs
  (a build and a Python process per ISA) cost ~30 s of every start on the H200.
- ``activation_memory_budget`` (AOTAutograd's min-cut partitioner) is how the
  step trades memory for recomputation: 1.0 saves what the partitioner likes,
  lower values recompute more.
- What the package records beside the caches for a later start (pass reports,
  plan records, host buffers) is small JSON, written atomically
  (``write_record``) and read as None when missing or damaged (``read_record``).
"""
import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch._inductor import cpu_vec_isa

CACHE_ENV = "COMPILE_STACK_CACHE"


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "compile_stack"))


# What the package creates under the cache directory: Inductor's caches (with the pass
# records compile_stack/capture.py keeps beside them) and Triton's kernel cache.
# ``use_cache_dir(fresh=True)`` deletes these and nothing else.
CACHE_SUBDIRS = ("inductor", "triton")


def _delete(path: Path) -> None:
    """Remove one cache entry: a directory tree, or a file or link (never followed)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def use_cache_dir(path: Path | None = None, fresh: bool = False) -> Path:
    """Point Inductor's and Triton's caches at ``path`` (their old entries deleted first if ``fresh``).

    ``fresh`` deletes only the package's own subfolders (``CACHE_SUBDIRS``), so
    pointing ``--cache-dir`` at a directory that holds other files loses none.
    A path that is not a writable directory raises ValueError naming ``cache_dir``.
    Must run before the first compile: both read the variables when they first
    need a cache directory.
    """
    path = Path(path).expanduser() if path is not None else default_cache_dir()
    expected = "a writable directory (compile caches are written there)"
    if path.exists() and not path.is_dir():
        raise ValueError(f"cache_dir: expected {expected}, got {str(path)!r}, which is not a directory")
    try:
        if fresh:
            for sub in CACHE_SUBDIRS:
                _delete(path / sub)
        for sub in ("inductor", "triton"):
            (path / sub).mkdir(parents=True, exist_ok=True)
        # mkdir succeeds on existing read-only directories: write a file in each to be sure.
        for where in (path, path / "inductor", path / "triton"):
            with tempfile.TemporaryFile(dir=where):
                pass
    except OSError as e:
        raise ValueError(f"cache_dir: expected {expected}, got {str(path)!r} ({e})") from e
    os.environ[CACHE_ENV] = str(path)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    return path


def write_record(path: Path, data) -> None:
    """``data`` as JSON at ``path`` beside the caches, atomically (ranks of a distributed run share
    the directory); nothing where it cannot be written: a record only spares a later start work."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def read_record(path: Path):
    """The JSON a ``write_record`` left at ``path``; None if there is none or it does not parse."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


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


def forget_vec_isas() -> None:
    """Forget what Inductor found of the host's vector ISAs: its list, and the AVX-512 classes'
    own answers, which they keep per ISA whatever ``cpp.vec_isa_ok`` says when next asked."""
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    for isa in cpu_vec_isa.supported_vec_isa_list:
        if (cache_clear := getattr(type(isa).__bool__, "cache_clear", None)) is not None:
            cache_clear()


@contextlib.contextmanager
def inductor_config(on_gpu: bool = False):
    """``inductor_options(on_gpu)`` in force. Inductor remembers the host's vector ISAs for the
    process once it has looked; a GPU graph looks afresh (finding none, without the probe) and
    its look is forgotten after it, so a CPU graph compiled later in the process still gets its
    vector ISA."""
    if on_gpu:
        forget_vec_isas()
    try:
        with torch._inductor.config.patch(inductor_options(on_gpu)):
            yield
    finally:
        if on_gpu:
            forget_vec_isas()


def on_gpu(example_inputs) -> bool:
    """Whether a graph's inputs include a tensor on a GPU (CUDA)."""
    return any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)


# At exactly 0 the partitioner saves only the graph's inputs, ignoring the
# must-save marks our passes put on their ops' outputs (so it would recompute
# attention); the smallest positive budget keeps the marks and saves nothing else.
LEAST_BUDGET = 1e-6


@contextlib.contextmanager
def memory_budget(budget: float | None):
    """Set AOTAutograd's activation memory budget (None: leave the default)."""
    if budget is None:
        yield
        return
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"memory_budget: expected a fraction in [0, 1], got {budget}")
    with torch._functorch.config.patch(activation_memory_budget=max(budget, LEAST_BUDGET)):
        yield
