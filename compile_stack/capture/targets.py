"""Out-of-range targets: our fused ops flag them on the device, and nothing raises until the flags are read.

The fused cross-entropy gives a bad target's rows NaN and sets a per-device
flag; the fused AdamW skips its update while that flag is set, or on a bad
lr/step. Reading the flags is a host sync on a GPU, so a step must not read
them every call: ``TargetsCheck`` reads them only once an earlier call has
finished on the device, and the error comes at a later call.
"""
import torch

from custom_ops import adamw as adamw_op
from custom_ops import linear_cross_entropy as lce_op


def raise_on_bad_targets() -> None:
    """Raise the ValueError for a bad target (or a refused AdamW update) seen since the last check.

    Reads the flags: a host sync on a GPU; call it where the step synced anyway."""
    lce_op.check_targets_flag()
    adamw_op.raise_if_refused()


class TargetsCheck:
    """``raise_on_bad_targets`` for a step called in a loop, without a sync of its own.

    ``after_call`` records a CUDA event (one at a time); ``before_call`` reads the
    flags only once that event says the calls before it have finished on the GPU,
    so the read waits for no step's work. On a CPU (CUDA never used) every call
    reads them: free.
    """

    def __init__(self):
        self.finished: torch.cuda.Event | None = None

    def before_call(self) -> None:
        if self.finished is None or self.finished.query():
            self.finished = None
            raise_on_bad_targets()

    def after_call(self) -> None:
        if self.finished is None and torch.cuda.is_initialized():
            self.finished = torch.cuda.Event()
            self.finished.record()
