"""Fit or refuse: the one message of a step that does not fit, with what would.

A plan that does not fit is refused at once, before Inductor compiles the
graph (``partitioner.py``) or, in ``run_step.py``, before anything is built
(``estimate.py``), instead of warning and running out of memory after the
compile. The message says what is needed, what the GPU and the host have,
and what would fit: activation offload where it is off and would, and the
share of the tokens per step (a smaller batch or sequence) that would, the
saved activations and working set being taken to scale with the tokens.
"""
import dataclasses

from compile_stack.memory_plan.sizes import GIB


class MemoryPlanError(RuntimeError):
    """The step's memory plan does not fit the device (the message says what would)."""

    def __init__(self, shortfall: "Shortfall"):
        super().__init__(shortfall.message())
        self.shortfall = shortfall


@dataclasses.dataclass(frozen=True)
class Shortfall:
    """A plan that does not fit, in bytes: ``saved`` is what the step's graph(s) keep for the backward
    at the least budget, ``movable`` the part of it that can travel through host memory,
    ``room`` what the GPU leaves for it, ``host`` what the host offers (0: offload off),
    ``usable``/``kept``/``working`` the GPU's usable memory, what the step keeps across steps and one
    backward's working set (``working`` also scales with the tokens)."""

    what: str
    saved: float
    movable: float
    room: float
    host: float
    usable: float
    kept: float
    working: float
    offload_on: bool

    def on_gpu(self, host: float) -> float:
        """What stays on the GPU with ``host`` bytes of the movable part in host memory."""
        return self.saved - min(self.movable, host)

    def token_share(self) -> float:
        """The share of the tokens per step at which the plan would fit, offloading within the host
        share if it is on (0 if even no tokens would: the state alone is too big)."""
        per_token = self.on_gpu(self.host if self.offload_on else 0) + self.working
        free = self.room + self.working
        return max(0.0, min(1.0, free / per_token)) if per_token > 0 else 1.0

    def message(self) -> str:
        gib = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
        offloaded = min(self.movable, self.host) if self.offload_on else 0
        text = (f"{self.what} does not fit: it saves {gib(self.saved)} for the backward even at the least "
                f"activation memory budget ({gib(offloaded)} of it in host memory), the GPU leaves "
                f"{gib(self.room)} for it (of {gib(self.usable)} usable: {gib(self.kept)} parameters, optimizer "
                f"state, gradients and the step's other saved activations, {gib(self.working)} one backward's working set); host memory for offload "
                f"{gib(self.host) if self.offload_on else 'none (offload off)'}.")
        fixes = []
        if not self.offload_on and self.on_gpu(self.host) <= self.room:
            fixes.append("activation offload (offload_activations=None, the default)")
        share = self.token_share()
        if share > 0:
            fixes.append(f"at most {share:.2f}× the tokens per step (a smaller batch or sequence)")
        else:
            fixes.append("a GPU with more memory or the model sharded over several (its state alone does not fit)")
        return f"{text} Would fit: {'; or '.join(fixes)}."
