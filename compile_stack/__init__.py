"""compile-stack: a user's own train step, compiled with our passes and kernels.

    import compile_stack
    train_step = compile_stack.compile_step(train_step)

``compile_step`` takes the step function as written (zero-grad, forward,
loss, backward, optimizer step) and returns a callable that behaves the same.
``Backend`` is the ``torch.compile`` backend it uses, for compiling any other
function with our passes: ``torch.compile(fn, backend=compile_stack.Backend())``.
``shard(model)`` shards a model with FSDP2 by its repeated blocks, for a step
run under ``torchrun`` (a model the user sharded with ``fully_shard`` is found as it is).

Importing the package turns on the caching allocator's ``expandable_segments``
unless ``PYTORCH_CUDA_ALLOC_CONF`` is already set: the memory plan fills the
device to within 5%, which fragmentation would break (a full-size step ran out
of memory without it). CUDA reads the variable at its first allocation, so
import the package before allocating.

The package by job: ``capture/`` (the user's step into graphs), ``backend/``
(Inductor with our passes), ``memory_plan/`` (what each graph saves),
``distributed/`` (torchrun and FSDP2), ``caches.py`` (where compiled artifacts
live); ``workloads/`` and ``harness/`` are example user code and run_step.py's
phases, which use the package as a user does.
"""
import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from compile_stack.backend import PassBackend as Backend
from compile_stack.capture.step import CompiledStep, compile_step
from compile_stack.distributed import shard
from passes import registry


def pass_report(step: CompiledStep | Backend | None = None) -> dict:
    """What our passes replaced in ``step``'s graphs so far (None: the step compiled or run last),
    per pass (a block's graph counts once per block that calls it), and notes on what they saw
    but left alone."""
    if step is not None and not isinstance(step, (CompiledStep, Backend)):
        raise TypeError(f"step: expected a CompiledStep (from compile_step) or a Backend, got {type(step).__name__}")
    report = registry.current() if step is None else step.report
    return {"replacements": report.as_dict(registry.pass_names()), "notes": list(report.notes)}


__all__ = ["Backend", "CompiledStep", "compile_step", "pass_report", "shard"]
