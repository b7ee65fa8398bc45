"""Where a step's first call spends its time, so a user sees what a start-up costs.

The phases of the first call: Dynamo tracing the step's frames (its frame
compiles less the backend calls made inside them), each of our graphs'
compiles (by backend: model, block, optimizer; with AOTAutograd's cache hits
and misses, a warm start's hits), the backward graphs AOTAutograd compiled
lazily at the first ``backward()``, and the rest: running the step and its
eager code. Taken from our own clocks around each graph's compile and from
Dynamo's timers (``torch_internals.dynamo``); on a GPU the rest does not wait
for the device.
"""
import contextlib
import dataclasses
import time

from torch_internals import dynamo

FRAME_COMPILES = "_compile.compile_inner"
BACKEND_CALLS = "OutputGraph.call_user_compiler"
BACKWARD_COMPILES = "compile_fx.<locals>.bw_compiler"
AOT_HIT, AOT_MISS = "aot_autograd.autograd_cache_hit", "aot_autograd.autograd_cache_miss"


@dataclasses.dataclass
class GraphCompile:
    backend: str  # the backend's name: model, block, optimizer
    seconds: float
    backward_seconds: float  # of those, a backward compiled with its forward
    cache: str | None  # AOTAutograd's cache: "hit", "miss", or None (neither counted)


class StartupPhases:
    """The graph compiles of one step and the phases of its first call."""

    def __init__(self):
        self.graphs: list[GraphCompile] = []
        self.first_call: dict | None = None

    @contextlib.contextmanager
    def graph(self, backend: str):
        """Time one graph's compile by ``backend``."""
        timers, counters, start = dynamo.timer_totals(), dynamo.cache_counters(), time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        after = dynamo.cache_counters()
        hit, miss = (after.get(k, 0) > counters.get(k, 0) for k in (AOT_HIT, AOT_MISS))
        self.graphs.append(GraphCompile(backend, seconds, _grown(timers, BACKWARD_COMPILES),
                                        "hit" if hit else "miss" if miss else None))

    @contextlib.contextmanager
    def first(self):
        """Time the step's first call and split it into phases."""
        timers, known, start = dynamo.timer_totals(), len(self.graphs), time.perf_counter()
        yield
        total = time.perf_counter() - start
        graphs = self.graphs[known:]
        compiling = sum(g.seconds for g in graphs)
        tracing = _grown(timers, FRAME_COMPILES) - _grown(timers, BACKEND_CALLS)
        backward = _grown(timers, BACKWARD_COMPILES) - sum(g.backward_seconds for g in graphs)
        by_backend = {}
        for g in graphs:
            entry = by_backend.setdefault(g.backend, {"graphs": 0, "seconds": 0.0, "aot_cache_hits": 0,
                                                      "aot_cache_misses": 0})
            entry["graphs"] += 1
            entry["seconds"] += g.seconds
            entry["aot_cache_hits"] += g.cache == "hit"
            entry["aot_cache_misses"] += g.cache == "miss"
        self.first_call = {
            "first_call_s": round(total, 2),
            "tracing_s": round(tracing, 2),
            "graph_compiles_s": round(compiling, 2),
            "lazy_backward_compiles_s": round(backward, 2),
            "rest_s": round(total - tracing - compiling - backward, 2),
            "graphs": {name: {**e, "seconds": round(e["seconds"], 2)} for name, e in by_backend.items()},
        }

    def line(self) -> str:
        """The first call's phases in one line (empty before it ran)."""
        s = self.first_call
        if s is None:
            return ""
        graphs = s["graphs"].values()
        hits, misses = sum(e["aot_cache_hits"] for e in graphs), sum(e["aot_cache_misses"] for e in graphs)
        each = ", ".join(f"{name} {e['graphs']} in {e['seconds']:.1f} s" for name, e in s["graphs"].items())
        return (f"start-up {s['first_call_s']:.1f} s: Dynamo tracing {s['tracing_s']:.1f} s; "
                f"{sum(e['graphs'] for e in graphs)} graphs compiled in {s['graph_compiles_s']:.1f} s"
                f"{' (' + each + ')' if each else ''}, AOTAutograd cache {hits} hits / {misses} misses; "
                f"backward compiles {s['lazy_backward_compiles_s']:.1f} s; running and the rest {s['rest_s']:.1f} s")


def _grown(before: dict[str, float], timer: str) -> float:
    """Seconds Dynamo's ``timer`` has summed since ``before``."""
    return dynamo.timer_totals().get(timer, 0.0) - before.get(timer, 0.0)
