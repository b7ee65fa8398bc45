"""Timing a step as run_step reports it: the first (compiling) call, warm-up, the median of timed
steps, tokens/s, peak memory and MFU; under torchrun, every rank's figures.

The timed steps sync anyway, so after each one the fused ops' bad-target flags
are read at no extra wait: a bad batch stops the run at the step that saw it.
"""
import contextlib
import statistics
import threading
import time

import torch
import torch.distributed as dist

from compile_stack.capture.targets import raise_on_bad_targets
from compile_stack.memory_plan.sizes import GIB
from compile_stack.harness.report import log
from compile_stack.workloads.config import H200_PEAK_BF16_FLOPS


class FirstCallTimer:
    """Wraps a step; remembers how long its first (compiling) call took, synchronized."""

    def __init__(self, step):
        self.step = step
        self.first_s = None

    def __call__(self, *batch):
        if self.first_s is not None:
            return self.step(*batch)
        t0 = time.perf_counter()
        loss = self.step(*batch)
        loss.detach().item()  # synchronizes
        self.first_s = time.perf_counter() - t0
        raise_on_bad_targets()
        return loss


def timed_steps(step, batch, n: int, device: torch.device) -> tuple[list[float], float]:
    """Milliseconds per step (CUDA events on a GPU, the wall clock on a CPU), and the last loss."""
    times = []
    for i in range(n):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step(*batch)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            loss = step(*batch)
            times.append((time.perf_counter() - t0) * 1e3)
        raise_on_bad_targets()  # synced above: outside the timing
        if shown(i + 1, n):
            log(f"  step {i + 1}/{n}: {times[-1]:.1f} ms")
    return times, loss.detach().item()


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


HEARTBEAT_S = 30.0  # a line this often while the first step compiles


@contextlib.contextmanager
def heartbeat(label: str, every_s: float = HEARTBEAT_S, report=None):
    """While the block runs (a first step compiling for minutes), a line every ``every_s``: the
    run is alive, how long it has taken so far and, given the step's pass ``report``, what the
    graphs compiled so far had replaced."""
    done, t0 = threading.Event(), time.perf_counter()

    def beat():
        while not done.wait(every_s):
            counts = sorted(dict(report.replacements).items()) if report else []
            replaced = ", ".join(f"{name} {n}" for name, n in counts if n)
            log(f"[{label}] first step: {time.perf_counter() - t0:.0f} s so far (compiling"
                f"{'; replaced so far: ' + replaced if replaced else ''})...")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def shown(i: int, n: int, lines: int = 10) -> bool:
    """Whether step ``i`` of ``n`` (from 1) gets a progress line: all of up to 2 × ``lines``, else
    about ``lines`` of them, the last included."""
    return n <= 2 * lines or i == n or i % -(-n // lines) == 0


def measure(step: FirstCallTimer, batch, args, plan, label: str) -> dict:
    """First (compiling) step unless it already ran, warm-up, timed steps; the summary figures."""
    if step.first_s is None:
        log(f"[{label}] first step (compiles when compiled)...")
        with heartbeat(label, report=getattr(step.step, "report", None)):  # a compiled step's pass report
            step(*batch)
    log(f"[{label}] first step took {step.first_s:.1f} s")
    startup = getattr(step.step, "startup", None)  # a compiled step's start-up phases
    if startup is not None and startup.first_call is not None:
        log(f"[{label}] {startup.line()}")
    for i in range(args.warmup):  # timed too: the second call compiles a graph's richer plan (memory_plan/share.py)
        t0 = time.perf_counter()
        step(*batch).detach().item()  # synchronizes
        if shown(i + 1, args.warmup):
            log(f"[{label}] warm-up {i + 1}/{args.warmup} took {time.perf_counter() - t0:.1f} s")
    log(f"[{label}] timing {args.steps} steps...")
    times, loss = timed_steps(step, batch, args.steps, plan.device)
    step_ms = statistics.median(times)
    figures = {
        "compile_s": round(step.first_s, 2),
        "step_ms": round(step_ms, 2),
        "step_times_ms": [round(t, 2) for t in times],  # this rank's, in order: the speed can change as it repeats
        "tokens_per_s": round(plan.cfg.tokens / (step_ms / 1e3), 1),
        "peak_mem_gib": round(peak_memory_gib(plan.device), 2),
        "mfu": round(plan.cfg.flops_per_step / (step_ms / 1e3) / H200_PEAK_BF16_FLOPS, 4),
        "loss": round(loss, 5),
    }
    if startup is not None and startup.first_call is not None:
        figures["startup"] = startup.first_call
    if plan.world > 1:
        figures.update(rank_summary(figures["step_ms"], figures["peak_mem_gib"]))
        figures["mfu"] = round(figures["mfu"] / plan.world, 4)  # a share of world GPUs' peak
    return figures


def rank_summary(step_ms: float, peak_mem_gib: float) -> dict:
    """This rank's step time and peak memory, gathered to every rank; the step is the slowest rank's."""
    mine = {"step_ms": step_ms, "peak_mem_gib": peak_mem_gib}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return {
        "world_size": len(ranks),
        "step_ms": round(max(r["step_ms"] for r in ranks), 2),
        "step_ms_per_rank": [round(r["step_ms"], 2) for r in ranks],
        "peak_mem_gib_per_rank": [round(r["peak_mem_gib"], 2) for r in ranks],
        "peak_mem_gib": round(max(r["peak_mem_gib"] for r in ranks), 2),
    }
