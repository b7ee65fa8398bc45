"""The torch.compile backend: Inductor with our passes installed.

``PassBackend`` is handed to ``torch.compile(backend=...)`` (it is the public
``compile_stack.Backend``). For each graph Dynamo captures it compiles with
Inductor while our passes sit in Inductor's hooks; by default each backward is
compiled with its forward, so nothing else need be held open for the passes
to reach it. With ``outline_blocks`` it first splits a captured graph at its
repeated blocks (``blocks.py``). It keeps the pass report true across warm
starts: when Inductor's caches serve a graph our passes do not run, so the
backend stores each graph's counts and notes (with a digest) under a key of
the graph's code and the passes' identity, replays them on a cache hit, and
reports the counts unknown where no valid record exists.

``PassBackend(codegen=False)`` runs the same stages on the same graphs —
our pre-grad passes, AOTAutograd with Inductor's decompositions, our joint
passes before the min-cut partitioner, our post-grad passes — but executes
the resulting aten graphs as they are instead of generating code. Tests use
it to check graph rewrites in seconds; it is also a debugging aid.
"""
import contextlib
import functools
import hashlib
import json
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.compile_fx import compile_fx, graph_returns_tuple, make_graph_return_tuple
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.runtime import cache_dir_utils

from compile_stack import blocks, input_masks, inspection, plan_records, plan_share, settings
from compile_stack.grad_release import grads_set_to_none, releasing_grads
from compile_stack.budget import BudgetedPartitioner, MemoryLedger
from passes import registry
from passes.graph_edit import copy_module


class PassBackend:
    """A torch.compile backend running our passes inside Inductor."""

    def __init__(
        self,
        passes: list[str] | None = None,
        writer: inspection.InspectionWriter | None = None,
        memory_budget: float | None = None,
        name: str = "graph",
        codegen: bool = True,
        outline_blocks: bool = False,
        backward_now: bool = True,
        uses: int = 1,
        ledger: MemoryLedger | None = None,
    ):
        self.pass_list = registry.resolve(passes)
        self.outline_blocks = outline_blocks
        # True: compile each backward with its forward, so our passes and settings apply to it
        # without the caller holding ``active()`` open. False: at the first backward(), which must
        # then run inside ``active()`` (compile_step's call does).
        self.backward_now = backward_now
        # The call sites each graph serves (a block's graph: one per block); replacements are
        # counted that many times, and the last ``sites.richer`` of them may take a richer plan.
        self.sites = plan_share.CallSites(uses)
        # Graphs compiled with a partitioner since the last settle_shares, whose share and record
        # are still to settle: (graph name, ledger key, partitioner identity, partitioner, call
        # sites, the record a graph served from the caches reserved).
        self.unsettled: list[tuple[str, str, str, BudgetedPartitioner, plan_share.CallSites,
                                   plan_records.PlanRecord | None]] = []
        self.memory_budget = memory_budget
        # Without a fixed budget, each graph's budget is chosen to fit this ledger (budget.py).
        self.ledger = ledger if memory_budget is None else None
        self.name = name
        self.codegen = codegen
        self.graphs = 0  # graphs compiled
        self.captures = 0  # captured graphs cut into segments (blocks.outline)
        self.writer = writer

    @contextlib.contextmanager
    def active(self, on_gpu: bool = False):
        """Our passes, settings and inspection hooks in force (``on_gpu``: for a graph on a GPU).

        The step runs inside this too: AOTAutograd may compile a backward
        graph lazily, at the first ``backward()``.
        """
        observer = self.writer.observer() if self.writer else None
        with (
            registry.installed([p.name for p in self.pass_list], observer, stages=("joint", "post_grad")),
            settings.memory_budget(self.memory_budget),
            settings.inductor_config(on_gpu),
            inspection.capture_output_code(self.writer),
        ):
            yield

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        released = grads_set_to_none(gm)  # before a pass edits the graph's inputs
        if self.outline_blocks:
            segmented = blocks.outline(gm, self._compile)
            if segmented is not None:
                if self.writer:  # the graph Dynamo captured, before it was cut
                    self.writer.begin_graph(f"{self.name}.captured{self.captures}", gm)
                self.captures += 1
                return releasing_grads(segmented, released)
        return releasing_grads(self._compile(gm, example_inputs, self.sites), released)

    def richer(self, gm: torch.fx.GraphModule, example_inputs):
        """A backend compiling each graph for its richer call sites (``self.sites.richer``)."""
        return self._compile(gm, example_inputs, self.sites, richer=True)

    def _compile(self, gm: torch.fx.GraphModule, example_inputs, sites: plan_share.CallSites, richer: bool = False):
        """Compile one graph for ``sites``; its replacements count once per call site. ``richer``:
        a second compile of it for the call sites given a richer plan (their memory is reserved,
        and the graph's passes counted, by the first)."""
        graph_name = f"{self.name}{self.graphs}"
        self.graphs += 1
        report = registry.REPORT
        runs_before, counts_before, notes_before = Counter(report.runs), Counter(report.replacements), len(report.notes)
        if self.writer:
            self.writer.begin_graph(graph_name, gm)
        masks = input_masks.find(gm, example_inputs)
        captured = copy_module(gm) if masks else None  # as captured, for a call whose masks no longer hold
        self._prepare(gm, masks)
        # Inspecting: the backward's code is filed under this graph only if compiled now.
        backward_now = torch._functorch.config.patch(
            force_non_lazy_backward_lowering=self.backward_now or self.writer is not None)
        partitioner = key = identity = None
        if self.ledger is not None:
            key = f"{self.name}:{self._report_key(gm).stem}"
            partitioner = BudgetedPartitioner(self.ledger, key, sites.count, richer=sites.share if richer else None)
            identity = partitioner.uuid()  # before the compile reserves, as Inductor's cache key has it
        compile_graph = functools.partial(compile_fx if self.codegen else self._compile_without_codegen,
                                          **({} if self.codegen else {"partitioner": partitioner}))
        # An offloaded activation is read by a copy on a side stream after its last reader on the
        # main stream, and may come back to the backward as it is: the transfers hold the tensor
        # (custom_ops/activation_offload/transfers.py), but Inductor's in-graph reuse of a freed
        # buffer would write into it.
        offloading = self.ledger is not None and self.ledger.host_capacity > 0
        with (self.active(settings.on_gpu(example_inputs)), backward_now,
              torch._inductor.config.patch(custom_partitioner_fn=partitioner,
                                           **({"allow_buffer_reuse": False} if offloading else {}))):
            if graph_returns_tuple(gm):
                compiled = compile_graph(gm, example_inputs)
            else:  # a segment returning one value
                compiled = make_graph_return_tuple(gm, example_inputs, compile_graph)
        if richer:  # the first compile's passes and notes stand for both
            report.replacements, report.notes[:] = counts_before, report.notes[:notes_before]
        else:
            if partitioner is not None:
                record = None
                if partitioner.chosen is not None:
                    self._note_budget(graph_name, partitioner, sites.count)
                elif (record := plan_records.recall(key, identity)) is not None:  # served from the caches
                    self.ledger.reserve(key, record.saved, record.working, record.host)
                self.unsettled.append((graph_name, key, identity, partitioner, sites, record))
            self._settle_report(gm, runs_before, counts_before, notes_before, sites.count)
        return input_masks.MaskGuard(compiled, captured, masks, graph_name) if masks else compiled

    def _prepare(self, gm: torch.fx.GraphModule, masks: dict) -> None:
        """Our pre-grad passes, run here rather than in Inductor's hook: AOTAutograd's cache checks
        the graph it is given, and refuses what Dynamo records for ``p.data`` updates (Tensor
        methods called as functions, a local version-counter function) that the ``param_data``
        pass rewrites; the rewritten graph keys the cache itself. Then the mask inputs rebuilt."""
        tensor_methods_as_method_calls(gm)
        observer = self.writer.observer() if self.writer else None
        registry.stage_passes(self.pass_list, observer)["pre_grad"](gm.graph)
        if masks:
            input_masks.rebuild(gm, masks)
        gm.recompile()

    def settle_shares(self) -> None:
        """Give the graphs compiled since the last call their richer call sites (plan_share.py), in
        what every graph's plan leaves over, and record each partition's outcome for the next
        start (plan_records.py): call once the step's graphs have all been compiled (after a call
        of it). A graph served from the caches takes the share the compile that partitioned it
        chose."""
        book = self.ledger
        for graph_name, key, identity, partitioner, sites, record in self.unsettled:
            if partitioner.chosen is not None:
                share = partitioner.settle_share()
                plan_records.remember(key, identity, plan_records.PlanRecord(
                    book.reserved[key], book.workings[key], book.host_reserved[key], share))
            else:
                share = record.share if record is not None else None
            sites.share = share
            if share is not None:
                registry.note("memory", f"the last {share.uses} of {graph_name}'s {sites.count} call sites take the "
                              f"plan of activation memory budget {share.budget:.3g}: "
                              f"{share.uses * share.saved / 2**30:.2f} GiB on the device and "
                              f"{share.uses * share.host / 2**30:.2f} GiB in host memory for them")
        self.unsettled.clear()

    def _note_budget(self, graph_name: str, partitioner: BudgetedPartitioner, uses: int) -> None:
        saved = partitioner.ledger.reserved[partitioner.key] / 2**30
        where = f"{graph_name} saves {saved:.2f} GiB for its backward" + (f" ({uses} call sites)" if uses > 1 else "")
        if partitioner.offloaded:
            where += f" and {partitioner.offloaded / 2**30:.2f} GiB in host memory"
        if partitioner.fits:
            registry.note("memory", f"{where} at activation memory budget {partitioner.chosen:.3g}")
        else:
            message = (f"{where} even at the least budget, more than the {partitioner.available / 2**30:.1f} GiB "
                       "estimated free for it: the step may run out of memory")
            registry.note("memory", message)
            warnings.warn(message, stacklevel=2)

    def _compile_without_codegen(self, gm, example_inputs, partitioner=None):
        observer = self.writer.observer() if self.writer else None
        stage = registry.stage_passes(self.pass_list, observer)

        def partition(joint, joint_inputs, **kwargs):
            stage["joint"](joint.graph)
            joint.recompile()
            return (partitioner or min_cut_rematerialization_partition)(joint, joint_inputs, **kwargs)

        def compile_graph(graph_module, inputs, is_inference=False):
            if is_inference:
                stage["joint"](graph_module.graph)
            stage["post_grad"](graph_module.graph)
            graph_module.recompile()
            return make_boxed_func(graph_module.forward)

        return aot_autograd(
            fw_compiler=compile_graph,
            bw_compiler=compile_graph,
            inference_compiler=functools.partial(compile_graph, is_inference=True),
            partition_fn=partition,
            decompositions=select_decomp_table(),
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    def _report_key(self, gm: torch.fx.GraphModule) -> Path:
        stages = [sp.uuid() for sp in registry.stage_passes(self.pass_list).values()]
        digest = hashlib.sha256(gm.code.encode() + b"".join(stages)).hexdigest()[:32]
        return report_dir() / f"{digest}.json"

    def _settle_report(self, gm, runs_before: Counter, counts_before: Counter, notes_before: int, uses: int) -> None:
        """This graph's replacements, counted once per segment that shares it, and its notes.

        Where a cache hit skipped a stage's passes, its counts and notes are replayed from the
        record the compile that ran them left; with no record, or one that is damaged or was
        edited (its digest no longer matches), those passes are reported unknown, never 0. Only
        a compile whose passes all ran writes the record.
        """
        report = registry.REPORT
        key = self._report_key(gm)
        record = _read_record(key)
        counts, replayed = {}, False
        for p in self.pass_list:
            if report.runs[p.stage] != runs_before[p.stage]:
                counts[p.name] = report.replacements[p.name] - counts_before[p.name]
            elif record is not None and isinstance(record["counts"].get(p.name), int):
                counts[p.name], replayed = record["counts"][p.name], True
                report.replacements[p.name] += counts[p.name]
            else:
                report.unknown.add(p.name)
                continue
            report.replacements[p.name] += counts[p.name] * (uses - 1)
        if replayed:
            for entry in record["notes"]:
                if entry not in report.notes:
                    report.notes.append(entry)
        if len(counts) == len(self.pass_list) and not replayed:
            _write_record(key, {"counts": counts, "notes": report.notes[notes_before:]})


def tensor_methods_as_method_calls(gm: torch.fx.GraphModule) -> None:
    """Turn calls of a tensor method as a function (``torch.Tensor.set_(p, d)``: Dynamo records
    ``p.data = d`` so) into method calls, the same op. AOTAutograd's cache refuses a graph with such
    a node (the method has no ``__module__``), so an optimizer's graph was compiled from scratch at
    every warm start."""
    changed = False
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and type(target).__name__ == "method_descriptor" \
                and getattr(torch.Tensor, target.__name__, None) is target:
            node.op, node.target, changed = "call_method", target.__name__, True
    if changed:
        gm.recompile()


def report_dir() -> Path:
    """Where graphs' pass records live: inside Inductor's cache directory, beside the compiled
    artifacts they describe, so a warm cache comes with them wherever that directory is."""
    return Path(cache_dir_utils.cache_dir()) / "cstack_pass_reports"


def _digest(key: Path, payload: dict) -> str:
    return hashlib.sha256(f"{key.name}:{json.dumps(payload, sort_keys=True)}".encode()).hexdigest()


def _read_record(key: Path) -> dict | None:
    """A graph's stored counts and notes; None if missing, unreadable, malformed or edited."""
    try:
        data = settings.read_record(key)
        payload = {"counts": dict(data["counts"]), "notes": [str(n) for n in data["notes"]]}
        return payload if data["digest"] == _digest(key, payload) else None
    except (ValueError, KeyError, TypeError):
        return None


def _write_record(key: Path, payload: dict) -> None:
    settings.write_record(key, {**payload, "digest": _digest(key, payload)})
