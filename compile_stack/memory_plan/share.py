"""Some of a shared graph's call sites on a richer plan: what one plan for all of them leaves over.

A block's graph serves every block, and partitioner.py picks one plan for all of
them: the one recomputing the least that fits the memory times the number of
blocks. What that leaves free is often less than one more saved value times
every block, but enough for that value in some of them: with offload at 0.88
of the H200 host, the full preset's block keeps 68 GiB on the GPU and 108 GiB
in host memory, and saving its O projection as well would take 17 GiB more
(34 × 512 MiB), 2.5 GiB of which is left once the head and loss have their
plan. So the last ``uses`` call sites (``CallSites.richer``) take a plan of a
larger budget that recomputes fewer matmul FLOPs (``Share``), its saved values
placed so that all fit beside the shared plan's: the same values in host
memory (its extra ones too where only the host has the room).

The share is settled once every graph of the step has its plan (after the
step's first call: a graph planned after the blocks must still fit), so from
the second call on those call sites run a second compile of the graph with
that plan (backend/pass_backend.py; capture/blocks.py and backend/segments.py route them). A warm start is served the
shared plan from the compile caches without partitioning: the share is
written beside them (records.py) and read back there.
"""
import dataclasses
from collections.abc import Callable

import torch.fx as fx

from compile_stack.memory_plan import offload


@dataclasses.dataclass
class CallSites:
    """The call sites one graph serves (``count``) and the richer plan of the last of them
    (``share``; settled after the step's first call)."""

    count: int
    share: "Share | None" = None

    @property
    def richer(self) -> int:
        """How many call sites take the richer plan."""
        return self.share.uses if self.share is not None else 0

    def takes_richer(self, position: int) -> bool:
        return position >= self.count - self.richer


@dataclasses.dataclass(frozen=True)
class Share:
    """The richer plan of ``uses`` call sites: the partition at ``budget`` with the saved values
    named ``moved`` in host memory; it keeps ``saved`` bytes on the device and ``host`` in host
    memory per call site, ``extra``/``extra_host`` more than the shared plan."""

    uses: int
    budget: float
    moved: tuple[str, ...]
    saved: int
    host: int
    extra: int
    extra_host: int


@dataclasses.dataclass
class Plan:
    """One partition of a joint graph as the share's search sees it."""

    parts: tuple[fx.GraphModule, fx.GraphModule]
    budget: float
    saved: int  # device bytes per call site, before any value moves to host memory


@dataclasses.dataclass
class Candidates:
    """What a graph's partition leaves for its share's search: the chosen plan (its device and
    host bytes per call site, the values it saves, those of them in host memory, the matmul
    FLOPs its backward recomputes), the plans of larger budgets, the working set of one call
    site less its moved values, and how many of the forward's outputs are the user's."""

    saved: int
    host: int
    names: set[str]
    moved: tuple[str, ...]
    flops: int
    others: list[Plan]
    working: int
    user_outputs: int

    @classmethod
    def of(cls, chosen: Plan, moved: list[fx.Node], others: list[Plan], working: int, user_outputs: int):
        """``chosen``'s candidates, ``moved`` to host memory (taken before the partition is edited)."""
        host = offload.value_bytes(moved)
        return cls(chosen.saved - host, host, offload.saved_names(chosen.parts[1]), tuple(n.name for n in moved),
                   offload.matmul_flops(chosen.parts[1]), others, working, user_outputs)


def richer_share(found: Candidates, uses: int, device, available: Callable[[int], int],
                 host_available: int) -> tuple[Share, int] | None:
    """The share of the ``uses`` call sites that saves the most matmul FLOPs in the memory the
    chosen plan leaves: (the share, its working set), or None if no plan helps.

    ``available(working)``: the device bytes the graph's plans may take beside a working set
    (``MemoryLedger.available``); ``host_available``: the host bytes they may take."""
    working = found.working
    host_free = host_available - uses * found.host
    best, best_gain = None, 0
    for plan in found.others:  # by budget, the smallest first: it wins a tie
        fewer = found.flops - offload.matmul_flops(plan.parts[1])
        if fewer <= 0:
            continue
        movable = offload.movable_values(*plan.parts, found.user_outputs, device)
        kept_there = [n for n in movable if n.name in found.moved]
        placements = [kept_there]
        if host_free > 0:  # its extra values in host memory as well
            placements.append(kept_there + [n for n in movable if n.name not in found.names])
        for there in placements:
            host = offload.value_bytes(there)
            saved, its_working = plan.saved - host, working + host
            free = available(max(its_working, working + found.host)) - uses * found.saved
            k = min(uses - 1, _fits(free, saved - found.saved), _fits(host_free, host - found.host))
            if k * fewer > best_gain:
                best_gain = k * fewer
                best = Share(k, plan.budget, tuple(n.name for n in there), saved, host,
                             saved - found.saved, host - found.host), its_working
    return best


def _fits(room: int, each: int) -> int:
    """How many of something taking ``each`` bytes fit ``room`` (any number if it takes none)."""
    if each <= 0:
        return 2**62
    return max(room, 0) // each
