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
block's class is a subclass whose forward routes to its block call, and
torch.optim's ``foreach`` flag reads False; afterwards all are as they were.
"""
import contextlib
import dataclasses
import functools
import numbers
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from compile_stack import caches
from compile_stack.backend import PassBackend
from compile_stack.backend.graph_breaks import logging_as_no_ops
from compile_stack.backend.inspection import InspectionWriter
from compile_stack.backend.startup import StartupPhases
from compile_stack.capture import accumulation_loops
from compile_stack.capture.blocks import BlockCalls
from compile_stack.capture.fsdp_modules import ShardedRoot, state_of
from compile_stack.capture.optimizer_step import CompiledOptimizerStep, routed_attribute
from compile_stack.capture.reachable import find_reachable, global_counter_sources, is_optimizer
from compile_stack.capture.resume_frames import compiled_resumes, ran_eagerly
from compile_stack.capture.targets import TargetsCheck
from compile_stack.memory_plan import MemoryPlan
from compile_stack.memory_plan.fit import MemoryPlanError
from compile_stack.memory_plan.host import offload_host_bytes
from compile_stack.memory_plan.options import check_options
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
    # Move what a plan saves beyond the GPU's room to pinned host memory (memory_plan/offload.py): None or
    # True within the host's free memory less a reserve (memory_plan/host.py), a float within that share of
    # the host's memory, False: off.
    offload_activations: bool | float | None = None


def backend_factory(options: StepOptions, inspect: bool = True, plan: MemoryPlan | None = None,
                    report: registry.PassReport | None = None,
                    startup: StartupPhases | None = None) -> Callable[..., PassBackend]:
    """Makes our backends for ``options``, all writing to one inspection directory (if any), one
    pass ``report`` and one ``startup`` record (if any) and, without a fixed memory budget,
    planned by one ``plan`` (if any); call it with the backend's ``name`` and its own keywords."""
    writer = InspectionWriter(options.inspect_dir) if options.inspect_dir and inspect else None
    return functools.partial(PassBackend, options.passes, writer, options.memory_budget, codegen=options.codegen,
                             backward_now=options.backward_now, plan=plan, report=report, startup=startup)


class CompiledStep:
    """The user's step, compiled: call it as the original (same arguments, same result).

    A target out of range raises at a later call, once the call that saw it has finished (targets.py).
    """

    def __init__(self, train_step: Callable, options: StepOptions):
        _check_train_step(train_step)
        self.train_step = train_step
        self.options = options
        # Checked now; in force only while the step compiles and runs (caches.cache_dir_in_force).
        self.cache_dir = caches.prepare_cache_dir(options.cache_dir) if options.cache_dir is not None else None
        optimizers = find_reachable(train_step, is_optimizer)
        models = find_reachable(train_step, lambda obj: isinstance(obj, torch.nn.Module))
        for model in models:
            meta = next((name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta), None)
            require(meta is None, "train_step", "models with data to compute on", f"{type(model).__name__} with "
                    f"{meta} on the meta device (shapes only; materialize it first: model.to_empty(device=...), "
                    "then initialize its weights)")
        # The step Dynamo runs: its gradient-accumulation loop bodies, if any, functions of their own.
        self.step = accumulation_loops.outlined(train_step) or train_step
        # The code of the frame torch.compile runs (a bound method's function's); None for a partial
        # or a callable object, whose frames Dynamo reaches through a call of its own.
        self.step_code = getattr(getattr(self.step, "__func__", self.step), "__code__", None)
        self.bodies = accumulation_loops.body_codes(self.step_code)
        self.memory_plan = (MemoryPlan.for_step(optimizers, models, offload_host_bytes(options.offload_activations),
                                                accumulates=bool(self.bodies))
                            if options.memory_budget is None else None)
        self.report = registry.PassReport()  # what the passes did in this step's graphs
        self.startup = StartupPhases()  # where its first call's time went
        backend = backend_factory(options, plan=self.memory_plan, report=self.report, startup=self.startup)
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
        # Held for a call: the optimizers' and models' methods are routed while the step runs, so a
        # second call at once (another thread) would see them half-routed.
        self.running = threading.Lock()
        functools.update_wrapper(self, train_step)

    @property
    def block_graphs(self) -> int:
        """The blocks' graphs compiled so far: one per distinct kind of block, however many layers."""
        return self.backend.block_graphs + sum(calls.backend.graphs for calls in self.block_calls)

    def __call__(self, *args, **kwargs):
        if not self.running.acquire(blocking=False):
            raise RuntimeError(f"{getattr(self, '__name__', 'train_step')}: the compiled step is already running "
                               "(in another thread, or calling itself); it is not thread-safe: call it from one thread "
                               "at a time")
        try:
            with registry.reporting(self.report):
                return self._call(*args, **kwargs)
        finally:
            self.running.release()

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
            stack.enter_context(logging_as_no_ops())  # a library's warning in traced code is no graph break
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
            if first:
                stack.enter_context(self.startup.first())
            try:
                result = self.compiled(*args, **kwargs)
            except torch.OutOfMemoryError as e:
                if self.memory_plan is None or not self.memory_plan.notes():
                    raise
                # The plan was wrong (a bug to fix): say what it expected of each graph.
                raise torch.OutOfMemoryError(f"{str(e).splitlines()[0]}\nthe memory plan expected (a bug in "
                                             "it): " + "; ".join(self.memory_plan.notes())) from e
            except Exception as e:
                if (refused := plan_refusal(e)) is not None:
                    raise refused from None  # the plan's one message, not Dynamo's wrapping of it
                raise
            if self.memory_plan is not None:  # its records go beside the caches in force
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


def plan_refusal(error: BaseException) -> MemoryPlanError | None:
    """The memory plan's refusal that ``error`` (a compile's failure, as Dynamo wraps it) carries, if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, MemoryPlanError):
            return error
        seen.add(id(error))
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return None


def compile_step(train_step: Callable, *, passes: list[str] | None = None, memory_budget: float | None = None,
                 inspect_dir: str | Path | None = None, cache_dir: str | Path | None = None,
                 codegen: bool = True, blocks: bool = True,
                 offload_activations: bool | float | None = None) -> CompiledStep:
    """Compile the user's own train step with our passes; returns a callable that behaves the same.

    ``train_step`` is the function as written: zero-grad, forward, loss,
    ``backward()``, ``optimizer.step()``, closed over the model and optimizer.
    Options: ``passes`` (names; default all), ``memory_budget`` (AOTAutograd's
    activation memory budget in [0, 1]; default on a GPU: per graph, the least
    recomputation whose plan fits the device, see ``memory_plan/``), ``inspect_dir`` (graphs and generated
    code are written there), ``cache_dir`` (compile caches), ``codegen``
    (False: run the rewritten aten graphs without Inductor's code generation),
    ``blocks`` (False: inline repeated blocks instead of compiling one for all),
    ``offload_activations`` (on one GPU without a fixed ``memory_budget``: when the
    plan that fits the device recomputes values a larger budget would save, keep
    those in pinned host memory between forward and backward instead; by default
    (None, or True) within the host's free memory less a reserve
    (``memory_plan/host.py``), within this share of the host's memory if a float in
    (0, 1) is given, not at all if False; see ``memory_plan/offload.py``).
    """
    _check_train_step(train_step)
    expect_type(passes is None or (isinstance(passes, Sequence) and not isinstance(passes, (str, bytes))
                                   and all(isinstance(p, str) for p in passes)),
                "passes", "None or a list of pass names", passes)
    expect_type(memory_budget is None or _is_real(memory_budget), "memory_budget", "None or a number in [0, 1]",
                memory_budget)
    for name, value in (("inspect_dir", inspect_dir), ("cache_dir", cache_dir)):
        expect_type(value is None or isinstance(value, (str, os.PathLike)), name, "None or a path", value)
    for name, value in (("codegen", codegen), ("blocks", blocks)):
        expect_type(isinstance(value, bool), name, "True or False", value)
    if inspect_dir is not None:
        _make_writable_dir("inspect_dir", Path(inspect_dir), "compiled graphs and code are written there")
    check_options(memory_budget, offload_activations)
    options = StepOptions(
        passes=list(passes) if passes is not None else None,
        inspect_dir=Path(inspect_dir) if inspect_dir is not None else None,
        memory_budget=memory_budget,
        cache_dir=Path(cache_dir) if cache_dir is not None else None,
        codegen=codegen,
        blocks=blocks,
        offload_activations=offload_activations,
    )
    return CompiledStep(train_step, options)


def expect_type(ok: bool, arg: str, expected: str, got: object) -> None:
    """Raise TypeError('<arg>: expected <expected>, got <got> (<type>)') unless ok: an argument of the wrong kind."""
    if not ok:
        raise TypeError(f"{arg}: expected {expected}, got {got!r} ({type(got).__name__})")


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_train_step(train_step) -> None:
    """A callable that is not a model: a model is what the step trains, not the step."""
    expect_type(callable(train_step), "train_step", "a callable (the user's train-step function)", train_step)
    if isinstance(train_step, torch.nn.Module):
        raise TypeError(f"train_step: expected the train-step function (zero-grad, forward, loss, backward(), "
                        f"optimizer.step()), got the model {type(train_step).__name__}; to compile a model's forward "
                        "alone: torch.compile(model, backend=compile_stack.Backend())")


def _make_writable_dir(arg: str, path: Path, why: str) -> None:
    """Create ``path`` if needed and write a file in it, so that a bad path fails now, naming ``arg``."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(f"{arg}: expected a writable directory ({why}), got {str(path)!r} ({e.strerror})") from e
