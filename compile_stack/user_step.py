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
import dis
import functools
import re
import types
from collections.abc import Callable
from pathlib import Path

import torch

from compile_stack import accumulation_loops, host_pinning, settings
from compile_stack.blocks import BlockCalls
from compile_stack.budget import HOST_FRACTION, MemoryLedger
from compile_stack.capture import PassBackend
from compile_stack.inspection import InspectionWriter
from compile_stack.resume_frames import compiled_resumes, ran_eagerly
from compile_stack.targets import TargetsCheck
from custom_ops.activation_offload import TRANSFERS
from custom_ops.checks import require
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
    # Move what a plan saves beyond the GPU's room to pinned host memory (offload.py), within this
    # share of the host's memory (0: offload off).
    offload_host_share: float = 0.0


def backend_factory(options: StepOptions, inspect: bool = True,
                    ledger: MemoryLedger | None = None) -> Callable[..., PassBackend]:
    """Makes our backends for ``options``, all writing to one inspection directory (if any) and,
    without a fixed memory budget, fitting their plans into one ``ledger`` (if any); call it
    with the backend's ``name`` and its own keywords."""
    writer = InspectionWriter(options.inspect_dir) if options.inspect_dir and inspect else None
    return functools.partial(PassBackend, options.passes, writer, options.memory_budget, codegen=options.codegen,
                             backward_now=options.backward_now, ledger=ledger)


def step_ledger(optimizers: list, models: list, host_share: float = 0.0,
                accumulates: bool = False) -> MemoryLedger | None:
    """The memory ledger of a step whose parameters live on a GPU (its saved activations may also
    take ``host_share`` of the host's memory; with ``accumulates``, its gradients live through its
    forwards); None on a CPU (the partitioner's own default budget applies there)."""
    params = [p for m in models for p in m.parameters()]
    params += [p for opt in optimizers for g in getattr(opt, "param_groups", ()) for p in g["params"]]
    devices = {p.device for p in params if isinstance(p, torch.Tensor)}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return None
    accumulating = list({id(p): p for p in params if isinstance(p, torch.Tensor)}.values()) if accumulates else None
    return MemoryLedger.for_device(next(iter(devices)), optimizers, host_share, accumulating)


def is_optimizer(obj) -> bool:
    """A torch optimizer, or a hand-written one: a ``step`` and a ``zero_grad`` method, not a module."""
    if isinstance(obj, torch.optim.Optimizer):
        return True
    if isinstance(obj, (type, torch.nn.Module, torch.Tensor)) or callable(obj):
        return False
    return callable(getattr(obj, "step", None)) and callable(getattr(obj, "zero_grad", None))


def find_reachable(fn: Callable, wanted: Callable[[object], bool]) -> list:
    """The objects ``fn`` reaches by name (its closure cells, the globals its code names, and a
    bound method's object's attributes) for which ``wanted`` holds, each once."""
    owner = getattr(fn, "__self__", None)
    fn = inspect_target(fn)
    found = []
    candidates = list(vars(owner).values()) if owner is not None and hasattr(owner, "__dict__") else []
    candidates += [cell.cell_contents for cell in (fn.__closure__ or ()) if _has_contents(cell)]
    candidates += [fn.__globals__[name] for name in _global_names(fn.__code__) if name in fn.__globals__]
    for obj in candidates:
        if wanted(obj) and all(obj is not seen for seen in found):
            found.append(obj)
    return found


def inspect_target(fn: Callable) -> Callable:
    """The plain function behind ``fn`` (a bound method's, a partial's), whose closure we read."""
    while True:
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif hasattr(fn, "__func__"):
            fn = fn.__func__
        elif hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        else:
            return fn


def _has_contents(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell: a name bound later
        return False
    return True


def _global_names(code) -> set[str]:
    """Global names a code object and the functions nested in it read."""
    return {name for c in _nested_codes(code) for name in c.co_names}


def global_counter_sources(fn: Callable) -> str:
    """Dynamo sources of the module's ints that the step, or a function of its module it names,
    assigns (``global t; t += 1`` in a hand-written update), to trace as symbols from the first
    compile: Dynamo bakes a global int in as a constant, so each new value would recompile the
    step until its recompile limit left the rest of it eager. Regular expressions, as
    ``step_counter_sources`` returns them."""
    fn = inspect_target(fn)
    module = getattr(fn, "__globals__", None)
    if module is None:
        return ""
    names, seen, todo = set(), set(), [fn]
    while todo:
        code = todo.pop().__code__
        if code in seen:
            continue
        seen.add(code)
        names |= {i.argval for c in _nested_codes(code) for i in dis.get_instructions(c)
                  if i.opname == "STORE_GLOBAL" and type(module.get(i.argval)) is int}
        todo += [f for name in _global_names(code) if isinstance(f := module.get(name), types.FunctionType)
                 and f.__globals__ is module]
    return ",".join(rf"G\['{re.escape(name)}'\]$" for name in sorted(names))


def _nested_codes(code) -> list:
    """A code object and the code objects nested in it (closures, comprehensions)."""
    return [code, *(c for const in code.co_consts if isinstance(const, type(code)) for c in _nested_codes(const))]


def step_counter_sources(optimizer) -> str:
    """Dynamo sources of an optimizer's Python scalars, to trace as symbols from the first compile.

    A hand-written optimizer keeps its step count as a Python int (an
    attribute, or an entry of ``self.state[p]``) and ``torch.optim`` keeps
    ``lr`` as a float a scheduler changes; Dynamo would bake each in as a
    constant at the first compile and recompile at the first change. Returned
    as regular expressions (``dynamic_sources`` matches them with
    ``re.match``; they hold no comma or space): the optimizer is ``self`` of
    whichever frame Dynamo compiles for ``torch.compile(optimizer.step)``
    (the bound method's ``L['fn'].__self__``, the step's own ``L['self']``,
    or ``L['args'][0]`` inside torch.optim's step wrapper). Every int is named.
    Floats only of torch.optim's own optimizers, and only an lr (``lr``,
    ``*_lr``, ``lr_*``, ``learning_rate``): the fused update takes lr as a
    tensor but its betas, eps and weight decay as constants, so those stay
    specialized (a change recompiles). A hand-written step mixes lr with its
    Python-int step in Python arithmetic (lr·√(1−β₂ᵗ)/(1−β₁ᵗ)), which Dynamo
    cannot keep symbolic: it would specialize lr there (a guard: a change
    recompiles anyway) and keep it a graph input elsewhere, and that
    half-symbolic update has no one lr the AdamW pass could prove; baked in,
    it is fused. Dynamo's ``dynamic_sources`` applies to ints only:
    ``CompiledOptimizerStep`` makes the named floats symbolic, and keeps a
    hand-written optimizer's floats constants.
    """
    this = CompiledOptimizerStep.SELF_SOURCE

    floats = type(optimizer).__module__.startswith("torch.optim.")

    def wanted(key, value):
        lr = floats and isinstance(key, str) and re.search(r"(^|_)lr($|_)|learning_rate", key) is not None
        return isinstance(key, str) and (type(value) is int or (type(value) is float and lr))

    names = [rf"{this}\.{re.escape(name)}$" for name, value in vars(optimizer).items() if wanted(name, value)]
    for i, group in enumerate(getattr(optimizer, "param_groups", ())):
        names += [rf"{this}\.param_groups\[{i}\]\[{re.escape(repr(key))}\]$" for key, value in group.items()
                  if wanted(key, value)]
    state_keys = {key for entry in getattr(optimizer, "state", {}).values() if isinstance(entry, dict)
                  for key, value in entry.items() if wanted(key, value)}
    names += [rf"{this}\.state\[.*\]\[{re.escape(repr(key))}\]$" for key in sorted(state_keys)]
    return ",".join(names)


class CompiledOptimizerStep:
    """``optimizer.step`` compiled with ``backend``; a graph break for an enclosing compiled step.

    The sources ``step_counter_sources`` names are traced as symbols from the
    first compile: ints through ``dynamic_sources``, floats (which that
    setting does not reach) by telling Dynamo's automatic-dynamic bookkeeping
    that they have already changed, as it would itself after a recompile.
    A hand-written optimizer's floats stay constants even after they change
    (Dynamo would make them symbols at the second value, and a half-symbolic
    lr is not fusable, see ``step_counter_sources``): a new lr recompiles the
    step, fused again, up to Dynamo's recompile limit, past which the step
    runs eagerly.

    A ``torch.optim.Optimizer`` subclass whose ``step`` assigns attributes
    (``self.t += 1``) runs eagerly: Dynamo (2.13) traces such an optimizer as
    its OptimizerVariable, which drops attribute stores, so the compiled step
    would silently keep ``self.t`` at its old value.
    """

    # The optimizer, as the frames Dynamo compiles for ``torch.compile(optimizer.step)`` name it.
    SELF_SOURCE = r"(?:L\['fn'\]\.__self__|L\['self'\]|L\['args'\]\[0\])"

    def __init__(self, optimizer, backend: PassBackend):
        self.optimizer = optimizer
        self.original = optimizer.step
        stores = self._attribute_stores(optimizer)
        if stores:
            note("optimizer", f"{type(optimizer).__name__}.step runs eagerly: it assigns attributes "
                              f"({', '.join(sorted(stores))}), which Dynamo drops for torch.optim.Optimizer subclasses")
        # Eagerly means wholly outside Dynamo: a non-recursive disable would let the train step's compile trace it.
        self.compiled = (torch._dynamo.disable(self.original) if stores
                         else torch.compile(self.original, backend=backend))
        self.call = torch._dynamo.disable(self._run, recursive=False)
        self.zero_grad = torch._dynamo.disable(optimizer.zero_grad)

    def _run(self, *args, **kwargs):
        sources = step_counter_sources(self.optimizer)
        static = not type(self.optimizer).__module__.startswith("torch.optim.")
        with (torch.compiler.config.patch(dynamic_sources=sources), self._dynamic_floats(sources, static),
              self._single_tensor()):
            return self.compiled(*args, **kwargs)

    @contextlib.contextmanager
    def _single_tensor(self):
        """torch.optim's per-parameter form while compiled, not its foreach form.

        The foreach form hands ``1 - lr·wd`` and the step sizes to ``_foreach_*`` ops as
        Python numbers, so Dynamo bakes lr in and a scheduler recompiles the step at every new
        lr (eager past the recompile limit). The single-tensor form keeps lr a symbol; it is the
        same update, and the AdamW pass fuses it into one call either way. Capturable groups
        too: on a GPU, Dynamo's first trace sets ``capturable`` in groups without state, and a
        second call taking the foreach form then compiled the step again.
        """
        saved = [(g, g["foreach"]) for g in getattr(self.optimizer, "param_groups", ())
                 if isinstance(self.optimizer, torch.optim.Optimizer) and "foreach" in g
                 and g["foreach"] is not False and not g.get("fused")]
        for group, _ in saved:
            group["foreach"] = False
        try:
            yield
        finally:
            for group, foreach in saved:
                group["foreach"] = foreach

    @staticmethod
    def _attribute_stores(optimizer) -> set[str]:
        """Attributes a hand-written ``torch.optim.Optimizer`` subclass's ``step`` assigns (but a
        tensor's ``data``/``grad``); empty for others, whose attribute stores Dynamo keeps."""
        if not isinstance(optimizer, torch.optim.Optimizer) or type(optimizer).__module__.startswith("torch.optim."):
            return set()
        fn = inspect_target(type(optimizer).step)
        code = getattr(fn, "__code__", None)
        if code is None:
            return set()
        return {i.argval for i in dis.get_instructions(code)
                if i.opname in ("STORE_ATTR", "DELETE_ATTR") and i.argval not in ("data", "grad")}

    @classmethod
    @contextlib.contextmanager
    def _dynamic_floats(cls, sources: str, static: bool):
        """Floats named in ``sources`` symbolic from their first value; with ``static``, the
        optimizer's other floats constants at every value."""
        from torch._dynamo import pgo
        from torch._dynamo.variables import builder

        if not hasattr(builder, "process_automatic_dynamic"):  # a torch without it: floats as Dynamo decides
            yield
            return
        patterns = [re.compile(s) for s in sources.split(",") if s]
        own = re.compile(cls.SELF_SOURCE + r"[.\[]")
        original = builder.process_automatic_dynamic

        def process(tx, name, entry, **kwargs):
            if isinstance(entry.scalar, float) and any(p.match(name) for p in patterns):
                entry = pgo.FrameStateSizeEntry.make_scalar(pgo.auto_dynamic)
            elif isinstance(entry.scalar, float) and static and own.match(name):
                return entry  # not recorded: never automatic-dynamic, a constant with a guard
            return original(tx, name, entry, **kwargs)

        builder.process_automatic_dynamic = process
        try:
            yield
        finally:
            builder.process_automatic_dynamic = original

    @contextlib.contextmanager
    def routed(self):
        """While active, ``optimizer.step`` runs the compiled update and ``optimizer.zero_grad``
        runs eagerly, as a graph break: traced, its ``p.grad = None`` would be applied only after
        the forward graph ran, keeping last step's gradients alive through the forward."""
        with (_routed(self.optimizer, "step", self.call),
              _routed(self.optimizer, "zero_grad", self.zero_grad)):
            yield


@contextlib.contextmanager
def _routed(obj, name: str, replacement):
    """``obj.name`` is ``replacement`` while active (an instance attribute), then as it was."""
    had_own = name in vars(obj)
    own = vars(obj).get(name)
    setattr(obj, name, replacement)
    try:
        yield
    finally:
        if had_own:
            setattr(obj, name, own)
        else:
            delattr(obj, name)


class CompiledStep:
    """The user's step, compiled: call it as the original (same arguments, same result).

    A target out of range raises at a later call, once the call that saw it has finished (targets.py).
    """

    def __init__(self, train_step: Callable, options: StepOptions):
        require(callable(train_step), "train_step", "a callable (the user's train-step function)",
                type(train_step).__name__)
        self.train_step = train_step
        self.options = options
        if options.cache_dir is not None:
            settings.use_cache_dir(options.cache_dir)
        optimizers = find_reachable(train_step, is_optimizer)
        models = find_reachable(train_step, lambda obj: isinstance(obj, torch.nn.Module))
        # The step Dynamo runs: its gradient-accumulation loop bodies, if any, functions of their own.
        self.step = accumulation_loops.outlined(train_step) or train_step
        # The code of the frame torch.compile runs (a bound method's function's); None for a partial
        # or a callable object, whose frames Dynamo reaches through a call of its own.
        self.step_code = getattr(getattr(self.step, "__func__", self.step), "__code__", None)
        self.bodies = accumulation_loops.body_codes(self.step_code)
        self.ledger = (step_ledger(optimizers, models, options.offload_host_share, accumulates=bool(self.bodies))
                       if options.memory_budget is None else None)
        if self.ledger is not None and self.ledger.host_capacity:
            TRANSFERS.pool.limit(self.ledger.host_capacity)
        backend = backend_factory(options, ledger=self.ledger)
        self.backend = backend(name="model", outline_blocks=options.blocks)
        self.optimizer_backend = backend(name="optimizer")
        self.optimizer_steps = [CompiledOptimizerStep(opt, self.optimizer_backend) for opt in optimizers]
        self.block_calls = [calls for model in (models if options.blocks else [])
                            if (calls := BlockCalls.of(model, lambda n: backend(name="block", uses=n))) is not None]
        self.compiled = torch.compile(self.step, backend=self.backend)
        self.counter_sources = global_counter_sources(self.step)
        self.targets_check = TargetsCheck()
        self.models = models
        # A model's zero-grad, like an optimizer's, runs eagerly: traced, its grad = None would land
        # after the forward graph, the last step's gradients alive through it.
        self.model_zero_grads = [torch._dynamo.disable(model.zero_grad) for model in models]
        self.called = False
        functools.update_wrapper(self, train_step)

    def __call__(self, *args, **kwargs):
        self.targets_check.before_call()
        if self.ledger is not None:
            self.ledger.at_step_start()
        pinning, first = None, not self.called
        if first and self.ledger is not None and self.ledger.host_capacity and torch.cuda.is_available():
            pinning = host_pinning.step_key(args, self.models, self.ledger.capacity, self.ledger.host_capacity)
            host_pinning.pin_remembered(pinning)  # under the first call's tracing
        self.called = True
        with contextlib.ExitStack() as stack:
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
                stack.enter_context(_routed(model, "zero_grad", zero_grad))
            result = self.compiled(*args, **kwargs)
        for backend in (self.backend, self.optimizer_backend, *(calls.backend for calls in self.block_calls)):
            backend.settle_shares()  # every graph of the step has its plan now
        if pinning is not None:
            host_pinning.remember(pinning)
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
    recomputation whose plan fits the device, see ``budget.py``), ``inspect_dir`` (graphs and generated
    code are written there), ``cache_dir`` (compile caches), ``codegen``
    (False: run the rewritten aten graphs without Inductor's code generation),
    ``blocks`` (False: inline repeated blocks instead of compiling one for all),
    ``offload_activations`` (on a GPU without a fixed ``memory_budget``: when the
    plan that fits the device recomputes values a larger budget would save, keep
    those in pinned host memory between forward and backward instead, within
    ``budget.HOST_FRACTION`` of the host's memory, or this share of it if a float
    in (0, 1) is given; see ``offload.py``).
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
