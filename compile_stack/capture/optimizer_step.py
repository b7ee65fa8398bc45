"""The user's optimizer step compiled as its own graph, its Python scalars traced as symbols.

Dynamo would bake an optimizer's Python step count and a scheduler's ``lr`` in
as constants and recompile at each change; ``CompiledOptimizerStep`` compiles
``optimizer.step`` with those traced as symbols from the first compile, and
routes the optimizer's ``step`` and ``zero_grad`` while the compiled step runs.
Its first step records what the compile proved (``proven_update.py``); a later
process whose optimizer matches runs that instead of tracing the step again.
"""
import contextlib
import dis
import re

import torch

from compile_stack.backend import PassBackend
from compile_stack.capture.local_shards import LocalShards
from compile_stack.capture.proven_update import Layout, ProvenUpdate, Recording, record_path, refusal, save_refusal
from compile_stack.capture.reachable import inspect_target
from passes import registry
from passes.registry import note
from torch_internals import dynamo


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
    ``CompiledOptimizerStep`` makes the named floats symbolic, and keeps every
    other float a constant.
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
    Every other float stays a constant even after it changes (Dynamo would
    make it a symbol at its second value): a new value recompiles the step,
    fused again, up to Dynamo's recompile limit, past which the step runs
    eagerly. A hand-written optimizer's half-symbolic lr is not fusable (see
    ``step_counter_sources``). Nor is torch.optim's update with a symbolic
    weight decay, beta or eps, and unfused it is not eager's: Dynamo traces
    torch.optim with ``capturable=True``, whose update divides by the step
    size lr/(1 − β₁ᵗ), so lr = 0 makes 0/0 = NaN wherever v = 0
    (pytorch#126514), where eager multiplies by lr = 0.

    A ``torch.optim.Optimizer`` subclass whose ``step`` assigns attributes
    (``self.t += 1``) runs eagerly: Dynamo (2.13) traces such an optimizer as
    its OptimizerVariable, which drops attribute stores, so the compiled step
    would silently keep ``self.t`` at its old value.
    """

    # The optimizer, as the frames Dynamo compiles for ``torch.compile(optimizer.step)`` name it.
    SELF_SOURCE = r"(?:L\['fn'\]\.__self__|L\['self'\]|L\['args'\]\[0\])"

    def __init__(self, optimizer, backend: PassBackend):
        self.optimizer = optimizer
        # An LR scheduler wraps ``optimizer.step`` to note the call (torch.optim.lr_scheduler); Dynamo
        # skips that wrapper's frame, so the update beneath it is what is compiled, and ``_run``
        # notes the call as the wrapper would.
        self.scheduled = getattr(optimizer.step, "_wrapped_by_lr_sched", False)
        self.original = optimizer.step.__wrapped__.__get__(optimizer) if self.scheduled else optimizer.step
        stores = self._attribute_stores(optimizer)
        if stores:
            note("optimizer", f"{type(optimizer).__name__}.step runs eagerly: it assigns attributes "
                              f"({', '.join(sorted(stores))}), which Dynamo drops for torch.optim.Optimizer subclasses")
        # Eagerly means wholly outside Dynamo: a non-recursive disable would let the train step's compile trace it.
        self.recording = Recording(self.SELF_SOURCE)
        self.compiled = (torch.compiler.disable(self.original) if stores
                         else torch.compile(self.original, backend=self.recording.backend(backend)))
        self.backend = backend
        self.provable = not stores  # until its first step: whether it may run a proven update
        self.proven = None  # the proven update it runs instead of Dynamo's trace (proven_update.py)
        self.local_shards = LocalShards(optimizer)  # FSDP2's DTensors: stepped on their local shards
        self.sharded = None  # whether it holds DTensors, found at the first step
        self.call = torch.compiler.disable(self._run, recursive=False)
        if self.scheduled:  # what the scheduler checks, so it does not warn that step was overridden
            self.call._wrapped_by_lr_sched = True
        self.zero_grad = torch.compiler.disable(optimizer.zero_grad)

    def _run(self, *args, **kwargs):
        # ``self.compiled`` is called from this frame, which Dynamo skips: a helper frame between
        # them would be traced by the enclosing step's compile, the optimizer's step inlined there.
        # So is every other frame this one calls, unless disabled like the helpers below.
        contexts = self._enter_contexts()
        try:
            if self.proven is not None:
                if self._run_proven():
                    return None
                self.proven = None  # its layout changed (a new hyper-parameter, ...): traced from now on
            if not (self.provable and not self.sharded and not args and not kwargs):
                self.provable = False
                return self.compiled(*args, **kwargs)
            self.provable = False
            found = self._load_proven()
            if found == "proven":
                return None
            if found == "refused":
                return self.compiled()
            self._start_recording()
            try:
                result = self.compiled()
            except BaseException:
                self.recording.abandon()
                raise
            self._finish_recording(result)
            return result
        finally:
            self._exit_contexts(contexts)

    @torch.compiler.disable
    def _enter_contexts(self) -> contextlib.ExitStack:
        """What the step runs in, entered outside Dynamo (traced, finding FSDP2's DTensors alone cost
        seconds at 309 parameters): its local shards, its scalars traced as symbols, the per-parameter form."""
        sources = step_counter_sources(self.optimizer)
        if self.scheduled:
            self.optimizer._opt_called = True
        with contextlib.ExitStack() as stack:
            for context in (self._on_local_shards(), torch.compiler.config.patch(dynamic_sources=sources),
                            self._dynamic_floats(sources), self._single_tensor()):
                stack.enter_context(context)
            return stack.pop_all()

    @staticmethod
    @torch.compiler.disable
    def _exit_contexts(contexts: contextlib.ExitStack) -> None:
        contexts.close()

    @torch.compiler.disable
    def _run_proven(self) -> bool:
        return self.proven.run(self.optimizer)

    @torch.compiler.disable
    def _load_proven(self) -> str | None:
        """The first step by the update an earlier compile proved, if one matches this optimizer
        ("proven"); "refused" where an earlier compile found it cannot be proven; None: record."""
        name = type(self.optimizer).__name__
        self.before = Layout(self.optimizer)
        passes_id = registry.stage_passes(self.backend.pass_list)["joint"].uuid().hex()
        self.record_path = record_path(self.optimizer, self.before, passes_id)
        update = ProvenUpdate.load(self.record_path)
        try:
            ran = update is not None and update.run(self.optimizer)
        except Exception as e:  # a record this torch cannot run: traced, and recorded again
            note("optimizer", f"{name}.step: its proven update failed ({type(e).__name__}: {e}); traced instead")
            ran = False
        if not ran:
            reason = refusal(self.record_path)
            if reason is not None:
                note("optimizer", f"{name}.step is traced in every process: {reason}")
                return "refused"
            return None
        self.proven = update
        report = registry.current()
        for pass_name, n in update.counts.items():
            report.replacements[pass_name] += n
        report.notes += [entry for entry in update.notes if entry not in report.notes]
        note("optimizer", f"{name}.step runs the update an earlier compile proved, untraced ({self.record_path.name})")
        return "proven"

    @torch.compiler.disable
    def _start_recording(self) -> None:
        report = registry.current()
        self.counts_before, self.notes_before = dict(report.replacements), len(report.notes)
        self.recording.start(self.before)

    @torch.compiler.disable
    def _finish_recording(self, result) -> None:
        """What the first compiled step proved, kept for later processes (or why not, as a note)."""
        proven = self.recording.finish(Layout(self.optimizer), result)
        if proven is None:
            return
        if isinstance(proven, str):
            note("optimizer", f"{type(self.optimizer).__name__}.step is traced in every process: {proven}")
            save_refusal(self.record_path, proven, self.recording.traced_files)
            return
        report, before = registry.current(), self.counts_before
        proven.counts = {p: n - before.get(p, 0) for p, n in report.replacements.items() if n != before.get(p, 0)}
        proven.notes = report.notes[self.notes_before:]
        proven.save(self.record_path)

    @contextlib.contextmanager
    def _on_local_shards(self):
        """FSDP2's sharded parameters swapped for their local shards while active (none to swap
        without DTensors, found at the first step)."""
        if self.sharded is None:
            self.sharded = self.local_shards.holds_dtensors()
            if self.sharded:
                note("optimizer", f"{type(self.optimizer).__name__} steps the local shards of FSDP2's sharded "
                                  "parameters (plain tensors aliasing them), its state kept as DTensors")
        if not self.sharded:
            yield
            return
        params = self.local_shards.swap_in()
        try:
            yield
        finally:
            self.local_shards.swap_out(params)

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
    def _dynamic_floats(cls, sources: str):
        """Floats named in ``sources`` symbolic from their first value; the optimizer's other floats
        constants at every value."""
        hook = dynamo.automatic_dynamic()
        if hook is None:  # a torch without it: floats as Dynamo decides
            yield
            return
        builder, pgo = hook
        patterns = [re.compile(s) for s in sources.split(",") if s]
        own = re.compile(cls.SELF_SOURCE + r"[.\[]")
        original = builder.process_automatic_dynamic

        def process(tx, name, entry, **kwargs):
            if isinstance(entry.scalar, float) and any(p.match(name) for p in patterns):
                entry = pgo.FrameStateSizeEntry.make_scalar(pgo.auto_dynamic)
            elif isinstance(entry.scalar, float) and own.match(name):
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
        with (routed_attribute(self.optimizer, "step", self.call),
              routed_attribute(self.optimizer, "zero_grad", self.zero_grad)):
            yield


@contextlib.contextmanager
def routed_attribute(obj, name: str, replacement):
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
