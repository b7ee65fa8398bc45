"""The activation memory budget chosen per graph: the least recomputation that fits.

``compile_step``'s default when no ``memory_budget`` is given, on a GPU. A
user's step does not say how big its model is, so the choice is made where
the sizes are known: at each graph's partition. The joint forward+backward
is partitioned at budget 1.0 first (save what the partitioner likes); if what
the forward then saves, times the call sites sharing the graph (every block
of a model), does not fit what the ledger leaves (``ledger.py``), the budget
is searched down by bisection and the largest plan that fits is kept. Each
trial partitions a copy of the joint graph, so the plan used is one that was
measured, not predicted.

With activation offload on (``offload.py``), a graph whose fitting plan
recomputes matmuls compares the plans of larger budgets: each fits once
enough of its saved values travel through the host instead, within the
ledger's host memory, and the one recomputing the fewest matmul FLOPs is
kept; the backward's copies started ahead count in its working set.

A graph with several call sites that does not fit at budget 1.0 leaves what
one call site's least plan keeps on the device (its input: 0.53 GiB of the
full preset's block) to the graphs planned after it (the piece after the
blocks saves the last block's output, and moves the rest); what it leaves
unused goes to its richer share below. Where even the least plan does not fit
(offload tried), the step is refused with one message (``fit.py``), before
Inductor compiles anything of the graph.

A graph with several call sites keeps the plans it tried: once every graph
of the step has its plan, ``settle_share`` gives what is left over to the
last call sites as a plan recomputing less (``share.py``).
"""
import hashlib
from collections.abc import Iterable
from pathlib import Path

import torch

from compile_stack.memory_plan import host, ledger, offload, records, share
from compile_stack.memory_plan.fit import MemoryPlanError, Shortfall
from compile_stack.memory_plan.ledger import MemoryLedger
from compile_stack.memory_plan.share import Candidates, Plan, Share, richer_share
from compile_stack.memory_plan.sizes import tensor_bytes
from passes.graph_edit import copy_module
from torch_internals import aot, inductor

# At exactly 0 the partitioner saves only the graph's inputs, ignoring the
# must-save marks our passes put on their ops' outputs (so it would recompute
# attention); the smallest positive budget keeps the marks and saves nothing else.
LEAST_BUDGET = 1e-6
# Bisection steps below 1.0: the budget is found to 1/64.
SEARCH_STEPS = 6
# The budgets whose plans an offloading graph compares with its fitting plan (above its budget).
OFFLOAD_BUDGETS = tuple(b / 20 for b in range(20, 0, -1))


def saved_bytes(backward: torch.fx.GraphModule, static_inputs: Iterable[int] = ()) -> int:
    """Bytes a partition's forward keeps for its backward: the backward's inputs but the
    incoming gradients and the graph inputs that live anyway (parameters, buffers)."""
    lives_anyway = {f"primals_{i + 1}" for i in static_inputs}
    return sum(tensor_bytes(n.meta.get("val")) for n in offload.saved_inputs(backward)
               if n.name not in lives_anyway)


def plan_code_hash() -> str:
    """A hash of the code that decides a graph's memory plan (this file, ledger.py, offload.py,
    share.py) and of records.py, whose records of a plan a warm start reads back under this
    identity."""
    code = b"".join(Path(m.__file__).read_bytes() for m in (ledger, offload, records, share))
    return hashlib.sha256(Path(__file__).read_bytes() + code).hexdigest()


class BudgetedPartitioner(inductor.CustomPartitionerFn):
    """The min-cut partitioner at the largest budget whose plan fits the ledger.

    ``uses``: call sites sharing the graph; its saved bytes count that many
    times. ``key`` names the graph in the ledger (a recompile of the same
    graph replaces its reservation). The cache identity covers this file,
    ``uses``, the device's capacity and the state the step keeps (allocated
    now and still to come, to the GiB): for a given graph, which is in
    Inductor's key already, these decide the plan, so a warm start finds the
    plan its cold start chose. With ``richer``, the plan of a share of the call
    sites, and that share in the identity.
    """

    def __init__(self, ledger: MemoryLedger, key: str, uses: int = 1, richer: Share | None = None):
        self.ledger = ledger
        self.key = key
        self.uses = uses
        # A compile of the graph for the call sites of ``richer`` (share.py): that plan, its
        # memory already reserved by the graph's own compile.
        self.richer = richer
        self.chosen: float | None = None  # the budget of the plan kept
        self.available = 0  # the bytes that plan had to fit
        self.fits = True
        self.offloaded = 0  # bytes of saved activations moved to host memory (all uses)
        self.candidates: Candidates | None = None  # for settle_share, after the partition
        self.held_back = 0  # bytes left to the graphs planned after this one

    def __call__(self, gm: torch.fx.GraphModule, joint_inputs, **kwargs):
        static = kwargs.get("static_lifetime_input_indices") or ()
        user_outputs = kwargs["num_fwd_outputs"]
        trials: dict[float, Plan] = {}

        def plan(budget: float):
            with aot.config_patch(activation_memory_budget=budget):
                parts = aot.min_cut_rematerialization_partition(copy_module(gm), joint_inputs, **kwargs)
            trials[budget] = Plan(parts, budget, saved_bytes(parts[1], static))
            return parts, trials[budget].saved * self.uses

        if self.richer is not None and (parts := self._richer_plan(plan, user_outputs)) is not None:
            return parts  # its memory is in the graph's own compile's reservation
        best, best_budget = plan(1.0), 1.0
        working = best[1] // self.uses
        available = self.available = self.ledger.available(self.key, working)
        moved = []
        if best[1] > available:
            lo, hi = LEAST_BUDGET, 1.0
            best, best_budget = plan(lo), lo
            if self.uses > 1:  # room for the graphs planned after (module docstring)
                movable = offload.movable_values(*best[0], user_outputs, self.ledger.device)
                self.held_back = best[1] // self.uses - offload.value_bytes(movable)
                available = self.available = self._room(working)
            self.fits = best[1] <= available
            for _ in range(SEARCH_STEPS if self.fits else 0):
                mid = (lo + hi) / 2
                trial = plan(mid)
                if trial[1] <= available:
                    best, best_budget, lo = trial, mid, mid
                else:
                    hi = mid
            if self.ledger.host_capacity:
                # Where even the least plan does not fit, any plan that fits once some of it is in
                # host memory is taken, the one recomputing the least.
                offloading = self._offloading_plan(plan, best, best_budget, working, user_outputs, self.fits)
                if offloading is not None:
                    parts, best_budget, moved, on_gpu = offloading
                    best, self.fits = (parts, on_gpu), True
            if not self.fits:
                raise MemoryPlanError(self._shortfall(best[0], best[1], working, user_outputs))
        if self.richer is None and self.fits and self.uses > 1:
            others = [p for b, p in sorted(trials.items()) if b > best_budget]
            self.candidates = Candidates.of(trials[best_budget], moved, others, working, user_outputs)
        offload.apply(*best[0], moved)
        self.chosen = best_budget
        if self.richer is not None:  # not the graph the share was chosen for: a plan fitting what is left
            return best[0]
        self.offloaded = offload.value_bytes(moved) * self.uses
        self.ledger.reserve(self.key, best[1], working + offload.value_bytes(moved), self.offloaded)
        return best[0]

    def settle_share(self) -> Share | None:
        """The richer plan for some of the graph's call sites in what the step's plans leave over
        (called once every graph of the step has its plan), its memory reserved; None if none."""
        if self.candidates is None:
            return None
        found = richer_share(self.candidates, self.uses, self.ledger.device,
                                        lambda w: self.ledger.available(self.key, w),
                                        self.ledger.host_available(self.key))
        self.candidates = None  # the partitions it held
        if found is None:
            return None
        share, working = found
        book = self.ledger
        book.reserve(self.key, book.reserved[self.key] + share.uses * share.extra, working,
                     book.host_reserved[self.key] + share.uses * share.extra_host)
        return share

    def _richer_plan(self, plan, user_outputs: int):
        """The partition of ``self.richer``, edited to move its values; None if this graph's
        partition at its budget does not have them (not the graph it was chosen for)."""
        share = self.richer
        parts, saved = plan(share.budget)
        moved = [n for n in offload.movable_values(*parts, user_outputs, self.ledger.device) if n.name in share.moved]
        if len(moved) != len(share.moved) or saved // self.uses - offload.value_bytes(moved) != share.saved:
            return None
        offload.apply(*parts, moved)
        self.chosen = share.budget
        return parts

    def _offloading_plan(self, plan, fitting, low: float, working: int, user_outputs: int, fits: bool = True):
        """Among the plans of budgets OFFLOAD_BUDGETS above ``low``, the one whose backward
        recomputes the fewest matmul FLOPs once enough of its saved values move to the host for
        the rest to fit the GPU (``_moved_to_fit``), within the host's room: (its partition, its
        budget, the values to move, GPU bytes); None if no plan recomputes less than
        ``fitting``. Unless ``fitting`` ``fits``, the plan at ``low`` is a candidate too and any
        plan that fits is kept over it."""
        kept = offload.saved_names(fitting[0][1])
        best_flops, found = offload.matmul_flops(fitting[0][1]) if fits else float("inf"), None
        for budget in [b for b in OFFLOAD_BUDGETS if b > low] + ([] if fits else [low]):
            parts, on_gpu = plan(budget)
            flops = offload.matmul_flops(parts[1])
            fit = self._moved_to_fit(parts, on_gpu, kept, working, user_outputs) if flops < best_flops else None
            if fit is not None and offload.value_bytes(fit[0]) * self.uses <= self.ledger.host_available(self.key):
                best_flops, found = flops, (parts, budget, *fit)
        return found

    def _moved_to_fit(self, parts, on_gpu: int, kept: set[str], working: int, user_outputs: int):
        """The saved values of ``parts`` to move to the host so that the rest fits the GPU beside
        one call's moved values copied back ahead (in the working set): values ``kept`` (the
        fitting plan's) does not hold first, then the others, largest first. (moved, GPU bytes
        left), or None if moving all that can move is not enough."""
        movable = sorted(offload.movable_values(*parts, user_outputs, self.ledger.device),
                         key=lambda n: (n.name in kept, -offload.value_bytes([n])))
        moved = []
        while on_gpu > self._room(working + offload.value_bytes(moved)):
            if not movable:
                return None
            moved.append(movable.pop(0))
            on_gpu -= offload.value_bytes(moved[-1:]) * self.uses
        return moved, on_gpu

    def _room(self, working: int) -> int:
        """What this graph's plan may keep on the device, beside ``working``."""
        return self.ledger.available(self.key, working) - self.held_back

    def _shortfall(self, parts, saved: int, working: int, user_outputs: int) -> Shortfall:
        """What the least plan (``parts``, ``saved`` bytes for all uses) lacks, for the refusal."""
        book = self.ledger
        movable = offload.value_bytes(offload.movable_values(*parts, user_outputs, book.device)) * self.uses
        offload_on = book.host_capacity > 0
        others = sum(b for k, b in book.reserved.items() if k != self.key)
        return Shortfall(f"the step's graph {self.key!r}" + (f" ({self.uses} call sites)" if self.uses > 1 else ""),
                         saved, movable, self._room(working),
                         book.host_available(self.key) if offload_on else host.host_bytes(None),
                         book.capacity, book.kept() + others, max(book.working, working) + ledger.SCRATCH_BYTES,
                         offload_on)

    def __reduce__(self):
        # Inductor pickles its config into the cache key; this partitioner's part is its identity.
        return (str, (self.uuid(),))

    def uuid(self):
        state = self.ledger.kept() >> 30
        identity = f"{plan_code_hash()}:{self.uses}:{self.ledger.capacity:.0f}:{state}:{self.ledger.host_capacity}"
        return identity if self.richer is None else f"{identity}:richer:{self.richer}"
