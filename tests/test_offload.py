"""Activation offload: the plan (compile_stack/offload.py, budget.py) and the ops
(custom_ops/activation_offload).

The plan is tested on the CPU: a ledger stands in for a GPU whose memory does
not hold the budget-1.0 plan, the ledger's device is the CPU, and the ops copy
within host memory there, so the edited forward and backward run and give
eager's gradients. The asynchronous copies, the prefetch and the pinned
buffers need CUDA (``-m gpu``).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.library import opcheck

from compile_stack.memory_plan import MemoryPlan, offload
from compile_stack.memory_plan.ledger import SCRATCH_BYTES, MemoryLedger
from compile_stack.backend import PassBackend
from compile_stack.capture.step import plan_refusal
from custom_ops.activation_offload import TRANSFERS, host_buffers, offload_to_host, reload_to_device
from passes import registry
from tests.helpers import record_graphs

HAS_CUDA = torch.cuda.is_available()
CPU = torch.device("cpu")


class GatedFeedForward(nn.Module):
    """A pre-norm SwiGLU feed-forward block, written as a user would."""

    def __init__(self, width=16, hidden=48):
        super().__init__()
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        h = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


@pytest.fixture
def case(monkeypatch, request):
    device = getattr(request, "param", CPU)
    monkeypatch.setattr(offload, "MIN_BYTES", 1)  # the test's activations are small
    model = nn.Sequential(GatedFeedForward(), GatedFeedForward()).to(device)
    x = torch.randn(4, 33, 16, requires_grad=True, device=device)
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    graphs = record_graphs(monkeypatch, stage="post_grad")
    return model, x, expected, graphs


USES = 8  # the graph counts as serving this many call sites (a model's blocks)


def compile_at(case, capacity: float, host: int, codegen: bool = False) -> tuple[MemoryLedger, list[str]]:
    """Compile (``codegen``: by Inductor) and run the case's step twice with a ledger of ``capacity``
    device and ``host`` host bytes, its graph counted USES times; the ledger and the offload/reload
    ops its graphs hold."""
    model, x, expected, graphs = case
    torch._dynamo.reset()
    registry.current().clear()
    graphs.clear()
    book = MemoryLedger(capacity, allocated=lambda: 0, future_state=lambda: 0, host_capacity=host, device=x.device)
    step = torch.compile(model, backend=PassBackend(passes=[], codegen=codegen, plan=MemoryPlan(book), uses=USES))
    # Compiled anew, not served from a cache: the ledger is filled by the partitioner's run.
    with (torch._inductor.config.patch(fx_graph_cache=False),
          torch._functorch.config.patch(enable_autograd_cache=False)):
        _run_twice(step, model, x, expected, codegen)
    ops = [n.target.name() for g in graphs for n in g.nodes if n.target in (offload.OFFLOAD, offload.RELOAD)]
    return book, ops


def _run_twice(step, model, x, expected, codegen):
    for _ in range(2):  # the second call reuses the host buffers
        model.zero_grad(set_to_none=True)
        step(x).square().sum().backward()
        for got, want in zip((p.grad for p in model.parameters()), expected):
            # Inductor's fused kernels round differently from eager; wrong data would be far off.
            torch.testing.assert_close(got, want, **({"rtol": 1e-3, "atol": 1e-4} if codegen else {}))


def full_plan_bytes(case) -> int:
    book, _ = compile_at(case, 1e15, 0)
    (saved,) = book.reserved.values()
    return saved


@pytest.mark.parametrize("case", [CPU, pytest.param(torch.device("cuda"), marks=[
    pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")])], indirect=True)
def test_a_plan_that_recomputes_moves_the_extra_values_to_the_host(case):
    """On the CPU the aten graphs run as they are; on a GPU Inductor compiles them (its lowering
    of the ops, the side stream's copies)."""
    codegen = case[1].is_cuda
    full = full_plan_bytes(case)
    capacity = SCRATCH_BYTES + full / USES + 0.5 * full  # one call's working set and half the full plan
    without, ops = compile_at(case, capacity, host=0, codegen=codegen)
    assert ops == []
    TRANSFERS.release()
    book, ops = compile_at(case, capacity, host=10**9, codegen=codegen)
    (on_gpu,) = book.reserved.values()
    (on_host,) = book.host_reserved.values()
    if codegen:  # the graphs are Inductor's: the pinned buffers show the offloads ran
        assert TRANSFERS.pool.pinned_bytes() >= on_host // USES
    else:
        assert ops.count("cstack::offload_to_host") == ops.count("cstack::reload_to_device") > 0
    assert 0 < on_host and on_gpu <= max(without.reserved.values())
    note = next(n for n in registry.current().notes if n.startswith("memory:"))
    assert "in host memory" in note


def test_a_host_without_room_keeps_the_recomputing_plan(case):
    full = full_plan_bytes(case)
    book, ops = compile_at(case, SCRATCH_BYTES + full / USES + 0.5 * full, host=1)
    assert ops == [] and list(book.host_reserved.values()) == [0]


def refused_at(case, capacity: float, host: int):
    with pytest.raises(Exception) as raised:
        compile_at(case, capacity, host)
    refused = plan_refusal(raised.value)
    assert refused is not None and "does not fit" in str(refused), raised.value
    return refused.shortfall


def test_a_step_that_does_not_fit_even_offloading_is_refused_before_it_runs(case):
    """Where even the least plan does not fit the GPU, the plans with values in host memory are
    tried; none fitting (the block's input stays on the GPU), the step is refused, the message
    saying what the host had."""
    least = refused_at(case, SCRATCH_BYTES + 1, host=0)
    assert not least.offload_on and least.saved > least.room
    offloading = refused_at(case, SCRATCH_BYTES + 1, host=10**9)
    assert offloading.offload_on and offloading.host == 10**9
    assert "host memory for offload 0.9 GiB" in offloading.message()


def test_a_plan_that_fits_moves_nothing(case):
    book, ops = compile_at(case, 1e15, host=10**9)
    assert ops == [] and list(book.host_reserved.values()) == [0]


def partition_of(fn, args, saved: list[str], user_outputs: int = 1):
    """``fn`` traced as a partition's forward returning its own outputs and then the nodes named
    ``saved``, and a backward taking those (and one tangent) that returns their sum."""
    forward = make_fx(fn, tracing_mode="fake")(*args)
    graph = forward.graph
    nodes = {n.name: n for n in graph.nodes}
    output = graph.find_nodes(op="output")[0]
    returned = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    output.args = (tuple(returned[:user_outputs]) + tuple(nodes[name] for name in saved),)
    forward.recompile()
    backward = torch.fx.Graph()
    inputs = [backward.placeholder(name) for name in saved]
    for node, name in zip(inputs, saved):
        node.meta["val"] = nodes[name].meta["val"]
    backward.placeholder("tangents_1")
    total = inputs[0]
    for node in inputs[1:]:
        total = backward.call_function(torch.ops.aten.add.Tensor, (total, backward.call_function(
            torch.ops.aten.sum.default, (node,))))
    backward.output((total,))
    return forward, torch.fx.GraphModule(torch.nn.Module(), backward)


def mlp(x, w, v):
    hidden = x @ w  # mm: read by tanh, whose result the next matmul (mm_1) reads
    return torch.tanh(hidden) @ v


def viewed(x, w, v):
    hidden = x @ w
    return hidden.tanh().sum() + hidden.view(-1)[0]


MLP_ARGS = (torch.randn(64, 32), torch.randn(32, 32), torch.randn(32, 8))


def test_a_matmul_output_moves_after_the_matmul_that_ends_its_reading(monkeypatch):
    monkeypatch.setattr(offload, "MIN_BYTES", 1)
    forward, backward = partition_of(mlp, MLP_ARGS, saved=["mm", "tanh"])
    assert [n.name for n in offload.movable_values(forward, backward, 1, CPU)] == ["mm", "tanh"]
    expected = backward(*forward(*MLP_ARGS)[1:], None)
    (mm,) = [n for n in forward.graph.nodes if n.name == "mm"]
    offload.apply(forward, backward, [mm])
    (copy_out,) = forward.graph.find_nodes(op="call_function", target=offload.OFFLOAD)
    assert copy_out.args[0] is mm and [a.name for a in copy_out.args[1]] == ["mm_1"]
    assert copy_out.prev.name == "mm_1"  # placed where its order puts it
    (copy_back,) = backward.graph.find_nodes(op="call_function", target=offload.RELOAD)
    assert copy_back.args[0].name == "mm" and copy_back.args[0].meta["val"].device == CPU
    assert copy_back.args[2] == 64 * 32 * 4  # one call's moved bytes copied back ahead
    outputs = forward(*MLP_ARGS)
    assert outputs[1].device == CPU
    torch.testing.assert_close(backward(*outputs[1:], None), expected, rtol=0, atol=0)


def transposed_result(x, w, v):
    hidden = (x @ w).t().clone()  # dense, laid out [32, 64] column-major: not a view, not contiguous
    return torch.tanh(hidden).t() @ v


def test_a_dense_value_in_another_dim_order_moves_as_its_memory(monkeypatch):
    """Attention's output in v's layout: copied out as its memory seen contiguous (a permute, no
    copy), and permuted back to its strides after the reload."""
    monkeypatch.setattr(offload, "MIN_BYTES", 1)
    forward, backward = partition_of(transposed_result, MLP_ARGS, saved=["clone"])
    (clone,) = offload.movable_values(forward, backward, 1, CPU)
    assert clone.name == "clone" and not clone.meta["val"].is_contiguous()
    expected = backward(*forward(*MLP_ARGS)[1:], None)
    offload.apply(forward, backward, [clone])
    (copy_out,) = forward.graph.find_nodes(op="call_function", target=offload.OFFLOAD)
    assert copy_out.args[0].target is torch.ops.aten.permute.default and copy_out.args[0].args[0] is clone
    assert copy_out.args[0].meta["val"].is_contiguous()
    (copy_back,) = backward.graph.find_nodes(op="call_function", target=offload.RELOAD)
    (back,) = copy_back.users
    assert back.target is torch.ops.aten.permute.default
    assert back.meta["val"].stride() == clone.meta["val"].stride() and back.meta["val"].shape == clone.meta["val"].shape
    outputs = forward(*MLP_ARGS)
    assert outputs[1].device == CPU
    torch.testing.assert_close(backward(*outputs[1:], None), expected, rtol=0, atol=0)


def fused_loss(hidden, weight, targets):
    loss, *_ = torch.ops.cstack.linear_cross_entropy_fwd(hidden, weight, targets, -100, "mean")
    return loss * 2


def test_an_item_nothing_in_the_forward_reads_moves_right_after_it(monkeypatch):
    """The fused loss's weight gradient, made in the forward and only saved: its copy waits for
    nothing, and comes after the item itself, not after the op's first item."""
    monkeypatch.setattr(offload, "MIN_BYTES", 1)
    args = (torch.randn(12, 16), torch.randn(40, 16), torch.randint(0, 40, (12,)))
    forward, backward = partition_of(fused_loss, args, saved=["getitem_2"])
    (weight_grad,) = offload.movable_values(forward, backward, 1, CPU)
    expected = backward(*forward(*args)[1:], None)
    offload.apply(forward, backward, [weight_grad])
    forward.graph.lint()
    (copy_out,) = forward.graph.find_nodes(op="call_function", target=offload.OFFLOAD)
    assert copy_out.args[0] is weight_grad and copy_out.args[1] == [] and copy_out.prev is weight_grad
    outputs = forward(*args)
    assert outputs[1].device == CPU
    torch.testing.assert_close(backward(*outputs[1:], None), expected, rtol=0, atol=0)


@pytest.mark.parametrize("why, fn, saved, min_bytes", [
    ("returned to the caller too", lambda x, w, v: (x @ w).tanh(), ["tanh"], 1),
    ("a view of it is saved", viewed, ["mm", "view"], 1),
    ("a graph input", mlp, ["x_1"], 1),
    ("smaller than MIN_BYTES", mlp, ["mm"], 64 * 32 * 4 + 1),
])
def test_values_that_stay_on_the_device(monkeypatch, why, fn, saved, min_bytes):
    monkeypatch.setattr(offload, "MIN_BYTES", min_bytes)
    forward, backward = partition_of(fn, MLP_ARGS, saved=saved)
    assert offload.movable_values(forward, backward, 1, CPU) == [], why


def test_the_ops_pass_opcheck_and_move_values_unchanged():
    x = torch.randn(5, 7, requires_grad=True)
    opcheck(torch.ops.cstack.offload_to_host.default, (x, [torch.randn(3)], 2**20))
    opcheck(torch.ops.cstack.reload_to_device.default, (x, CPU, 2**20))
    host = offload_to_host(x.detach(), [], 0)
    assert host.device == CPU and torch.equal(host, x) and host.data_ptr() != x.data_ptr()
    assert torch.equal(reload_to_device(host, CPU, 0), x)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="x: expected a contiguous tensor"):
        offload_to_host(torch.randn(4, 6).t(), [], 0)
    with pytest.raises(ValueError, match="x: expected a contiguous tensor"):
        reload_to_device(torch.randn(4, 6).t(), CPU, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("in_flight", [0, 2**40])
def test_gpu_round_trips_in_reverse_order_with_copies_started_ahead(in_flight):
    """Offloads as a forward makes them, each source changed in place once its copy is done (so
    none may come back as it is); reloads in reverse (the prefetch's order, two activations
    ahead) and then out of order; every value comes back. (Changed while its copy runs, a source
    would race the copy: the compiled graphs never do that, their buffers are not reused.)"""
    TRANSFERS.release()
    device = torch.device("cuda")
    sources = [torch.randn(1024, 777 + i, device=device) for i in range(6)]
    expected = [s.cpu() for s in sources]
    hosts = []
    for source in sources:
        hosts.append(offload_to_host(source, [], in_flight))
        torch.cuda.synchronize()
        source.mul_(-1.0)
    for i in (5, 4, 3, 0, 2, 1):
        back = reload_to_device(hosts[i], device, 7 * 2**20)
        assert back.data_ptr() != sources[i].data_ptr()
        torch.testing.assert_close(back.cpu(), expected[i], rtol=0, atol=0)
    assert all(h.is_pinned() for h in hosts)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_sources_within_in_flight_come_back_as_they_are():
    """The latest source stays held and comes back without a copy, as may those within
    ``in_flight`` bytes before it whose copies were still running; older ones were let go and
    are copied back; all values right."""
    TRANSFERS.release()
    device = torch.device("cuda")
    sources = [torch.randn(1024, 1024, device=device) for _ in range(5)]
    expected = [s.cpu() for s in sources]
    hosts = [offload_to_host(s, [], 2 * 4 * 2**20) for s in sources]  # two earlier sources may stay
    backs = {i: reload_to_device(hosts[i], device, 4 * 2**20) for i in (4, 3, 2, 1, 0)}
    for i, back in backs.items():
        torch.testing.assert_close(back.cpu(), expected[i], rtol=0, atol=0)
    as_they_are = [backs[i].data_ptr() == sources[i].data_ptr() for i in range(5)]
    assert as_they_are[:2] == [False, False] and as_they_are[4]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_host_buffers_are_exact_and_reused_once_free():
    TRANSFERS.release()
    x = torch.randn(1000, 1001, device="cuda")
    first = offload_to_host(x, [], 0)
    address = first.data_ptr()
    second = offload_to_host(x, [], 0)
    assert second.data_ptr() != address  # the first is still held
    del first
    torch.cuda.synchronize()
    third = offload_to_host(x, [], 0)
    assert third.data_ptr() == address and third.untyped_storage().nbytes() == x.numel() * 4
    del second, third
    TRANSFERS.release()
    assert TRANSFERS.pool.pinned_bytes() == 0


def test_held_sources_are_let_go_when_copied_unheld_or_beyond_the_limit():
    """A source copied out stays held until its copy is done, its host copy is dropped, or newer
    sources pass ``in_flight`` bytes (oldest first); the newest is always kept."""
    from custom_ops.activation_offload.transfers import Offloaded, Transfers

    class Copy:  # a held source whose copy is done or not (no GPU here)
        def __init__(self, nbytes, done):
            self.nbytes, self.finished, self.released = nbytes, done, False
            self.done = self

        def query(self):
            return self.finished

        def release(self):
            self.released = True

    transfers = Transfers()
    buffers = [torch.empty(100, dtype=torch.uint8) for _ in range(5)]
    hosts = [b[:] for b in buffers]  # the saved host copies viewing each buffer
    copies = [Copy(100, done) for done in (False, True, False, False, False)]
    for buffer, copy in zip(buffers, copies):
        transfers._offloaded.append(Offloaded(buffer, buffer.shape, buffer.dtype, torch.device("cpu")))
        transfers._held[buffer.data_ptr()] = copy
    del hosts[2]  # its host copy dropped: let go though its copy still runs
    transfers._let_go(keep=buffers[4].data_ptr(), limit=150)
    # 400 bytes held besides the newest: copy 1 is done, copy 2 unheld; then 200 > 150 lets the
    # oldest left go, copy 0; copy 3 stays within the limit, copy 4 is the one kept.
    assert [c.released for c in copies] == [True, True, True, False, False]
    assert list(transfers._held) == [buffers[3].data_ptr(), buffers[4].data_ptr()]


def test_pool_pins_ahead_what_a_step_needed(monkeypatch):
    """The pool counts the most buffers of a size held at once; pinning ahead that many (within
    the limit) hands them out without pinning in the caller."""
    pinned_here = []
    monkeypatch.setattr(host_buffers, "_pinned", lambda n: torch.empty(n, dtype=torch.uint8))
    pool = host_buffers.HostBufferPool()
    held = [pool.acquire(1000)[:] for _ in range(3)]  # a view holds a buffer, as an offload's result does
    del held[0]
    held.append(pool.acquire(1000)[:])
    assert pool.needed() == {1000: 3}

    unlimited, submitted = host_buffers.HostBufferPool(), []
    monkeypatch.setattr(unlimited, "_submit", lambda nbytes, count: submitted.append((nbytes, count)))
    unlimited.pin_ahead({1000: 3, 10**6: 5})
    assert submitted == [(10**6, 5), (1000, 3)]  # no limit: all of them, largest first

    fresh = host_buffers.HostBufferPool()
    fresh.limit(3 * 10**6 + 1000)  # admits 3 of the large ones
    fresh.pin_ahead({1000: 3, 10**6: 5})
    monkeypatch.setattr(fresh, "_add", lambda n: pinned_here.append(n))
    large = [fresh.acquire(10**6)[:] for _ in range(3)]
    assert pinned_here == [] and all(b.numel() == 10**6 for b in large)
    assert len({b.data_ptr() for b in large}) == 3


def test_pool_pins_spares_only_within_its_limit(monkeypatch):
    """Without a limit a buffer taken starts SPARES more of its size; with one, only as many as
    the limit leaves room for; a buffer a step asks for is pinned regardless."""
    monkeypatch.setattr(host_buffers, "_pinned", lambda n: torch.empty(n, dtype=torch.uint8))
    monkeypatch.setattr(host_buffers, "SPARES", 4)
    for limit, spares in ((None, [4]), (3500, [2])):
        pool = host_buffers.HostBufferPool()
        if limit is not None:
            pool.limit(limit)
        submitted = []
        monkeypatch.setattr(pool, "_submit", lambda nbytes, count: submitted.append(count))
        held = [pool.acquire(1000)[:]]
        assert submitted == spares
    held += [pool.acquire(1000)[:] for _ in range(4)]  # (the spares were never pinned: _submit is mocked)
    assert pool.pinned_bytes() == 5000 and submitted == [2, 1]  # room for one more spare, then none


def test_huge_page_advice_covers_the_whole_huge_pages_inside_a_buffer():
    page = host_buffers.HUGE_PAGE
    buffer = torch.empty(5 * page + 12345, dtype=torch.uint8)
    start, end = host_buffers.advise_huge_pages(buffer)
    assert start % page == 0 and end % page == 0
    assert buffer.data_ptr() <= start < buffer.data_ptr() + page and end - start >= 4 * page
    assert end <= buffer.data_ptr() + buffer.numel()
    small = torch.empty(page // 2, dtype=torch.uint8)
    start, end = host_buffers.advise_huge_pages(small)
    assert start == end


def test_remembered_buffers_are_keyed_by_what_decides_the_plan(monkeypatch, tmp_path):
    from compile_stack import caches
    from compile_stack.memory_plan import host_pinning

    monkeypatch.setenv(caches.CACHE_ENV, str(tmp_path))
    asked = []

    class Pool:
        def needed(self):
            return {2**30: 68}

        def pin_ahead(self, needed):
            asked.append(needed)

    monkeypatch.setattr(host_pinning.TRANSFERS, "pool", Pool())
    model = nn.Linear(4, 4)
    key = host_pinning.step_key((torch.zeros(2, 8, dtype=torch.long),), [model], 1e11, 2**36)
    assert key == host_pinning.step_key((torch.ones(2, 8, dtype=torch.long),), [model], 1e11, 2**36)
    others = [host_pinning.step_key((torch.zeros(2, 9, dtype=torch.long),), [model], 1e11, 2**36),
              host_pinning.step_key((torch.zeros(2, 8, dtype=torch.long),), [nn.Linear(4, 5)], 1e11, 2**36),
              host_pinning.step_key((torch.zeros(2, 8, dtype=torch.long),), [model], 1e11, 2**35)]
    assert key not in others
    host_pinning.pin_remembered(key)
    assert asked == []  # nothing remembered yet
    host_pinning.remember(key)
    host_pinning.pin_remembered(others[0])
    host_pinning.pin_remembered(key)
    assert asked == [{2**30: 68}]
    (tmp_path / "inductor" / host_pinning.FILE).write_text("{not json")
    host_pinning.pin_remembered(key)  # a damaged file is ignored
    assert len(asked) == 1
    monkeypatch.setenv(caches.CACHE_ENV, str(tmp_path / "inductor" / host_pinning.FILE))  # not a directory
    host_pinning.remember(key)  # nothing written, nothing raised
