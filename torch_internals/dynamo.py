"""Dynamo internals: its frame cache, resume frames, the tracer, automatic-dynamic scalars, the
functions traced code skips, and its compile timers and cache counters.

Each accessor returns None on a torch that lacks what it reaches for; its callers then leave
Dynamo's behaviour as it is.
"""
import contextlib
import types
from unittest import mock

from torch._dynamo import config, eval_frame, resume_execution, utils
from torch._dynamo.backends.common import aot_autograd

__all__ = ["aot_autograd", "real_value", "resume_frame_cache", "always_optimized_codes", "cache_entries",
           "current_tracer", "tensor_variable_type", "automatic_dynamic", "functions_ignored", "timer_totals",
           "cache_counters", "trace_record"]


def resume_frame_cache():
    """The class whose ``lookup`` classmethod makes (and caches) the code of a resume frame after
    a graph break, or None."""
    cache = getattr(resume_execution, "ContinueExecutionCache", None)
    return cache if cache is not None and "lookup" in vars(cache) else None


def always_optimized_codes() -> dict | None:
    """The code objects Dynamo compiles even when their frame holds no tensor (by identity)."""
    return getattr(eval_frame, "always_optimize_code_objects", None)


def cache_entries(code: types.CodeType) -> list | None:
    """The compiled entries Dynamo holds for ``code``; None if this torch cannot tell."""
    entries = getattr(eval_frame, "_debug_get_cache_entry_list", None)
    return None if entries is None else entries(code)


def current_tracer():
    """The instruction translator tracing in this thread, or None outside a Dynamo trace."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        return InstructionTranslator.current_tx()
    except AttributeError:  # no trace in this thread yet
        return None


def real_value(tx, var):
    """The real object a traced variable ``var`` of the trace ``tx`` stands for, by its source
    (``L['model']._modules['layers']...``, evaluated in the traced frame), or None when it has no
    source plain Python can evaluate."""
    source = getattr(var, "source", None)
    if source is None:
        return None
    name = source.name() if callable(source.name) else source.name  # a property in newer torch
    try:
        return eval(name, {"L": tx.f_locals, "G": tx.f_globals})  # noqa: S307 (Dynamo's own source text)
    except Exception:
        return None


def tensor_variable_type() -> type:
    """Dynamo's class of a traced tensor in its side-effect records."""
    from torch._dynamo.variables import TensorVariable

    return TensorVariable


def automatic_dynamic():
    """``(builder, pgo)``: the module whose ``process_automatic_dynamic`` decides whether a traced
    scalar becomes symbolic, and the profile module whose entries it takes; None if absent."""
    from torch._dynamo import pgo
    from torch._dynamo.variables import builder

    if not hasattr(builder, "process_automatic_dynamic") or not hasattr(pgo, "FrameStateSizeEntry"):
        return None
    return builder, pgo


@contextlib.contextmanager
def functions_ignored(functions: set):
    """Dynamo's config patched so that calls of ``functions`` in traced code are skipped (neither
    run nor graph breaks); Dynamo's config as it was on a torch without the setting.

    Where Dynamo's compile metrics cannot write the patched set (torch 2.11 sorts every set of
    its config and leaves this one out of its blocklist: functions do not sort, and each compile
    logged a traceback), the metrics go without Dynamo's config while the patch is in force."""
    if not hasattr(config, "ignore_logging_functions"):
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(config.patch(ignore_logging_functions=set(config.ignore_logging_functions) | set(functions)))
        try:
            utils._get_dynamo_config_for_logging()
        except TypeError:
            stack.enter_context(mock.patch.object(utils, "_get_dynamo_config_for_logging", lambda: None))
        yield


def timer_totals() -> dict[str, float]:
    """Seconds each of Dynamo's compile timers has summed in this process so far (by timer name:
    ``_compile.compile_inner`` a frame's compile, ``OutputGraph.call_user_compiler`` the backend
    called inside it, ...); empty on a torch without them."""
    metrics = getattr(utils, "compilation_time_metrics", None)
    return {} if metrics is None else {name: sum(times) for name, times in metrics.items()}


def cache_counters() -> dict[str, int]:
    """The compile caches' counts so far (``aot_autograd.autograd_cache_hit``,
    ``inductor.fxgraph_cache_miss``, ...); empty on a torch without them."""
    counters = getattr(utils, "counters", {})
    return {f"{group}.{name}": n for group in ("aot_autograd", "inductor")
            for name, n in counters.get(group, {}).items() if "cache" in name}


def trace_record(gm) -> dict | None:
    """What the graph being compiled (``gm``, as a backend receives it) was traced from and under,
    read inside the backend: ``sources`` (each placeholder's source, as Dynamo names it),
    ``guards`` (``(kind, name)`` of each guard Dynamo placed), ``files`` (the source files of every
    function it traced) and ``shape_guards`` (its symbolic-shape guards, as text). None outside a
    backend call, or on a torch that does not keep these."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    if context is None or not hasattr(context, "traced_code") or context.fake_mode is None:
        return None
    sources = []
    for node in gm.graph.find_nodes(op="placeholder"):
        arg = node.meta.get("grapharg")
        source = getattr(arg, "source", None)
        name = getattr(source, "name", None)
        sources.append(name() if callable(name) else name)
    guards = [(guard.create_fn_name(), guard.name) for guard in context.guards_context.dynamo_guards]
    shape_env = context.fake_mode.shape_env
    shape_guards = [str(g.expr) for g in shape_env.guards] if shape_env is not None else []
    return {"sources": sources, "guards": guards, "files": sorted({c.co_filename for c in context.traced_code}),
            "shape_guards": shape_guards}
