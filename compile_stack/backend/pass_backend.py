"""The torch.compile backend: Inductor with our passes installed.

``PassBackend`` is handed to ``torch.compile(backend=...)`` (it is the public
``compile_stack.Backend``). A captured graph goes through three phases:

1. **Receive** (``__call__``): gradients the trace sets to None are released
   before the graph runs (``grad_release.py``); with ``outline_blocks`` the
   graph is split at its repeated blocks (``segments.py``), each piece
   compiled at its first call.
2. **Compile** (``_compile``): our pre-grad passes and the mask inputs rebuilt
   (``input_masks.py``), then Inductor (or, with ``codegen=False``, the aten
   graphs as they are: ``aten_graphs.py``) with our joint and post-grad passes
   in its hooks and, without a fixed budget, a partitioner fitting the memory
   plan (``memory_plan/``). By default each backward is compiled with its
   forward, so nothing else need be held open for the passes to reach it.
3. **Settle**: the graph's pass counts and notes (``pass_records.py``: true on
   warm caches too), and what its partition decided told to the step's memory
   plan (``MemoryPlan.compiled``). How long the compile took, and whether
   AOTAutograd's cache had it, goes to the step's ``StartupPhases`` (``startup.py``).
"""
import contextlib
import functools

import torch

from compile_stack.backend import graph_breaks, input_masks, inspection, pass_records, segments, settings, vec_isas
from compile_stack.backend.aten_graphs import compile_aten_graphs
from compile_stack.backend.grad_release import grads_set_to_none, releasing_grads
from compile_stack.backend.startup import StartupPhases
from compile_stack.memory_plan.plan import MemoryPlan
from compile_stack.memory_plan.share import CallSites
from passes import registry
from passes.graph_edit import copy_module
from torch_internals import aot, inductor


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
        plan: MemoryPlan | None = None,
        report: registry.PassReport | None = None,
        startup: StartupPhases | None = None,
    ):
        self.pass_list = registry.resolve(passes)
        # What our passes did in this backend's graphs: a step's backends share the step's report.
        self.report = report if report is not None else registry.PassReport()
        self.startup = startup if startup is not None else StartupPhases()  # likewise its compile times
        self.outline_blocks = outline_blocks
        # True: compile each backward with its forward, so our passes and settings apply to it
        # without the caller holding ``active()`` open. False: at the first backward(), which must
        # then run inside ``active()`` (compile_step's call does).
        self.backward_now = backward_now
        # The call sites each graph serves (a block's graph: one per block); replacements are
        # counted that many times, and the last ``sites.richer`` of them may take a richer plan.
        self.sites = CallSites(uses)
        self.memory_budget = memory_budget
        # Without a fixed budget, each graph's budget is chosen by the step's memory plan.
        self.plan = plan if memory_budget is None else None
        self.name = name
        self.codegen = codegen
        self.graphs = 0  # graphs compiled
        self.captures = 0  # captured graphs cut into segments (segments.outline)
        self.block_graphs = 0  # of those segments, the blocks' graphs compiled (one per distinct kind)
        self.writer = writer
        # While a list: each graph as our joint passes left it is appended (a proven optimizer update records it).
        self.kept_joint: list[torch.fx.GraphModule] | None = None

    @contextlib.contextmanager
    def active(self, on_gpu: bool = False):
        """Our passes, settings and inspection hooks in force (``on_gpu``: for a graph on a GPU).

        The step runs inside this too: AOTAutograd may compile a backward
        graph lazily, at the first ``backward()``.
        """
        observer = self._observer()
        with (
            registry.reporting(self.report),
            registry.installed([p.name for p in self.pass_list], observer, stages=("joint", "post_grad")),
            settings.memory_budget(self.memory_budget),
            settings.inductor_config(on_gpu),
            inspection.capture_output_code(self.writer),
        ):
            yield

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        graph_breaks.note_break(gm)
        released = grads_set_to_none(gm)  # before a pass edits the graph's inputs
        if self.outline_blocks:
            segmented = segments.outline(gm, self._compile, self._compile_block)
            if segmented is not None:
                if self.writer:  # the graph Dynamo captured, before it was cut
                    self.writer.begin_graph(f"{self.name}.captured{self.captures}", gm)
                self.captures += 1
                return releasing_grads(segmented, *released)
        return releasing_grads(self._compile(gm, example_inputs, self.sites), *released)

    def _compile_block(self, gm: torch.fx.GraphModule, example_inputs, sites: CallSites, richer: bool = False):
        """``_compile`` of a block segment cut from a captured graph, counted in ``block_graphs``."""
        self.block_graphs += not richer
        return self._compile(gm, example_inputs, sites, richer)

    def richer(self, gm: torch.fx.GraphModule, example_inputs):
        """A backend compiling each graph for its richer call sites (``self.sites.richer``)."""
        return self._compile(gm, example_inputs, self.sites, richer=True)

    def _compile(self, gm: torch.fx.GraphModule, example_inputs, sites: CallSites, richer: bool = False):
        """Compile one graph for ``sites``; its replacements count once per call site. ``richer``:
        a second compile of it for the call sites given a richer plan (their memory is reserved,
        and the graph's passes counted, by the first)."""
        with self.startup.graph(self.name):
            return self._compile_timed(gm, example_inputs, sites, richer)

    def _compile_timed(self, gm: torch.fx.GraphModule, example_inputs, sites: CallSites, richer: bool):
        graph_name = f"{self.name}{self.graphs}"
        self.graphs += 1
        report = self.report
        before = pass_records.Mark.of(report)
        if self.writer:
            self.writer.begin_graph(graph_name, gm)
        masks = input_masks.find(gm, example_inputs)
        captured = copy_module(gm) if masks else None  # as captured, for a call whose masks no longer hold
        with registry.reporting(self.report):  # the pre-grad passes run here, outside active()
            self._prepare(gm, masks)
        # Inspecting: the backward's code is filed under this graph only if compiled now.
        backward_now = aot.config_patch(
            force_non_lazy_backward_lowering=self.backward_now or self.writer is not None)
        planned = None
        if self.plan is not None:
            key = f"{self.name}:{pass_records.record_key(gm, self.pass_list).stem}"
            planned = self.plan.graph(graph_name, key, sites, richer)
        partitioner = planned.partitioner if planned is not None else None
        compile_graph = functools.partial(inductor.compile_fx if self.codegen else compile_aten_graphs,
                                          **({} if self.codegen else {"stage": self._stages(), "partitioner": partitioner}))
        # An offloaded activation is read by a copy on a side stream after its last reader on the
        # main stream, and may come back to the backward as it is: the transfers hold the tensor
        # (custom_ops/activation_offload/transfers.py), but Inductor's in-graph reuse of a freed
        # buffer would write into it.
        offloading = self.plan is not None and self.plan.offloading
        gpu = settings.on_gpu(example_inputs)
        with (self.active(gpu), backward_now,
              inductor.config_patch(custom_partitioner_fn=partitioner,
                                           **({"allow_buffer_reuse": False} if offloading else {}))):
            if self.codegen and not gpu:  # its C++ kernels need the host's vector ISAs
                vec_isas.recall()
            if inductor.graph_returns_tuple(gm):
                compiled = compile_graph(gm, example_inputs)
            else:  # a segment returning one value
                compiled = inductor.make_graph_return_tuple(gm, example_inputs, compile_graph)
        if richer:  # the first compile's passes and notes stand for both
            report.replacements, report.notes[:] = before.replacements, report.notes[:before.notes]
        else:
            if planned is not None:
                self.plan.compiled(planned)
            pass_records.settle(report, gm, self.pass_list, before, sites.count)
        return input_masks.MaskGuard(compiled, captured, masks, graph_name) if masks else compiled

    def _stages(self) -> dict:
        return registry.stage_passes(self.pass_list, self._observer())

    def _observer(self):
        """What watches the passes' stages: the inspection writer, and ``kept_joint`` while a list."""
        writer = self.writer.observer() if self.writer else None
        if writer is None and self.kept_joint is None:
            return None

        def observe(stage: str, graph: torch.fx.Graph, when: str) -> None:
            if writer is not None:
                writer(stage, graph, when)
            if self.kept_joint is not None and stage == "joint" and when == "after":
                self.kept_joint.append(copy_module(graph.owning_module))

        return observe

    def _prepare(self, gm: torch.fx.GraphModule, masks: dict) -> None:
        """Our pre-grad passes, run here rather than in Inductor's hook: AOTAutograd's cache checks
        the graph it is given, and refuses what Dynamo records for ``p.data`` updates (Tensor
        methods called as functions, a local version-counter function) that the ``param_data``
        pass rewrites; the rewritten graph keys the cache itself. Then the mask inputs rebuilt."""
        tensor_methods_as_method_calls(gm)
        self._stages()["pre_grad"](gm.graph)
        if masks:
            input_masks.rebuild(gm, masks)
        gm.recompile()


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


