"""compile-stack: a user's own train step, compiled with our passes and kernels.

    import compile_stack
    train_step = compile_stack.compile_step(train_step)

``compile_step`` takes the step function as written (zero-grad, forward,
loss, backward, optimizer step) and returns a callable that behaves the same.
``Backend`` is the ``torch.compile`` backend it uses, for compiling any other
function with our passes: ``torch.compile(fn, backend=compile_stack.Backend())``.

Importing the package turns on the caching allocator's ``expandable_segments``
unless ``PYTORCH_CUDA_ALLOC_CONF`` is already set: the memory plan fills the
device to within 5%, which fragmentation would break (a full-size step ran out
of memory without it). CUDA reads the variable at its first allocation, so
import the package before allocating.
"""
import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from compile_stack.capture import PassBackend as Backend
from compile_stack.user_step import CompiledStep, compile_step
from passes import registry


def pass_report() -> dict:
    """What our passes replaced in this process's compiles so far, per pass (a block's graph
    counts once per block that calls it), and notes on what they saw but left alone."""
    return {"replacements": registry.REPORT.as_dict(registry.pass_names()), "notes": list(registry.REPORT.notes)}


__all__ = ["Backend", "CompiledStep", "compile_step", "pass_report"]
