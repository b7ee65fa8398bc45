"""The plan chosen for the full config on a machine (memory_plan/levers.py, host.py), before anything
is built: which levers it takes for 80 / 141 / 180 GB cards and hosts of 64-512 GiB, and the one
message of a config that cannot fit. Sizes: the estimate's, scaled by the real config."""
import pytest

from compile_stack.memory_plan import host
from compile_stack.memory_plan.levers import Machine, choose
from compile_stack.workloads.config import PRESETS

GIB, MIB = 2**30, 2**20
H100, H200, B200 = 81559 * MIB, 143771 * MIB, 183359 * MIB  # what the cards report
FULL = PRESETS["full"]


def machine(gpu: float, host_gib: int) -> Machine:
    return Machine(gpu, host_gib * GIB, (host_gib - 4) * GIB)  # 4 GiB taken by the process and the OS


@pytest.mark.parametrize("host_gib", [64, 128, 256, 512])
def test_an_80_gb_card_runs_the_full_step_only_by_offloading(host_gib):
    """The H100's case: even the least budget saves 34 GiB, ~18 GiB more than the GPU leaves."""
    levers = choose(FULL, machine(H100, host_gib))
    assert levers.fits and levers.to_host > 15 * GIB and levers.budget <= 0.12
    assert levers.peak <= 0.95 * H100
    refused = choose(FULL, machine(H100, host_gib), offload=False)
    assert not refused.fits
    message = refused.describe()
    assert "does not fit" in message and "Would fit: activation offload" in message
    assert "× the tokens per step (a smaller batch or sequence)" in message


@pytest.mark.parametrize("gpu", [H200, B200])
def test_a_larger_host_buys_less_recomputation(gpu):
    plans = [choose(FULL, machine(gpu, h)) for h in (64, 128, 256, 512)]
    assert all(p.fits for p in plans)
    assert [p.budget for p in plans] == sorted(p.budget for p in plans)
    assert plans[0].recomputed > plans[-1].recomputed == 0  # budget 1.0: nothing recomputed
    without = choose(FULL, machine(gpu, 128), offload=False)
    assert without.fits and without.to_host == 0 and without.recomputed > plans[1].recomputed


def test_the_h200_takes_the_measured_offload_plan():
    """On the H200 host (125 GiB) the 0.88 run kept block0 at budget 0.6 with 108 GiB in host memory."""
    levers = choose(FULL, machine(H200, 125))
    assert levers.budget == pytest.approx(0.6) and 100 * GIB < levers.to_host <= levers.host_share


def test_a_180_gb_card_with_a_large_host_recomputes_nothing():
    levers = choose(FULL, machine(B200, 512))
    assert levers.budget == 1.0 and levers.recomputed == 0 and levers.to_host > 0


def test_impossible_configs_are_refused_with_what_would_fit():
    longer = choose(FULL.with_overrides(seq=4 * FULL.seq), machine(H100, 512))
    assert not longer.fits
    share = longer.shortfall.token_share()
    assert 0 < share < 1 and f"at most {share:.2f}× the tokens" in longer.describe()
    assert choose(FULL.with_overrides(seq=int(share * 4 * FULL.seq) // 1024 * 1024), machine(H100, 512)).fits
    small_card = choose(FULL, machine(40 * GIB, 512))
    assert "a GPU with more memory or the model sharded" in small_card.describe()


def test_the_default_host_share_leaves_the_reserve():
    assert host.reserve_bytes(128 * GIB) == 8 * GIB and host.reserve_bytes(512 * GIB) == 32 * GIB
    assert host.default_host_bytes(125 * GIB, 120 * GIB + 5 * MIB) == 112 * GIB  # whole GiB
    assert host.default_host_bytes(512 * GIB, 500 * GIB, ranks=4) == 117 * GIB  # ranks sharing a host split it
    assert host.default_host_bytes(64 * GIB, 6 * GIB) == 0


def test_offload_off_and_an_explicit_share(monkeypatch):
    monkeypatch.setattr(host, "host_memory", lambda: (100 * GIB, 90 * GIB))
    assert host.offload_host_bytes(False) == 0
    assert host.offload_host_bytes(0.5) == 50 * GIB
    assert host.offload_host_bytes(None) == host.offload_host_bytes(True) == 82 * GIB
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert host.offload_host_bytes(None) == 0  # not built for FSDP2's sharded steps


def test_each_rank_plans_its_shard_without_offload_under_torchrun():
    """Two H100s of one host: each rank holds half the state and half the batch; offload is off by
    default there (not built for FSDP2) and the plan fits by its budget alone."""
    per_rank = choose(FULL, Machine(H100, 512 * GIB, 500 * GIB, ranks_per_host=2), world=2)
    assert per_rank.fits and per_rank.host_share == 0 and per_rank.to_host == 0 and per_rank.budget > 0.1
    assert choose(FULL, Machine(H100, 512 * GIB, 500 * GIB), offload=False).fits is False  # one rank alone
