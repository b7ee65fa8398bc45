"""One step's memory plan: the ledger, each graph's budget, shared-block plans, offload and pinning.

A compiled step on a GPU owns one ``MemoryPlan``; every backend of the step
(its model, blocks and optimizer graphs) asks it for a graph's partitioner and
tells it what each compile did, so the rules live here alone:

- a graph's budget: the largest whose plan fits what the ledger leaves
  (``partitioner.py``, ``ledger.py``), activation offload within the plan's
  host share (``offload.py``);
- a graph served from the compile caches reserves what its partition decided
  when it was planned (``records.py``);
- once the step's first call has compiled every graph, the last call sites of
  a shared graph take a richer plan in what is left over (``share.py``), and
  each partition's outcome is recorded for the next start;
- an offloading step's pinned host buffers are limited to the host share and
  remembered for the next start (``host_pinning.py``).

``notes()`` explains the plan: what each graph saves, on the device and in
host memory, at which budget.
"""
import dataclasses

import torch

from compile_stack.memory_plan import host_pinning, records
from compile_stack.memory_plan.ledger import MemoryLedger
from compile_stack.memory_plan.partitioner import BudgetedPartitioner
from compile_stack.memory_plan.share import CallSites
from custom_ops.activation_offload import TRANSFERS
from passes.registry import note

GIB = 2**30


@dataclasses.dataclass
class GraphPlan:
    """One graph's compile as the plan follows it: its name and ledger key, the partitioner (and
    its cache identity, taken before the compile reserved anything), the call sites it serves, and
    the record it was served with from the caches (if it was)."""

    name: str
    key: str
    identity: str
    partitioner: BudgetedPartitioner
    sites: CallSites
    record: records.PlanRecord | None = None


class MemoryPlan:
    """The memory plan of one compiled step on one device (module docstring)."""

    def __init__(self, ledger: MemoryLedger):
        self.ledger = ledger
        self._unsettled: list[GraphPlan] = []  # compiled since the last settle()
        self._notes: list[str] = []
        self._pinning: str | None = None  # the first call's host-buffer key, while it runs
        self._summarized = False
        if self.offloading:
            TRANSFERS.pool.limit(ledger.host_capacity)

    @classmethod
    def for_step(cls, optimizers: list, models: list, host_bytes: int = 0,
                 accumulates: bool = False) -> "MemoryPlan | None":
        """The plan of a step whose parameters live on one GPU (its saved activations may also take
        ``host_bytes`` of the host's memory; with ``accumulates``, its gradients live through its
        forwards); None on a CPU (the partitioner's own default budget applies there)."""
        params = [p for m in models for p in m.parameters()]
        params += [p for opt in optimizers for g in getattr(opt, "param_groups", ()) for p in g["params"]]
        devices = {p.device for p in params if isinstance(p, torch.Tensor)}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            return None
        accumulating = list({id(p): p for p in params if isinstance(p, torch.Tensor)}.values()) if accumulates else None
        return cls(MemoryLedger.for_device(next(iter(devices)), optimizers, host_bytes, accumulating))

    @property
    def offloading(self) -> bool:
        """Whether saved activations may move to host memory."""
        return self.ledger.host_capacity > 0

    def graph(self, name: str, key: str, sites: CallSites, richer: bool = False) -> GraphPlan:
        """The partitioner of graph ``name`` (ledger ``key``) serving ``sites``; ``richer``: its
        compile for the call sites of the share it was given (memory reserved by its first)."""
        partitioner = BudgetedPartitioner(self.ledger, key, sites.count, richer=sites.share if richer else None)
        return GraphPlan(name, key, partitioner.uuid(), partitioner, sites)

    def compiled(self, graph: GraphPlan) -> None:
        """``graph``'s first compile is done: partitioned (its plan noted) or served from the caches
        (the recorded plan reserved again, before the graphs traced after it plan)."""
        if graph.partitioner.chosen is not None:
            self._note_budget(graph)
        else:
            graph.record = record = records.recall(graph.key, graph.identity)
            if record is not None:
                self.ledger.reserve(graph.key, record.saved, record.working, record.host)
        self._unsettled.append(graph)

    def step_starts(self, args: tuple, models: list, first: bool) -> None:
        """A call of the step begins: what it keeps across steps is counted as of now; the first
        call starts pinning the host buffers the same step needed last time (under its tracing)."""
        self.ledger.at_step_start()
        if first and self.offloading and torch.cuda.is_available():
            self._pinning = host_pinning.step_key(args, models, self.ledger.capacity, self.ledger.host_capacity)
            host_pinning.pin_remembered(self._pinning)

    def step_ended(self) -> None:
        """A call of the step is done: every graph it compiled has its plan, so the shares are
        settled (``settle``) and the first call's host buffers remembered."""
        self.settle()
        if self._pinning is not None:
            host_pinning.remember(self._pinning)
            self._pinning = None

    def settle(self) -> None:
        """Give the graphs compiled since the last call their richer call sites (share.py), in what
        every graph's plan leaves over, and record each partition's outcome for the next start
        (records.py). A graph served from the caches takes the share the compile that
        partitioned it chose."""
        book = self.ledger
        for graph in self._unsettled:
            if graph.partitioner.chosen is not None:
                share = graph.partitioner.settle_share()
                records.remember(graph.key, graph.identity, records.PlanRecord(
                    book.reserved[graph.key], book.workings[graph.key], book.host_reserved[graph.key], share))
            else:
                share = graph.record.share if graph.record is not None else None
            graph.sites.share = share
            if share is not None:
                self._note(f"the last {share.uses} of {graph.name}'s {graph.sites.count} call sites take the "
                           f"plan of activation memory budget {share.budget:.3g}: "
                           f"{share.uses * share.saved / GIB:.2f} GiB on the device and "
                           f"{share.uses * share.host / GIB:.2f} GiB in host memory for them")
        self._unsettled.clear()
        if not self._summarized and book.reserved:
            self._summarized = True
            self._note(self.summary())

    def summary(self) -> str:
        """The plan in GiB per lever: what the device keeps, what the saved activations take on it and
        in host memory (of the host share offered), and the levers not built yet."""
        book = self.ledger
        gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
        host = (f"{gib(sum(book.host_reserved.values()))} in host memory (activation offload, of "
                f"{gib(book.host_capacity)} offered: the host's free memory less the reserve, or the share given)"
                if self.offloading else "none in host memory (activation offload off)")
        return (f"plan: of {gib(book.capacity)} usable on the device, {gib(book.kept())} is kept across steps "
                f"(parameters, optimizer state); saved activations {gib(sum(book.reserved.values()))} on the device, "
                f"{host}; the rest is recomputed (the budgets above); not applied: gradient release during "
                "the backward, optimizer state in host memory (not built)")

    @property
    def settled(self) -> bool:
        """Whether every graph compiled so far has had its share settled."""
        return not self._unsettled

    def notes(self) -> list[str]:
        """What the plan decided, graph by graph, in the order it decided it."""
        return list(self._notes)

    def _note(self, message: str) -> None:
        self._notes.append(message)
        note("memory", message)  # the pass report shows the plan too

    def _note_budget(self, graph: GraphPlan) -> None:
        partitioner, uses = graph.partitioner, graph.sites.count
        saved = self.ledger.reserved[graph.key] / GIB
        where = f"{graph.name} saves {saved:.2f} GiB for its backward" + (f" ({uses} call sites)" if uses > 1 else "")
        if partitioner.offloaded:
            where += f" and {partitioner.offloaded / GIB:.2f} GiB in host memory"
        self._note(f"{where} at activation memory budget {partitioner.chosen:.3g}")
