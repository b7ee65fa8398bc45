"""A step's start-up phases (compile_stack/backend/startup.py): each graph's compile counted by
its backend with AOTAutograd's cache hit or miss, and the first call split so that its phases
add up to it. Timings are not asserted, only how the record is made of them."""
import pytest

from compile_stack.backend import startup
from compile_stack.backend.startup import StartupPhases


@pytest.fixture
def dynamo_clock(monkeypatch):
    """Dynamo's timers and cache counters as a test sets them."""
    timers, counters = {}, {}
    monkeypatch.setattr(startup.dynamo, "timer_totals", lambda: dict(timers))
    monkeypatch.setattr(startup.dynamo, "cache_counters", lambda: dict(counters))
    return timers, counters


def test_graph_compiles_are_counted_by_backend_with_their_cache_hits(dynamo_clock):
    timers, counters = dynamo_clock
    phases = StartupPhases()
    with phases.first():
        timers[startup.FRAME_COMPILES] = 5.0  # Dynamo's frame compiles, 2 s of it in the backend
        timers[startup.BACKEND_CALLS] = 2.0
        with phases.graph("model"):
            counters[startup.AOT_HIT] = 1
        with phases.graph("block"):
            counters[startup.AOT_MISS] = 1
            timers[startup.BACKWARD_COMPILES] = 0.5  # compiled with its forward: inside the graph's time
        with phases.graph("block"):
            pass  # neither counter moved: no cache involved
        timers[startup.BACKWARD_COMPILES] = 1.25  # 0.75 s of lazily compiled backwards
    s = phases.first_call
    assert s["graphs"]["model"] == {"graphs": 1, "seconds": s["graphs"]["model"]["seconds"], "aot_cache_hits": 1,
                                    "aot_cache_misses": 0}
    assert (s["graphs"]["block"]["graphs"], s["graphs"]["block"]["aot_cache_misses"]) == (2, 1)
    assert [g.cache for g in phases.graphs] == ["hit", "miss", None]
    assert s["tracing_s"] == 3.0 and s["lazy_backward_compiles_s"] == 0.75
    parts = s["tracing_s"] + s["graph_compiles_s"] + s["lazy_backward_compiles_s"] + s["rest_s"]
    assert parts == pytest.approx(s["first_call_s"], abs=0.02)
    line = phases.line()
    assert "Dynamo tracing 3.0 s" in line and "3 graphs compiled" in line and "1 hits / 1 misses" in line


def test_only_the_first_calls_graphs_are_its_phases(dynamo_clock):
    phases = StartupPhases()
    assert phases.line() == ""
    with phases.graph("optimizer"):  # compiled before the first call (none here): not the call's
        pass
    with phases.first():
        with phases.graph("model"):
            pass
    assert list(phases.first_call["graphs"]) == ["model"]
