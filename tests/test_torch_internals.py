"""Every private torch API the project reaches through ``torch_internals``, checked on this torch.

A torch release that moves one of them fails here, by name, rather than in a pass or a backend.
``CHECKED_ON`` lists the torch versions these tests passed on; a torch outside it fails the first
test until it is checked and added.
"""
import types

import pytest
import torch

import torch_internals
from torch_internals import aot, dynamo, fx, inductor


def test_this_torch_was_checked():
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert version in torch_internals.CHECKED_ON, (
        f"torch {version} is not in torch_internals.CHECKED_ON {torch_internals.CHECKED_ON}: run "
        "tests/test_torch_internals.py on it and add it")


def _traced_code(fn) -> types.CodeType:
    torch.compile(fn, backend="eager")(torch.ones(2))
    return fn.__code__


def test_dynamo_frame_cache_and_resume_frames():
    def compiled(x):
        return x + 1

    def never(x):
        return x - 1

    torch.compiler.reset()
    code = _traced_code(compiled)
    assert dynamo.cache_entries(code), "a compiled function has a cache entry"
    assert dynamo.cache_entries(never.__code__) == []
    cache = dynamo.resume_frame_cache()
    assert cache is not None and isinstance(vars(cache)["lookup"], classmethod)
    codes = dynamo.always_optimized_codes()
    assert codes is not None and hasattr(codes, "__setitem__")


def test_dynamo_tracer_is_visible_to_a_backend_only():
    seen = []

    def backend(gm, example_inputs):
        tracer = dynamo.current_tracer()
        seen.append(tracer is not None and hasattr(tracer.output, "side_effects"))
        return gm

    assert dynamo.current_tracer() is None
    torch.compiler.reset()
    torch.compile(lambda x: x * 2, backend=backend)(torch.ones(3))
    assert seen == [True]
    assert isinstance(dynamo.tensor_variable_type(), type)


def test_dynamo_automatic_dynamic_hook():
    hook = dynamo.automatic_dynamic()
    assert hook is not None
    builder, pgo = hook
    assert callable(builder.process_automatic_dynamic)
    entry = pgo.FrameStateSizeEntry.make_scalar(pgo.auto_dynamic)
    assert entry.scalar is pgo.auto_dynamic


def test_aot_autograd_pieces():
    before = torch._functorch.config.activation_memory_budget
    with aot.config_patch(activation_memory_budget=0.25):
        assert torch._functorch.config.activation_memory_budget == 0.25
    assert torch._functorch.config.activation_memory_budget == before
    boxed = aot.make_boxed_func(lambda *args: args)
    assert getattr(boxed, "_boxed_call", False)
    seen = []

    def partition(joint, inputs, **kwargs):
        seen.append(True)
        return aot.min_cut_rematerialization_partition(joint, inputs, **kwargs)

    backend = dynamo.aot_autograd(fw_compiler=lambda gm, _: aot.make_boxed_func(gm), bw_compiler=lambda gm, _: aot.make_boxed_func(gm),
                                  partition_fn=partition)
    torch.compiler.reset()
    x = torch.ones(3, requires_grad=True)
    torch.compile(lambda t: (t.sin() * 2).sum(), backend=backend)(x).backward()
    assert seen and torch.allclose(x.grad, 2 * x.detach().cos())


def test_dynamo_compile_timers_and_cache_counters():
    """What a step's start-up phases read (compile_stack/backend/startup.py): a frame's compile,
    the backend call inside it, AOTAutograd's cache counts."""
    from compile_stack.backend import startup

    torch.compiler.reset()
    x = torch.randn(3, requires_grad=True)
    torch.compile(lambda t: (t.cos() * 3).sum(), backend="aot_eager")(x).backward()
    timers = dynamo.timer_totals()
    assert timers[startup.FRAME_COMPILES] >= timers[startup.BACKEND_CALLS] > 0
    with torch._inductor.config.patch(fx_graph_cache=False):
        torch.compile(lambda t: (t.sin() * 2).sum())(x).backward()
    assert any(k.startswith("aot_autograd.autograd_cache_") for k in dynamo.cache_counters()), dynamo.cache_counters()


class _Holder:
    def __init__(self):
        self.scale = 2.0
        self.weights = [torch.randn(3), torch.randn(3)]


def test_dynamo_trace_record_names_sources_guards_and_files():
    """What a proven optimizer update is recorded from (compile_stack/capture/proven_update.py):
    each graph input's source, the guards, the files traced."""
    torch.compiler.reset()
    holder, seen = _Holder(), []

    def backend(gm, example_inputs):
        seen.append(dynamo.trace_record(gm))
        return gm.forward

    def update(h):
        for w in h.weights:
            w.mul_(h.scale)

    torch.compile(update, backend=backend)(holder)
    assert dynamo.trace_record(torch.fx.symbolic_trace(lambda t: t + 1)) is None, "outside a backend call"
    (record,) = seen
    assert record["sources"] == ["L['h'].weights[0]", "L['h'].weights[1]"]
    assert any(name == "L['h'].scale" for _, name in record["guards"]), record["guards"]  # baked in
    assert __file__ in record["files"] and record["shape_guards"] == []


def test_inductor_pieces(tmp_path):
    with inductor.config_patch({"max_autotune": True}, fx_graph_cache=False):
        assert torch._inductor.config.max_autotune and not torch._inductor.config.fx_graph_cache
    assert isinstance(inductor.cache_dir(), str)
    inductor.forget_vec_isas()
    assert issubclass(inductor.CustomGraphPass, object) and issubclass(inductor.CustomPartitionerFn, object)
    assert isinstance(inductor.get_hash_for_files((__file__,)), bytes)
    assert torch.ops.aten.addmm.default in inductor.select_decomp_table()
    from torch.fx.experimental.proxy_tensor import make_fx

    aten_graph = make_fx(lambda x: x.clone() + 1)(torch.ones(4)).graph
    inductor.remove_noop_ops(aten_graph)
    assert "clone" not in str(aten_graph)
    inductor.stable_topological_sort(aten_graph)
    codes = []
    torch.compiler.reset()
    with inductor.output_code_writer(codes.append), inductor.config_patch(fx_graph_cache=False):
        gm = torch.fx.symbolic_trace(lambda x: (x * 3,))
        assert inductor.graph_returns_tuple(gm)
        compiled = inductor.compile_fx(gm, [torch.ones(4)])
    assert torch.equal(compiled(torch.ones(4))[0], torch.full((4,), 3.0))
    assert codes and "def call" in codes[-1]
    single = torch.fx.symbolic_trace(lambda x: x * 3)
    assert not inductor.graph_returns_tuple(single)

    def recompiled(gm, _):
        gm.recompile()
        return gm

    made = inductor.make_graph_return_tuple(single, [torch.ones(4)], recompiled)
    assert torch.equal(made(torch.ones(4)), torch.full((4,), 3.0))
    assert hasattr(inductor.early_patterns, "apply")


def test_fx_fake_tensors_pytree_and_bindings():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.empty(2, 3)
    assert fx.is_fake(fake) and not fx.is_fake(torch.empty(1))
    assert fx.detect_fake_mode([fake]) is mode
    with mode, fx.unset_fake_temporarily():
        assert not fx.is_fake(torch.empty(1))
    leaves, spec = fx.tree_flatten({"a": [1, 2], "b": (3,)})
    assert leaves == [1, 2, 3] and fx.tree_unflatten(leaves, spec) == {"a": [1, 2], "b": (3,)}
    assert fx.tree_leaves(((1,), [2])) == [1, 2]
    assert isinstance(torch.ops.aten.add.Tensor, fx.OpOverload)
    param = torch.nn.Parameter(torch.ones(2))
    data = fx.get_data_attr(param)
    assert not isinstance(data, torch.nn.Parameter) and data.data_ptr() == param.data_ptr()
    fx.set_grad_enabled(False)
    try:
        assert not torch.is_grad_enabled()
    finally:
        fx.set_grad_enabled(True)
    assert fx.sym_sqrt(4.0) == pytest.approx(2.0)
    t = torch.ones(8)
    alone = fx.storage_use_count(t)
    view = t[2:]
    assert fx.storage_use_count(t) == alone + 1
    del view


def test_fx_force_recompile_of_a_lazy_module():
    from torch.fx._lazy_graph_module import _make_graph_module

    traced = torch.fx.symbolic_trace(lambda x: x + 1)
    lazy = _make_graph_module(traced, traced.graph)
    fx.force_recompile(lazy)
    assert "x + 1" in lazy.code or "add" in lazy.code
    assert torch.equal(lazy(torch.zeros(2)), torch.ones(2))


def test_fsdp_state_entry_points():
    """The FSDPState methods and attributes torch_internals.fsdp calls (no process group needed to see them)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    from torch_internals import fsdp

    assert callable(FSDPModule._get_fsdp_state)
    for name in ("_pre_forward", "_post_forward"):
        assert callable(getattr(FSDPState, name)), name
    state = FSDPState()
    # _mp_policy and _modules are set by fully_shard: tests/test_distributed.py runs them.
    assert fsdp.forward_root(state) is None
    assert fsdp.state_of(torch.nn.Linear(2, 2)) is None


def test_skipped_functions_leave_dynamos_compile_metrics_writable(monkeypatch):
    """Two Logger methods skipped: Dynamo's metrics still serialize its config here, and on a torch
    that sorts the set (2.11's logging, simulated) they go without it instead of raising."""
    import logging

    from torch._dynamo import utils

    methods = {logging.Logger.info, logging.Logger.warning}
    with dynamo.functions_ignored(methods):
        assert methods <= torch._dynamo.config.ignore_logging_functions
        utils._get_dynamo_config_for_logging()  # no TypeError on this torch
    assert not methods & torch._dynamo.config.ignore_logging_functions

    def sorts_every_set():
        return str(sorted(torch._dynamo.config.ignore_logging_functions))

    monkeypatch.setattr(utils, "_get_dynamo_config_for_logging", sorts_every_set)
    with dynamo.functions_ignored(methods):
        assert utils._get_dynamo_config_for_logging() is None
    assert utils._get_dynamo_config_for_logging is sorts_every_set
