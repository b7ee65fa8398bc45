"""The pass report on warm caches: replayed from a valid record, unknown without one, never a made-up 0."""
import json

import pytest
import torch

import compile_stack
from compile_stack import caches
from compile_stack.backend import pass_records
from passes import registry
from tests.test_compile_step import gpt
from tests.user_corpus import batches, mean_cross_entropy

PASSES = ["attention", "cross_entropy"]


def compile_loss(model):
    """Compile the model's loss with our backend (Inductor code generation: its caches are what a
    warm start hits) and run it once forward and backward; returns the report's counts and notes."""
    torch._dynamo.reset()
    registry.current().clear()
    (inputs, targets), = batches(1)
    loss = torch.compile(lambda x, y: mean_cross_entropy(model(x), y), backend=compile_stack.Backend(PASSES))
    loss(inputs, targets).backward()
    return registry.current().as_dict(PASSES), list(registry.current().notes)


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A cache directory warmed by one compile, and what that compile reported."""
    caches.use_cache_dir(tmp_path_factory.mktemp("cache"))
    torch.manual_seed(0)
    model = gpt(1, d_model=32, heads=2)
    cold = compile_loss(model)
    assert cold[0] == {"attention": 1, "cross_entropy": 1}
    records = sorted(pass_records.report_dir().glob("*.json"))
    assert records
    return model, cold, records


@pytest.mark.slow
def test_a_warm_start_replays_counts_and_notes(warm):
    model, cold, _ = warm
    counts, notes = compile_loss(model)
    assert registry.current().runs["joint"] == 0  # Inductor's caches served the graphs: our passes did not run
    assert (counts, notes) == cold


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["missing", "garbage", "edited"])
def test_without_a_valid_record_counts_are_unknown_and_nothing_is_written_back(warm, damage):
    model, _, records = warm
    saved = {r: r.read_text() for r in records}
    try:
        for r in records:
            if damage == "missing":
                r.unlink()
            elif damage == "garbage":
                r.write_text("{not json")
            else:
                data = json.loads(saved[r])
                data["counts"] = {name: 7 for name in data["counts"]}
                r.write_text(json.dumps(data))
        damaged = {r: r.read_text() if r.exists() else None for r in records}
        counts, _ = compile_loss(model)
        assert registry.current().runs["joint"] == 0  # a warm start: the passes did not run
        assert counts == {"attention": None, "cross_entropy": None}
        # Nothing written back: no zeros (or the edited sevens) become the record.
        assert {r: r.read_text() if r.exists() else None for r in records} == damaged
    finally:
        for r, text in saved.items():
            r.write_text(text)
