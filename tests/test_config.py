"""Presets and the work accounting of docs/reference.md §3."""
import pytest

from compile_stack.memory_plan import estimate, sizes
from compile_stack.workloads.config import PRESETS, ModelConfig


def test_full_preset_matches_the_leaderboard_counts():
    full = PRESETS["full"]
    assert full.params == 8_125_698_048
    assert full.matmul_params == 7_503_085_568
    assert full.tokens == 65_536
    assert full.flops_per_step == pytest.approx(4.745e15, rel=1e-3)


def test_overrides_replace_only_given_fields():
    cfg = PRESETS["small"].with_overrides(layers=2, seq=None)
    assert cfg.layers == 2 and cfg.seq == PRESETS["small"].seq


@pytest.mark.parametrize(
    "field, value, message",
    [("layers", 0, "layers: expected a positive integer"), ("heads", 3, "heads: expected a divisor"),
     ("vocab", 2.5, "vocab: expected a positive integer")],
)
def test_bad_config_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        PRESETS["tiny"].with_overrides(**{field: value})


def test_odd_head_dim_is_refused():
    with pytest.raises(ValueError, match="head dim"):
        ModelConfig(layers=1, seq=8, batch=1, d_model=12, heads=4, d_ff=8, vocab=8)


def test_memory_estimate_orders_eager_above_compiled_and_budget_monotone():
    full = PRESETS["full"]
    eager = estimate.estimate_peak_bytes(full, compiled=False)
    low, high = (estimate.estimate_peak_bytes(full, compiled=True, memory_budget=b) for b in (0.0, 1.0))
    # State alone is 4 × 8.13e9 × 2 bytes.
    assert low > 4 * full.params * 2
    assert low < high < eager
    h200 = 139 * sizes.GIB
    assert sizes.fits(low, h200)
    assert not sizes.fits(high, h200)
    assert not sizes.fits(eager, h200)


def test_memory_estimate_shards_state_and_batch_over_ranks():
    full = PRESETS["full"]
    one, two = (estimate.estimate_peak_bytes(full, compiled=True, memory_budget=0.5, world=w) for w in (1, 2))
    # Half the state and half the tokens per rank; the cross-entropy chunk, the LM head's gradient
    # and FSDP2's unsharded parameters of the groups in flight do not halve.
    block = (full.params - 2 * full.vocab * full.d_model) / full.layers
    in_flight = (2 * full.vocab * full.d_model + 2 * block) * 2
    assert one / 2 < two < one / 2 + in_flight + estimate.CE_CHUNK_BYTES + full.vocab * full.d_model * 2
