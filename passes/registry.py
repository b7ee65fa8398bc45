"""One registry for our graph passes, and their hook-up into Inductor.

A pass is a function ``graph -> number of replacements`` registered under a
name and an Inductor stage:

- ``pre_grad``: the torch-level graph Dynamo captured, before autograd;
- ``joint``: AOTAutograd's joint forward+backward graph (or the inference
  graph), aten level, before partitioning — where a forward pattern and its
  backward can be replaced together;
- ``post_grad``: each partitioned graph, after functionalization.

``installed()`` puts one ``inductor.CustomGraphPass`` per stage into Inductor's config
hooks. Each has a stable ``uuid`` (a hash of the pass modules' source), so
Inductor's FX-graph cache stays usable. Every run of a pass adds to the
``PassReport`` of the step being compiled (``reporting``, ``current``): what
each pass replaced, and notes on what it saw but left alone. Each compiled step
owns its report, so two steps in one process (a train and an eval step) keep
theirs apart.
"""
import contextlib
import contextvars
import dataclasses
import importlib
import inspect
import pathlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator

import torch

from passes import graph_edit, rejection
from torch_internals import inductor

STAGES = ("pre_grad", "joint", "post_grad")
# Inductor config hook per stage.
_HOOKS = {
    "pre_grad": "pre_grad_custom_pass",
    "joint": "joint_custom_pre_pass",
    "post_grad": "post_grad_custom_post_pass",
}
# Modules whose import registers the project's passes (one per pattern family).
PASS_MODULES = ("passes.param_data", "passes.rope", "passes.attention", "passes.cross_entropy", "passes.adamw",
                "passes.linalg_qr", "passes.newton_schulz")

GraphPassFn = Callable[[torch.fx.Graph], int]


@dataclasses.dataclass(frozen=True)
class RegisteredPass:
    name: str
    stage: str
    fn: GraphPassFn

    @property
    def source_files(self) -> list[str]:
        """The pass's module, or every module of its package: an edit to any part changes the pass."""
        path = pathlib.Path(inspect.getsourcefile(self.fn))
        return sorted(map(str, path.parent.rglob("*.py"))) if path.name == "__init__.py" else [str(path)]


_PASSES: dict[str, RegisteredPass] = {}


@dataclasses.dataclass
class PassReport:
    """Replacements per pass and notes on what a pass saw but did not rewrite."""

    replacements: Counter = dataclasses.field(default_factory=Counter)
    notes: list[str] = dataclasses.field(default_factory=list)
    # How many times each stage of passes ran: unchanged across a compile means a cache hit.
    runs: Counter = dataclasses.field(default_factory=Counter)
    # Passes whose count for some graph is not known (a cache hit with no valid record of it).
    unknown: set = dataclasses.field(default_factory=set)

    def clear(self) -> None:
        self.replacements.clear()
        self.notes.clear()
        self.runs.clear()
        self.unknown.clear()

    def as_dict(self, names: Iterable[str]) -> dict[str, int | None]:
        """Replacements per pass; None where some graph's count is unknown."""
        return {name: None if name in self.unknown else int(self.replacements.get(name, 0)) for name in names}


# The report of the step being compiled or run in this context (``reporting``).
_ACTIVE: contextvars.ContextVar[PassReport] = contextvars.ContextVar("cstack_pass_report")
# The report last made active: where a pass called on its own (a test, a script) writes.
_latest = PassReport()


@contextlib.contextmanager
def reporting(report: PassReport) -> Iterator[PassReport]:
    """Passes write to ``report`` while active (and ``current()`` is it, afterwards too, until
    another report is made active)."""
    global _latest
    token = _ACTIVE.set(report)
    _latest = report
    try:
        yield report
    finally:
        _ACTIVE.reset(token)


def current() -> PassReport:
    """The report passes write to now: the active step's, else the one last active."""
    return _ACTIVE.get(_latest)


def register_pass(name: str, stage: str) -> Callable[[GraphPassFn], GraphPassFn]:
    """Decorator: register ``fn(graph) -> replacements`` as pass ``name`` at ``stage``."""
    if stage not in STAGES:
        raise ValueError(f"stage: expected one of {STAGES}, got {stage!r}")

    def decorate(fn: GraphPassFn) -> GraphPassFn:
        if name in _PASSES and _PASSES[name].fn is not fn:
            raise ValueError(f"name: a pass named {name!r} is already registered")
        _PASSES[name] = RegisteredPass(name, stage, fn)
        return fn

    return decorate


def note(pass_name: str, message: str) -> None:
    """Record something a pass saw but left alone (shown in the run's report)."""
    entry = f"{pass_name}: {message}"
    notes = current().notes
    if entry not in notes:
        notes.append(entry)


def load_all() -> dict[str, RegisteredPass]:
    """Import every pass module (registering its passes) and return the registry."""
    for module in PASS_MODULES:
        importlib.import_module(module)
    return dict(_PASSES)


def resolve(names: Iterable[str] | None) -> list[RegisteredPass]:
    """The registered passes named, in pipeline order; by default the project's pipeline.

    The pipeline is every pass defined in ``PASS_MODULES``; a pass registered
    elsewhere (a test's probe, a user's experiment) runs only when named.
    """
    registry = load_all()
    if names is None:
        chosen = [p for p in registry.values() if p.fn.__module__ in PASS_MODULES]
    else:
        unknown = sorted(set(names) - registry.keys())
        if unknown:
            raise ValueError(f"passes: unknown pass {unknown}; expected some of {sorted(registry)}")
        chosen = [registry[n] for n in names]
    return sorted(chosen, key=_pipeline_position)


def _pipeline_position(p: RegisteredPass) -> tuple[int, int]:
    """Stage, then ``PASS_MODULES``' order (the passes of one stage see each other's rewrites:
    RoPE before attention), whatever order the modules were imported in; other passes last."""
    module = PASS_MODULES.index(p.fn.__module__) if p.fn.__module__ in PASS_MODULES else len(PASS_MODULES)
    return STAGES.index(p.stage), module


class StagePass(inductor.CustomGraphPass):
    """Runs our passes of one stage, in order, and records what they did."""

    def __init__(self, stage: str, passes: list[RegisteredPass], observer=None):
        self.stage = stage
        self.passes = passes
        # Called as observer(stage, graph, when), when in ("before", "after"), around the passes.
        self.observer = observer

    def __call__(self, graph: torch.fx.Graph) -> None:
        current().runs[self.stage] += 1
        if self.observer:
            self.observer(self.stage, graph, "before")
        for p in self.passes:
            before = _shape(graph)
            try:
                count = p.fn(graph)
            except Exception as e:
                if not _same_shape(before, _shape(graph)):
                    raise  # half rewritten: no way on that keeps the graph right
                # Never an exception where eager works: a pass that fails before changing
                # anything leaves the graph as the user wrote it.
                note(p.name, f"failed and left the graph as it was ({type(e).__name__}: {e})")
                continue
            if count:
                graph.lint()
                current().replacements[p.name] += count
        if self.observer:
            self.observer(self.stage, graph, "after")

    def uuid(self) -> bytes:
        files = tuple(sorted({f for p in self.passes for f in p.source_files}
                             | {__file__, graph_edit.__file__, rejection.__file__}))
        return inductor.get_hash_for_files(files, extra=self.stage + ":" + ",".join(p.name for p in self.passes))


def _shape(graph: torch.fx.Graph) -> list[tuple]:
    """Each node with its target and argument objects: a node edit replaces one of them."""
    return [(n, n.op, n.target, n.args, n.kwargs) for n in graph.nodes]


def _same_shape(a: list[tuple], b: list[tuple]) -> bool:
    return len(a) == len(b) and all(x[0] is y[0] and x[1] == y[1] and x[2] is y[2] and x[3] is y[3] and x[4] is y[4]
                                    for x, y in zip(a, b))


def stage_passes(passes: list[RegisteredPass], observer=None) -> dict[str, StagePass]:
    """One StagePass per stage (empty where no pass has that stage)."""
    return {stage: StagePass(stage, [p for p in passes if p.stage == stage], observer) for stage in STAGES}


@contextlib.contextmanager
def installed(names: Iterable[str] | None = None, observer=None,
              stages: Iterable[str] = STAGES) -> Iterator[list[RegisteredPass]]:
    """Install the named passes (default: all) of ``stages`` into Inductor's hooks for the duration."""
    passes = resolve(names)
    patch = {_HOOKS[stage]: sp for stage, sp in stage_passes(passes, observer).items()
             if sp.passes and stage in stages}
    with inductor.config_patch(patch):
        yield passes


def pass_names() -> list[str]:
    """Names of the project's pipeline passes."""
    return [p.name for p in resolve(None)]
