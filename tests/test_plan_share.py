"""Some of a shared graph's call sites on a richer plan (compile_stack/plan_share.py).

A user's GPT (tests.user_models) is compiled by ``compile_step`` with a ledger
of a chosen capacity standing in for a GPU (on the CPU the step has none): with
room for every block's budget-1.0 plan nothing is shared; with less, every
block takes the plan that fits and, once the step's graphs all have theirs, the
last blocks take a plan that recomputes less in what is left over, from the
second call on. Each case trains three steps and compares the parameters with
eager's. A warm start (Inductor's code on the CPU, caches in a temporary
directory) partitions nothing, routes the same blocks and holds the same
ledger (compile_stack/memory_plan/records.py); a graph missing from the caches is
planned beside the cached ones.
"""

import pytest
import torch

import compile_stack
from compile_stack.memory_plan import MemoryPlan, offload, partitioner, records, share as plan_share
from compile_stack.memory_plan.ledger import SCRATCH_BYTES, MemoryLedger
from passes import registry
from tests import user_models
from tests.user_corpus import VOCAB, batches, make_train_step, mean_cross_entropy

LAYERS = 6
STEPS = 3


def gpt():
    torch.manual_seed(0)
    return user_models.build_gpt(vocab_size=VOCAB, context_length=16, d_model=32, num_layers=LAYERS, num_heads=2,
                                 d_ff=48)


def halved_loss(logits, targets):
    return 0.5 * mean_cross_entropy(logits, targets)


def train(monkeypatch, capacity: float, by_argument: bool = False, codegen: bool = False, cache_dir=None,
          loss=mean_cross_entropy):
    """Three steps of the GPT compiled with a ledger of ``capacity`` bytes; (the compiled step, the
    ledger, the block graph's partitions as (partitioner, forward, backward)). Checks the parameters
    against the same steps run eagerly."""
    torch._dynamo.reset()
    registry.current().clear()
    model, reference = gpt(), gpt()
    book = MemoryLedger(capacity, allocated=lambda: 0, future_state=lambda: 0, device=torch.device("cpu"))
    monkeypatch.setattr(MemoryPlan, "for_step", classmethod(lambda cls, *args, **kwargs: cls(book)))
    partitions, partition = [], partitioner.BudgetedPartitioner.__call__

    def recorded(self, gm, joint_inputs, **kwargs):
        parts = partition(self, gm, joint_inputs, **kwargs)
        if self.key.startswith("block:") or self.uses > 1:
            partitions.append((self, *parts))
        return parts

    monkeypatch.setattr(partitioner.BudgetedPartitioner, "__call__", recorded)
    optimizer, eager_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    if by_argument:
        def step_of(m, o):
            def train_step(m, inputs, targets):
                o.zero_grad(set_to_none=True)
                mean_cross_entropy(m(inputs), targets).backward()
                o.step()
            return train_step
        step = compile_stack.compile_step(step_of(model, optimizer), codegen=codegen, cache_dir=cache_dir)
        eager = step_of(reference, eager_optimizer)
        args = (model,), (reference,)
    else:
        step = compile_stack.compile_step(make_train_step(model, loss, optimizer), codegen=codegen,
                                          cache_dir=cache_dir)
        eager = make_train_step(reference, loss, eager_optimizer)
        args = (), ()
    for inputs, targets in batches(STEPS):
        step(*args[0], inputs, targets)
        eager(*args[1], inputs, targets)
    assert step.memory_plan.settled  # each call settles what it compiled, the optimizer's too
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if codegen else {}
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, **tolerance)
    return step, book, partitions


@pytest.fixture(scope="module")
def sizes():
    """(bytes the budget-1.0 plans take but the block's, the block's budget-1.0 plan for all blocks,
    the largest working set), from a run with room for everything."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _, book, _ = train(monkeypatch, 1e15)
    block = next(b for k, b in book.reserved.items() if k.startswith("block:"))
    return sum(book.reserved.values()) - block, block, book.working


def short_of_room(sizes) -> float:
    """A capacity holding the other graphs' plans and a fifth of the blocks' budget-1.0 plan."""
    others, block, working = sizes
    return SCRATCH_BYTES + working + others + 0.2 * block


def share_note() -> str | None:
    return next((n for n in registry.current().notes if "call sites take the plan" in n), None)


def test_room_for_every_plan_shares_nothing(monkeypatch, sizes):
    step, _, partitions = train(monkeypatch, 1e15)
    (calls,) = step.block_calls
    assert calls.backend.sites.richer == 0 and share_note() is None
    assert len(partitions) == 1  # the blocks' graph, partitioned once


def test_the_last_blocks_take_a_plan_recomputing_less_in_what_is_left(monkeypatch, sizes):
    capacity = short_of_room(sizes)
    step, book, partitions = train(monkeypatch, capacity)
    (calls,) = step.block_calls
    k = calls.backend.sites.richer
    assert 0 < k < LAYERS
    assert [calls.compiled_for(i) is calls.compiled_richer for i in range(LAYERS)] == [False] * (LAYERS - k) + [True] * k
    share = calls.backend.sites.share
    (shared, _, shared_backward), (richer, _, richer_backward) = partitions
    assert richer.richer == share and richer.chosen == share.budget > shared.chosen
    assert offload.matmul_flops(richer_backward) < offload.matmul_flops(shared_backward)
    # The share is reserved beside the plan all blocks take, and the step's plans still fit.
    assert book.reserved[shared.key] == LAYERS * (share.saved - share.extra) + k * share.extra
    assert sum(book.reserved.values()) <= capacity - book.working - SCRATCH_BYTES
    assert f"the last {k} of block0's {LAYERS} call sites take the plan" in share_note()


def test_a_model_passed_as_an_argument_shares_its_cut_blocks_too(monkeypatch, sizes):
    step, _, partitions = train(monkeypatch, short_of_room(sizes), by_argument=True)
    assert step.block_calls == []
    (shared, *_), (richer, *_) = partitions
    assert richer.richer is not None and richer.chosen == richer.richer.budget > shared.chosen
    assert share_note() is not None


def test_a_warm_start_partitions_nothing_and_routes_the_same_blocks(monkeypatch, sizes, tmp_path):
    """Inductor's code and caches (in ``tmp_path``): the second process's compiles are cache hits, and
    the share comes from beside the caches."""
    capacity = short_of_room(sizes)
    cold, cold_book, partitions = train(monkeypatch, capacity, codegen=True, cache_dir=tmp_path)
    k = cold.block_calls[0].backend.sites.richer
    assert k > 0 and len(partitions) == 2
    note = share_note()
    warm, book, partitions = train(monkeypatch, capacity, codegen=True, cache_dir=tmp_path)
    assert partitions == [] and warm.block_calls[0].backend.sites.richer == k
    assert share_note() == note
    # The ledger holds what the cold start's partitions reserved, shares included.
    assert book.reserved == cold_book.reserved and book.host_reserved == cold_book.host_reserved
    assert book.working == cold_book.working


def test_a_graph_missing_from_the_caches_plans_beside_the_cached_ones(monkeypatch, sizes, tmp_path):
    """An edited loss, the blocks unchanged: the blocks come from the caches and the head's new
    graph is planned beside what their partition reserved (the record), not in an empty ledger."""
    capacity = short_of_room(sizes)
    _, cold_book, _ = train(monkeypatch, capacity, codegen=True, cache_dir=tmp_path)
    block = next(k for k in cold_book.reserved if k.startswith("block:"))
    _, book, partitions = train(monkeypatch, capacity, codegen=True, cache_dir=tmp_path, loss=halved_loss)
    assert partitions == []  # the blocks: from the caches
    assert book.reserved[block] == cold_book.reserved[block]
    heads = [k for k in book.reserved if not k.startswith("block:") and k not in cold_book.reserved]
    assert heads, "the edited loss's graph was not partitioned anew"
    assert sum(book.reserved.values()) <= capacity - book.working - SCRATCH_BYTES


def test_a_damaged_or_missing_record_gives_none(tmp_path, monkeypatch):
    monkeypatch.setattr(records.inductor, "cache_dir", lambda: str(tmp_path))
    share = plan_share.Share(uses=3, budget=0.65, moved=("mm_1",), saved=10, host=20, extra=5, extra_host=0)
    for record in (records.PlanRecord(100, 7, 50, share), records.PlanRecord(100, 7, 0, None)):
        records.remember("block:abc", "identity", record)
        assert records.recall("block:abc", "identity") == record
    assert records.recall("block:abc", "another identity") is None
    bad_share = '{"saved": 1, "working": 2, "host": 3, "share": {"uses": 3}}'
    for damaged in ("{not json", '{"saved": 3}', "[1, 2]", bad_share):
        records._path("block:abc", "identity").write_text(damaged)
        assert records.recall("block:abc", "identity") is None
