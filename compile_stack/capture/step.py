"""``compile_step``: the user's own train step, compiled whole with our passes.

The user hands us the function they time, written as they like::

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y).sum()
        loss.backward()
        optimizer.step()

Dynamo captures it as it runs: the zero-grad (run eagerly, below), then the
forward and loss as one graph (``loss.backward()`` is a graph break;
AOTAutograd derives the backward, so it runs compiled code too), then
``optimizer.step()``. Repeated blocks of the model are compiled once for all
of them (``blocks.py``). Each optimizer the step reaches (found among the
function's closure and global names) is compiled as its own graph with its
own backend, so its Python step counter and float hyper-parameters are traced
as symbols from the first compile: a scheduler changing ``lr`` between steps
does not recompile it. So is a module's int that the step's own functions
assign (a functional update's step counter).

However the step names its objects (globals of a script included), the
frames Dynamo resumes it in after each graph break are compiled too
(``resume_frames.py``).

Nothing of the user's objects is edited for longer than a call: while the
compiled step runs, each found optimizer's ``step`` routes to its compiled
update, its ``zero_grad`` and each found model's run as graph breaks, each
block's ``forward`` routes to its block call, and torch.optim's ``foreach``
flag reads False; afterwards all are as they were.
"""
import contextlib
import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from compile_stack import caches
from compile_stack.backend import PassBackend
from compile_stack.backend.inspection import InspectionWriter
from compile_stack.capture import accumulation_loops
from compile_stack.capture.blocks import BlockCalls
from compile_stack.capture.fsdp_modules import ShardedRoot, state_of
from compile_stack.capture.optimizer_step import CompiledOptimizerStep, routed_attribute
from compile_stack.capture.reachable import find_reachable, global_counter_sources, is_optimizer
from compile_stack.capture.resume_frames import compiled_resumes, ran_eagerly
from compile_stack.capture.targets import TargetsCheck
from compile_stack.memory_plan import MemoryPlan
from compile_stack.memory_plan.ledger import HOST_FRACTION
from custom_ops.checks import require
from passes import registry
from passes.registry import note


@dataclasses.dataclass
class StepOptions:
    """What ``compile_step`` and ``run_step.py`` let a user choose."""

    passes: list[str] | None = None  # None: the project's pass pipeline
    inspect_dir: Path | None = None
    memory_budget: float | None = None
    cache_dir: Path | None = None
    codegen: bool = True  # False: run our passes' aten graphs as they are (tests, debugging)
    blocks: bool = True  # compile repeated blocks once for all of them (blocks.py)
    # Compile each backward with its forward rather than at the first backward().
    backward_now: bool = False
    # Move what a plan saves beyond the GPU's room to pinned host memory (memory_plan/offload.py), within this
    # share of the host's memory (0: offload off).
    offload_host_share: float = 0.0


def backend_factory(options: StepOptions, inspect: bool = True, plan: MemoryPlan | None = None,
                    report: registry.PassReport | None = None) -> Callable[..., PassBackend]:
    """Makes our backends for ``options``, all writing to one inspection directory (if any) and
    one pass ``report`` (if any) and, without a fixed memory budget, planned by one ``plan`` (if
    any); call it with the backend's ``name`` and its own keywords."""
    writer = InspectionWriter(options.inspect_dir) if options.inspect_dir and inspect else None
    return functools.partial(PassBackend, options.passes, writer, options.memory_budget, codegen=options.codegen,
                             backward_now=options.backward_now, plan=plan, report=report)


class CompiledStep:
    """The user's step, compiled: call it as the original (same arguments, same result).

    A target out of range raises at a later call, once the call that saw it has finished (targets.py).
    """

    def __init__(self, train_step: Callable, options: StepOptions):
        require(callable(train_step), "train_step", "a callable (the user's train-step function)",
                type(train_step).__name__)
        self.train_step = train_step
        self.options = options
        # Checked now; in force only while the step compiles and runs (caches.cache_dir_in_force).
        self.cache_dir = caches.prepare_cache_dir(options.cache_dir) if options.cache_dir is not None else None
        optimizers = find_reachable(train_step, is_optimizer)
        models = find_reachable(train_step, lambda obj: isinstance(obj, torch.nn.Module))
        # The step Dynamo runs: its gradient-accumulation loop bodies, if any, functions of their own.
        self.step = accumulation_loops.outlined(train_step) or train_step
        # The code of the frame torch.compile runs (a bound method's function's); None for a partial
        # or a callable object, whose frames Dynamo reaches through a call of its own.
        self.step_code = getattr(getattr(self.step, "__func__", self.step), "__code__", None)
        self.bodies = accumulation_loops.body_codes(self.step_code)
        self.memory_plan = (MemoryPlan.for_step(optimizers, models, options.offload_host_share,
                                                accumulates=bool(self.bodies))
                            if options.memory_budget is None else None)
        self.report = registry.PassReport()  # what the passes did in this step's graphs
        backend = backend_factory(options, plan=self.memory_plan, report=self.report)
        self.backend = backend(name="model", outline_blocks=options.blocks)
        self.optimizer_backend = backend(name="optimizer")
        with registry.reporting(self.report):  # an optimizer left eager says so in this step's report
            self.optimizer_steps = [CompiledOptimizerStep(opt, self.optimizer_backend) for opt in optimizers]
        self.block_calls = [calls for model in (models if options.blocks else [])
                            if (calls := BlockCalls.of(model, lambda n: backend(name="block", uses=n))) is not None]
        self.compiled = torch.compile(self.step, backend=self.backend)
        self.counter_sources = global_counter_sources(self.step)
        self.targets_check = TargetsCheck()
        self.models = models
        blocks = {id(b) for calls in self.block_calls for b in calls.blocks}
        # Models sharded by FSDP2 (``fully_shard`` on the blocks, then the root): their hooks run
        # around the compiled pieces, outside Dynamo's trace (fsdp_modules.py).
        self.sharded_roots = {id(m): ShardedRoot(m) for m in models if state_of(m) is not None and id(m) not in blocks}
        # A model's zero-grad, like an optimizer's, runs eagerly: traced, its grad = None would land
        # after the forward graph, the last step's gradients alive through it.
        self.model_zero_grads = [torch.compiler.disable(self.sharded_roots[id(m)].zero_grad if id(m) in self.sharded_roots
                                                        else m.zero_grad) for m in models]
        self.called = False
        functools.update_wrapper(self, train_step)

    def __call__(self, *args, **kwargs):
        with registry.reporting(self.report):
            return self._call(*args, **kwargs)

    def _call(self, *args, **kwargs):
        self.targets_check.before_call()
        first = not self.called
        if self.memory_plan is not None:
            self.memory_plan.step_starts(args, self.models, first)
        self.called = True
        with contextlib.ExitStack() as stack:
            if self.cache_dir is not None:
                stack.enter_context(caches.cache_dir_in_force(self.cache_dir))
            stack.enter_context(self.backend.active())  # the backward may be compiled in this call
            stack.enter_context(compiled_resumes(self.step_code, self.bodies))
            if self.counter_sources:
                given = torch.compiler.config.dynamic_sources
                stack.enter_context(torch.compiler.config.patch(
                    dynamic_sources=",".join(s for s in (given, self.counter_sources) if s)))
            for calls in self.block_calls:
                stack.enter_context(calls.routed())
            for opt_step in self.optimizer_steps:
                stack.enter_context(opt_step.routed())
            for model, zero_grad in zip(self.models, self.model_zero_grads):
                stack.enter_context(routed_attribute(model, "zero_grad", zero_grad))
            for root in self.sharded_roots.values():
                root.before_step()
                stack.enter_context(root.routed())
            result = self.compiled(*args, **kwargs)
        if self.memory_plan is not None:
            self.memory_plan.step_ended()  # every graph of the step has its plan now
        if first and self.bodies:
            several = len(self.bodies) > 1
            note("step", f"{len(self.bodies)} loop bod{'ies' if several else 'y'} calling backward() ran as "
                         f"{'functions of their own' if several else 'a function of its own'}, each call compiled "
                         "(gradient accumulation: Dynamo runs the loop's own frame eagerly)")
        if first and any(ran_eagerly(code) for code in (self.bodies or [self.step_code])):
            note("step", "Dynamo ran the step's own code eagerly (a graph break it cannot resume from, such as "
                         "loss.backward() inside a loop): the model and optimizer are compiled on their own, and "
                         "what the step computes outside them, a loss included, runs uncompiled and unfused")
        self.targets_check.after_call()
        return result


def compile_step(train_step: Callable, *, passes: list[str] | None = None, memory_budget: float | None = None,
                 inspect_dir: str | Path | None = None, cache_dir: str | Path | None = None,
                 codegen: bool = True, blocks: bool = True, offload_activations: bool | float = False) -> CompiledStep:
    """Compile the user's own train step with our passes; returns a callable that behaves the same.

    ``train_step`` is the function as written: zero-grad, forward, loss,
    ``backward()``, ``optimizer.step()``, closed over the model and optimizer.
    Options: ``passes`` (names; default all), ``memory_budget`` (AOTAutograd's
    activation memory budget in [0, 1]; default on a GPU: per graph, the least
    recomputation whose plan fits the device, see ``memory_plan/``), ``inspect_dir`` (graphs and generated
    code are written there), ``cache_dir`` (compile caches), ``codegen``
    (False: run the rewritten aten graphs without Inductor's code generation),
    ``blocks`` (False: inline repeated blocks instead of compiling one for all),
    ``offload_activations`` (on a GPU without a fixed ``memory_budget``: when the
    plan that fits the device recomputes values a larger budget would save, keep
    those in pinned host memory between forward and backward instead, within
    ``memory_plan.ledger.HOST_FRACTION`` of the host's memory, or this share of it if a float
    in (0, 1) is given; see ``memory_plan/offload.py``).
    """
    if memory_budget is not None:
        require(isinstance(memory_budget, (int, float)) and 0.0 <= memory_budget <= 1.0, "memory_budget",
                "a fraction in [0, 1]", memory_budget)
    require(isinstance(offload_activations, bool) or (isinstance(offload_activations, float)
                                                      and 0.0 < offload_activations < 1.0), "offload_activations",
            "True, False or the share of the host's memory to use, a float in (0, 1)", offload_activations)
    require(not (offload_activations and memory_budget is not None), "offload_activations",
            "False with a fixed memory_budget (offload extends the plan chosen per graph)", offload_activations)
    host_share = HOST_FRACTION if offload_activations is True else float(offload_activations)
    options = StepOptions(
        passes=list(passes) if passes is not None else None,
        inspect_dir=Path(inspect_dir) if inspect_dir is not None else None,
        memory_budget=memory_budget,
        cache_dir=Path(cache_dir) if cache_dir is not None else None,
        codegen=codegen,
        blocks=blocks,
        offload_host_share=host_share,
    )
    return CompiledStep(train_step, options)
