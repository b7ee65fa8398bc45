"""The plan a decoder's step takes on a machine, from the estimate's sizes, before anything is built.

``run_step.py`` knows the config, so it can decide fit-or-refuse before any
allocation or compile, with the same levers the per-graph plan
(``partitioner.py``) then applies from measured sizes, in order of cost:

1. the activation memory budget: the largest whose saved activations fit the
   GPU beside the state (``estimate.py``), i.e. the least recomputation;
2. activation offload: where a larger budget's plan fits once part of it is
   in pinned host memory (within ``host.py``'s share), that plan; a layer's
   input stays on the GPU (a graph input), and one layer's moved values are
   copied back ahead (counted on the GPU);
3. recomputation: what the kept plan recomputes against the budget-1.0 plan.

Not built yet (said in the plan): releasing each gradient during the
backward (the state's 4th copy; the estimate's peak is at the backward's
start, before any block's gradient exists, so it would not lower it) and the
optimizer's moments in host memory.
"""
import dataclasses

from compile_stack.memory_plan import host
from compile_stack.memory_plan.estimate import DecoderShape, compiled_fixed_bytes, saved_bytes
from compile_stack.memory_plan.fit import Shortfall
from compile_stack.memory_plan.sizes import GIB, USABLE_FRACTION

BUDGETS = tuple(b / 50 for b in range(50, -1, -1))  # 1.0 down to 0, the estimate's resolution


@dataclasses.dataclass(frozen=True)
class Machine:
    """A device's memory and its host's, in bytes (``available``: free now)."""

    gpu: float
    host_total: float
    host_available: float
    ranks_per_host: int = 1


@dataclasses.dataclass(frozen=True)
class Levers:
    """The chosen plan in bytes: ``budget``, what stays ``on_gpu`` and goes ``to_host`` of the saved
    activations, what is ``recomputed`` (budget 1.0's saved bytes the plan does not keep), the
    host share offered, and the GPU estimate; ``shortfall`` is set when nothing fits."""

    budget: float
    on_gpu: float
    to_host: float
    recomputed: float
    host_share: float
    peak: float
    shortfall: Shortfall | None = None

    @property
    def fits(self) -> bool:
        return self.shortfall is None

    def describe(self) -> str:
        gib = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
        if not self.fits:
            return self.shortfall.message()
        return (f"plan: activation memory budget {self.budget:.2f}: {gib(self.on_gpu)} of saved activations on the "
                f"GPU, {gib(self.to_host)} in host memory (offload, of {gib(self.host_share)} offered), "
                f"{gib(self.recomputed)} recomputed in the backward; estimated GPU peak {gib(self.peak)}; "
                "not applied: gradient release during the backward, optimizer state in host memory (not built)")


def _movable(cfg: DecoderShape, budget: float, nbytes: int, world: int) -> float:
    """What of the plan at ``budget`` may move: all but each layer's input (a graph input) and the
    per-token statistics (too small)."""
    tokens = cfg.tokens / world
    kept = cfg.layers * tokens * (cfg.d_model * nbytes + cfg.heads * 4 + 8)
    return max(0.0, saved_bytes(cfg, budget, nbytes, world) - kept)


def offered_host_bytes(machine: Machine, offload: bool | float | None, world: int = 1) -> float:
    """Host bytes offload may take: none when off (and by default under torchrun), a float share of the
    physical memory, else the default share of what is free (``host.py``)."""
    if offload is False or (offload is None and world > 1):
        return 0.0
    if isinstance(offload, float):
        return offload * machine.host_total
    return host.default_host_bytes(int(machine.host_total), int(machine.host_available), machine.ranks_per_host)


def choose(cfg: DecoderShape, machine: Machine, offload: bool | float | None = None, nbytes: int = 2,
           world: int = 1) -> Levers:
    """The least-recomputing plan of the compiled step that fits ``machine`` (module docstring)."""
    usable = USABLE_FRACTION * machine.gpu
    beside, at_end = compiled_fixed_bytes(cfg, nbytes, world)
    room = usable - beside
    offered = offered_host_bytes(machine, offload, world)
    everything = saved_bytes(cfg, 1.0, nbytes, world)
    for budget in BUDGETS:
        saved = saved_bytes(cfg, budget, nbytes, world)
        movable = min(_movable(cfg, budget, nbytes, world), offered)
        ahead = movable / cfg.layers if movable else 0.0  # one layer's copies back, started ahead
        to_host = min(movable, max(0.0, saved - room + ahead)) if saved > room else 0.0
        on_gpu = saved - to_host + (ahead if to_host else 0.0)
        if on_gpu <= room and usable >= at_end:
            return Levers(budget, saved - to_host, to_host, everything - saved, offered, beside + on_gpu)
    least = saved_bytes(cfg, 0.0, nbytes, world)
    working = beside - 3 * cfg.params * nbytes / world - (cfg.vocab + cfg.tokens / world) * cfg.d_model * nbytes
    shortfall = Shortfall("the compiled step", least, _movable(cfg, 0.0, nbytes, world), room, offered or
                          host.default_host_bytes(int(machine.host_total), int(machine.host_available)),
                          usable, beside - working, working, offered > 0)
    return Levers(0.0, least, 0.0, everything - least, offered, beside + least, shortfall)
