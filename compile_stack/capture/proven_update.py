"""An optimizer's update proven by one compile, then run in later processes without tracing.

Dynamo traces an optimizer's step as Python, once per parameter, in every
process: at 309 parameters that is most of a warm start. Yet the first
compile proves what the step computes: our passes leave one graph (the fused
AdamW call, the step counters), and everything it reads and writes is the
optimizer's own state. ``Recording`` keeps that graph beside the compile
caches as a ``ProvenUpdate``, with where each input comes from in the
optimizer and where each output goes; a later process whose optimizer
matches runs the graph itself (``ProvenUpdate.run``).

A proven update is only reused where it is the same computation:

- its file is keyed by torch's and Python's versions, our joint passes' code,
  the optimizer's class and its *layout* (``Layout``: every attribute, param
  group and state entry: Python scalars by value, each tensor by shape,
  strides, dtype, device, and which entries share one tensor or storage),
  leaving out the scalars the graph takes as inputs (step counters, a
  scheduled lr);
- it holds a hash of every source file Dynamo traced (the optimizer's code,
  torch.optim's, their helpers'): a changed file makes it stale;
- each call checks the layout again: a changed hyper-parameter, a parameter
  without its gradient, ... and the step is traced by Dynamo from then on.

It is recorded only where it can be replayed exactly (``Recording.finish``
says why not, as a note): one graph, taking only the optimizer's own tensors
and scalars and no arguments; its Python effects only stores of its outputs
into the optimizer's scalars, state tensors created as zeros and flags set;
Dynamo's guards only on the optimizer, its arguments, modules and functions
(whose files are hashed) and global state; no symbolic-shape guards.
"""
import dataclasses
import hashlib
import os
import pickle
import re
import sys
from pathlib import Path

import torch

from compile_stack import caches
from compile_stack.capture.optimizer_layout import CONTAINERS, Layout, Missing, assign, describe, resolve, source_path
from torch_internals import aot, dynamo, inductor

FORMAT = 1  # of the records: a change makes older ones unreadable rather than misread

# Guards Dynamo places outside the optimizer that a proven update may leave unchecked: the
# global state it runs under (the key holds what can differ), and the identity of modules,
# functions and classes, whose code the record's file hashes cover.
_GLOBAL_STATE_GUARDS = {"SHAPE_ENV", "DETERMINISTIC_ALGORITHMS", "GRAD_MODE", "DEFAULT_DEVICE", "GLOBAL_STATE",
                        "TORCH_FUNCTION_STATE", "AUTOGRAD_SAVED_TENSORS_HOOKS", "TORCH_FUNCTION_MODE_STACK"}
_IDENTITY_GUARDS = {"MODULE_MATCH", "BUILTIN_MATCH", "CLOSURE_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "ID_MATCH",
                    "TYPE_MATCH", "WEAKREF_ALIVE", "DUPLICATE_INPUT", "DICT_NOT_CONTAINS", "HASATTR",
                    "NOT_PRESENT_IN_GENERIC_DICT"}


@dataclasses.dataclass
class ProvenUpdate:
    """The graph an optimizer's step compiled to, and where its inputs and outputs live."""

    graph: torch.fx.GraphModule
    inputs: list[tuple]  # the path of each graph input
    wrapped: dict[int, tuple]  # input -> (dtype, device): a Python number Dynamo passes as a 0-d tensor
    outputs: list[tuple]  # the scalar each graph output is stored to
    created: list[tuple]  # (path, entry) of the containers and zero tensors the first step creates
    flags: list[tuple]  # (path, value) of the flags the first step sets
    layout: dict  # the optimizer's layout after a step (Layout.masked)
    start: dict  # and before the first, where that creates state
    files: dict[str, str]  # source file -> sha256, of every function Dynamo traced
    counts: dict[str, int]  # what our passes replaced in the graph, for the step's report
    notes: list

    @classmethod
    def load(cls, path: Path) -> "ProvenUpdate | None":
        """The update recorded at ``path``; None if there is none, it does not load, or a file its
        trace read has changed since."""
        try:
            with open(path, "rb") as f:
                record = pickle.load(f)
        except Exception:  # missing, damaged, or of a torch that cannot load it: trace as without one
            return None
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            return None
        update = record["update"]
        return update if all(file_hash(f) == h for f, h in update.files.items()) else None

    def save(self, path: Path) -> None:
        """Written atomically (ranks share the cache directory); nothing where it cannot be."""
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                pickle.dump({"format": FORMAT, "update": self}, f)
            os.replace(tmp, path)
        except (OSError, pickle.PicklingError, TypeError, AttributeError):
            tmp.unlink(missing_ok=True)

    def volatile(self) -> set[tuple]:
        return set(self.inputs) | set(self.outputs)

    def run(self, optimizer) -> bool:
        """One step of ``optimizer`` by this update; False (nothing changed) where its layout does
        not match the recorded one."""
        volatile = self.volatile()
        layout = Layout(optimizer).masked(volatile)
        if layout != self.layout:
            if layout != self.start:
                return False
            self._first_step_state(optimizer)
            if Layout(optimizer).masked(volatile) != self.layout:
                return False
        args = [resolve(optimizer, p) for p in self.inputs]
        for i, (dtype, device) in self.wrapped.items():
            args[i] = torch.tensor(args[i], dtype=_dtype(dtype), device=device)
        with torch.no_grad():
            outs = self.graph(*args)
        for path, value in zip(self.outputs, outs):
            assign(optimizer, path, value)
        return True

    def _first_step_state(self, optimizer) -> None:
        """The state the first step creates (torch.optim's), where none is there yet."""
        for path, value in self.flags:
            try:
                if resolve(optimizer, path) != value:
                    assign(optimizer, path, value)
            except Missing:
                continue
        for path, entry in self.created:
            try:
                resolve(optimizer, path)
                continue
            except Missing:
                pass
            if entry[0] == "tensor":
                shape, stride, dtype, device = entry[1], entry[2], _dtype(entry[3]), entry[4]
                assign(optimizer, path, torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_())
            else:
                assign(optimizer, path, {})


def _dtype(name: str) -> torch.dtype:
    """``torch.bfloat16`` from its ``str``, as a layout records it."""
    return getattr(torch, name.removeprefix("torch."))


def save_refusal(path: Path, reason: str, files: dict[str, str]) -> None:
    """Why the step at ``path`` cannot be proven, so that later processes keep AOTAutograd's cache
    for it rather than compile it again to record (``Recording.backend``)."""
    caches.write_record(path.with_suffix(".refused.json"), {"format": FORMAT, "reason": reason, "files": files})


def refusal(path: Path) -> str | None:
    """The reason ``save_refusal`` left for ``path``, unless a file its trace read has changed since."""
    record = caches.read_record(path.with_suffix(".refused.json"))
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        return None
    return record["reason"] if all(file_hash(f) == h for f, h in record["files"].items()) else None


def file_hash(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def record_path(optimizer, layout: Layout, passes_id: str) -> Path:
    """Where the proven update of ``optimizer`` in ``layout`` (before its step) lives.

    Keyed by the layout with every Python number's value left out: which of them the graph takes
    as inputs is known only once it is proven. The update checks the values itself (``run``);
    another lr in the same layout records its own update over this one."""
    numbers = {path for path, entry in layout.entries.items() if entry[0] in ("int", "float")}
    key = repr((FORMAT, torch.__version__, sys.version_info[:2], passes_id,
                f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
                torch.are_deterministic_algorithms_enabled(), str(torch.get_default_dtype()),
                sorted(layout.masked(numbers).items(), key=repr)))
    return (Path(inductor.cache_dir()) / "cstack_proven_updates"
            / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.pkl")


class Recording:
    """What one Dynamo-compiled step of an optimizer did, gathered to make its ``ProvenUpdate``.

    ``backend`` wraps the step's backend; between ``start`` and ``finish`` it gathers the graph
    Dynamo captured, its sources and guards, our passes' graph and the values the compiled graph
    was called with and returned."""

    def __init__(self, self_source: str):
        self.self_source = self_source
        self.active = False
        # Each compiled graph that ran: (its trace, our passes' graphs of it, the values it was called
        # with, the positions of those created as zeros since the step began, what it returned). A
        # graph Dynamo compiled but never ran (it restarted its trace) is not the step's.
        self.calls: list[tuple] = []
        self.traced_files: dict[str, str] = {}  # of the graph that ran: what a refusal depends on

    def start(self, before: Layout) -> None:
        self.active, self.before, self.calls, self.traced_files = True, before, [], {}

    def backend(self, inner):
        """``inner`` (a PassBackend), gathering while a recording is active."""

        def compile_graph(gm, example_inputs):
            if not self.active:
                return inner(gm, example_inputs)
            trace = dynamo.trace_record(gm)
            inner.kept_joint = []
            try:
                # AOTAutograd's cache would skip our passes, whose graph is what is recorded.
                with aot.config_patch(enable_autograd_cache=False):
                    compiled = inner(gm, example_inputs)
                joint = inner.kept_joint
                # The tensors Dynamo kept as the graph's attributes (torch.optim's state and parameters):
                # AOTAutograd makes them the first inputs of the graph our passes see.
                if trace is not None:
                    trace["lifted"] = list({**dict(gm.named_parameters(remove_duplicate=False)),
                                            **dict(gm.named_buffers(remove_duplicate=False))}.values())
                    trace["new"] = self._new_zeros(trace["lifted"])  # the graph has not run yet
            finally:
                inner.kept_joint = None
            return self._watched(compiled, trace, joint)

        return compile_graph

    def _watched(self, compiled, trace: dict | None, joint: list):
        def call(*args):
            if self.active:
                new = self._new_zeros(args)
                outs = compiled(*args)
                self.calls.append((trace, joint, list(args), new, outs))
                return outs
            return compiled(*args)

        return call

    def abandon(self) -> None:
        """Nothing to prove (the step failed)."""
        self.active, self.calls = False, []

    def _new_zeros(self, values) -> set[int]:
        """The positions of the tensors among ``values`` created since the step began, if zeros."""
        return {i for i, a in enumerate(values) if isinstance(a, torch.Tensor)
                and id(a) not in self.before.tensor_paths and not torch.count_nonzero(a)}

    def finish(self, after: Layout, returned) -> ProvenUpdate | str | None:
        """The update proven, or why it cannot be (its ``counts`` and ``notes`` left to the caller);
        None where the step compiled nothing (Dynamo ran what it compiled for an earlier optimizer
        of this process: nothing was traced)."""
        self.active = False
        try:
            return self._prove(after, returned)
        finally:
            self.calls = []

    def _prove(self, after: Layout, returned):
        if not self.calls:
            return None
        if len(self.calls) != 1:
            return f"its step ran {len(self.calls)} compiled graphs (one was expected)"
        ((trace, joint, args, new, outs),) = self.calls
        if trace is None:
            return "this torch does not say what Dynamo traced"
        self.traced_files = {f: file_hash(f) for f in trace["files"]}
        if len(joint) != 1:
            return f"its graph went through our passes {len(joint)} times (once was expected)"
        graph = joint[0]
        if returned is not None:
            return "its step returns a value"
        if after.opaque or self.before.opaque:
            return f"it holds what cannot be compared across processes ({(after.opaque or self.before.opaque)[0]})"
        bad_guard = next((f"{kind} on {name}" for kind, name in trace["guards"] if not self._allowed(kind, name)), None)
        if bad_guard is not None:
            return f"Dynamo guards on what is not the optimizer's own ({bad_guard})"
        if trace["shape_guards"]:
            return f"Dynamo guards its symbols ({trace['shape_guards'][0]})"
        if any(file_hash(f) is None for f in trace["files"]):
            return "its trace ran code with no source file"
        placeholders = len(graph.graph.find_nodes(op="placeholder"))
        lifted = trace["lifted"]
        if not len(args) == len(trace["sources"]) or len(lifted) + len(args) != placeholders:
            return f"its graph takes {placeholders} inputs for {len(lifted) + len(args)} values"
        inputs, wrapped = [], {}
        for arg, source in zip(lifted + args, [None] * len(lifted) + trace["sources"]):
            path = after.tensor_paths.get(id(arg)) if isinstance(arg, torch.Tensor) else None
            if path is None:
                path = source_path(source, self.self_source)
                if path is not None and after.entries.get(path, ("",))[0] not in ("int", "float"):
                    path = None
                if path is not None and isinstance(arg, torch.Tensor):  # a float Dynamo made a tensor
                    wrapped[len(inputs)] = (str(arg.dtype), str(arg.device))
            if path is None:
                return f"its graph reads {source}, which is not the optimizer's"
            inputs.append(path)
        new = trace["new"] | {i + len(lifted) for i in new}
        return self._effects(after, graph, new, outs, inputs, wrapped, trace["files"])

    def _effects(self, after, graph, new, outs, inputs, wrapped, files):
        """The update, if every change the step made to the optimizer is one it can replay."""
        before, outputs, flags, created = self.before.entries, [], [], []
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        new_paths = {inputs[i] for i in new}
        for path, entry in after.entries.items():
            old = before.get(path)
            if old == entry:
                continue
            if old is None:
                if entry[0] == "tensor" and path not in new_paths:
                    return f"its step creates {describe(path)}, which is not zeros it then reads"
                if entry[0] not in ("tensor", "dict"):
                    return f"its step creates {describe(path)}"
                created.append((path, entry))
            elif entry[0] in ("int", "float") and old[0] == entry[0]:
                matches = [i for i, o in enumerate(outs) if type(o) is type(entry[1]) and o == entry[1]]
                if len(matches) != 1:
                    return f"its step changes {describe(path)} to a value not one of its graph's outputs"
                outputs.append((matches[0], path))
            elif entry[0] == "bool" and old[0] == "bool":
                flags.append((path, entry[1]))
            elif not (old[0] == entry[0] and old[0] in CONTAINERS):  # a container that grew
                return f"its step changes {describe(path)}"
        if sorted(i for i, _ in outputs) != list(range(len(outs))):
            return "its graph returns values it does not store in the optimizer"
        if any(path not in after.entries for path in before):
            return "its step removes state"
        output_paths = [path for _, path in sorted(outputs)]
        volatile = set(inputs) | set(output_paths)
        return ProvenUpdate(graph=graph, inputs=inputs, wrapped=wrapped, outputs=output_paths, created=created,
                            flags=flags, layout=after.masked(volatile), start=self.before.masked(volatile),
                            files={f: file_hash(f) for f in files}, counts={}, notes=[])

    def _allowed(self, kind: str, name: str) -> bool:
        if re.match(self.self_source, name) or name.startswith(("L['args']", "L['kwargs']", "L['closure']", "L['fn']")):
            return True  # the optimizer (its layout is checked) or the call's arguments (none are taken)
        if name == "" or "L[" not in name and "G[" not in name:
            return kind in _GLOBAL_STATE_GUARDS or kind in _IDENTITY_GUARDS
        return kind in _IDENTITY_GUARDS
