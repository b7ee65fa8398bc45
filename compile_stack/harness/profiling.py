"""``--profile FILE``: a torch.profiler trace of one step and where its time went.

Kernels are put in categories by name: our kernels carry the op's name
(``_attn_*``, ``_xent_rows``, ``_adamw``), cuBLAS/CUTLASS kernels are matmuls
(the LM head's, inside the cross-entropy op, too),
Inductor's generated kernels (``triton_poi``/``triton_red``/``triton_per``),
our RoPE kernel (``_rope_kernel``) and torch's elementwise kernels are elementwise/norm, NCCL kernels are
communication, and copies to and from host memory (activation offload's
transfers) are host copies. Each category gets its share of the device's
compute (every category but host copies, which run on the copy engines beside
the kernels, so that with offload on the shares still say where the step's
time went; theirs is against the same total), its number of kernel launches
and, where its work is known from the config, the rate it achieved; the
largest kernels are listed by name (a recomputed op shows up as more
launches than the model has layers).

Under torchrun, ``profile_overlap`` says how much of the step's communication
ran under compute (``comm_overlap`` in the summary).
"""
import contextlib
import os
import re
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from compile_stack.workloads.config import ModelConfig
from compile_stack.harness.report import log

TOP_KERNELS = 12
CATEGORIES = ("attention", "matmul", "cross_entropy", "optimizer", "elementwise_norm", "communication", "host_copies",
              "other")
# Not compute: copies to or from host memory run beside the kernels (``breakdown``'s shares).
BESIDE_COMPUTE = ("host_copies",)
_PATTERNS = [
    ("host_copies", r"memcpy (htod|dtoh)"),
    ("attention", r"attn|attention|flash|fmha|sdpa"),
    ("cross_entropy", r"xent|cross_entropy"),
    ("optimizer", r"adam"),
    ("communication", r"nccl"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|matmul|sm90_|aten::(add|b)?mm\b"),
    ("elementwise_norm", r"triton_|elementwise|vectorized|reduce|norm|copy|fill|cat|rope"),
]


def categorize(kernel_name: str) -> str:
    name = kernel_name.lower()
    for category, pattern in _PATTERNS:
        if re.search(pattern, name):
            return category
    return "other"


def _known_work(cfg: ModelConfig) -> dict[str, tuple[float, str]]:
    """Work per category for one step: (amount, unit): FLOPs, or bytes moved."""
    return {
        "attention": (cfg.attention_flops, "TFLOP/s"),
        "matmul": (cfg.matmul_flops, "TFLOP/s"),
        # The row kernel reads the bf16 logits twice and writes their gradient once.
        "cross_entropy": (3 * 2 * cfg.tokens * cfg.vocab, "GB/s"),
        # AdamW reads p, g, m, v and writes p, m, v: 7 accesses per parameter.
        "optimizer": (7 * 2 * cfg.params, "GB/s"),
    }


@contextlib.contextmanager
def profiler_chatter_muted():
    """The profiler's own lines at its start and stop (Kineto's, written to file descriptor 2 from
    C++, a few per start and stop and more with CUPTI) kept off the screen; the step's run
    between them is not muted."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def record(step_fn) -> profile:
    """Run ``step_fn`` once under the profiler (CPU, and CUDA when there is a GPU), synchronized."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities)
    with profiler_chatter_muted():
        prof.start()
    try:
        step_fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        with profiler_chatter_muted():
            prof.stop()
    return prof


def profile_step(step_fn, cfg: ModelConfig, trace_path: str) -> dict:
    """Run ``step_fn`` once under the profiler, write the trace, return the breakdown."""
    prof = record(step_fn)
    prof.export_chrome_trace(str(trace_path))
    return breakdown(prof.key_averages(), cfg)


def profile_rank(step_fn, plan, trace_path: Path) -> dict:
    """``--profile``: one step of this rank into its trace (``trace.rank1.json`` under torchrun,
    where the rates count this rank's share of the batch); the breakdown, printed."""
    cfg = plan.cfg
    if plan.world > 1:
        trace_path = trace_path.with_name(f"{trace_path.stem}.rank{plan.rank}{trace_path.suffix}")
        cfg = cfg.with_overrides(batch=cfg.batch // plan.world)
    log(f"profiling one step into {trace_path}...")
    result = profile_step(step_fn, cfg, trace_path)
    log(format_breakdown(result))
    return result


def is_device_work(event) -> bool:
    """Whether a profiler event is work on the GPU's timeline (a kernel, memcpy or memset): not a
    CPU op, and not the GPU-side span the profiler adds for a ``record_function`` range
    (``nccl:*``, FSDP's ``FSDP::*``), which repeats the work under it."""
    return event.device_type == DeviceType.CUDA and not getattr(event, "is_user_annotation", False)


def breakdown(events, cfg: ModelConfig, on_device: bool | None = None) -> dict:
    """Time per category: of the device's work on a GPU (CPU ops and annotation spans are left
    out there, since they repeat the kernels under them), of the CPU ops' self time without one.
    Shares are of the compute categories' total: the shares of all but host copies add up to 1."""
    on_device = torch.cuda.is_available() if on_device is None else on_device
    totals, calls, per_kernel = defaultdict(float), defaultdict(int), []
    for event in events:
        if on_device:
            if not is_device_work(event):
                continue
            us = event.self_device_time_total
        else:
            us = event.self_cpu_time_total
        if us > 0 and not event.key.startswith("ProfilerStep"):
            category = categorize(event.key)
            totals[category] += us
            calls[category] += event.count
            per_kernel.append((us, event.key, event.count))
    total_us = sum(us for category, us in totals.items() if category not in BESIDE_COMPUTE) or 1.0
    work = _known_work(cfg)
    result = {}
    for category in CATEGORIES:
        ms = totals.get(category, 0.0) / 1e3
        row = {"ms": round(ms, 3), "share": round(totals.get(category, 0.0) / total_us, 4), "calls": calls[category]}
        if category in work and ms > 0:
            amount, unit = work[category]
            rate = amount / (ms / 1e3) / 1e12 if unit == "TFLOP/s" else amount / (ms / 1e3) / 1e9
            row[unit] = round(rate, 1)
        result[category] = row
    result["largest"] = [
        {"name": name, "category": categorize(name), "ms": round(us / 1e3, 3), "calls": count}
        for us, name, count in sorted(per_kernel, reverse=True)[:TOP_KERNELS]
    ]
    return result


def format_breakdown(result: dict) -> str:
    lines = [f"{'category':<18}{'ms':>12}{'share':>8}{'calls':>8}  rate"]
    for category in CATEGORIES:
        row = result[category]
        rate = next((f"{v} {k}" for k, v in row.items() if k.endswith("/s")),
                    "beside compute" if category in BESIDE_COMPUTE else "")
        lines.append(f"{category:<18}{row['ms']:>12.1f}{row['share']:>8.1%}{row['calls']:>8}  {rate}")
    lines.append(f"largest kernels:{'ms':>14}{'calls':>8}")
    for kernel in result["largest"]:
        lines.append(f"  {kernel['name'][:60]:<60}{kernel['ms']:>10.1f}{kernel['calls']:>8}  {kernel['category']}")
    return "\n".join(lines)


def interval_overlap(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> dict:
    """Communication time, and how much of it ran while no compute did (exposed).

    Intervals are (start, end) in any one unit; overlaps within a kind are merged.
    """
    comm_u, compute_u = _union(comm), _union(compute)
    comm_total = sum(e - s for s, e in comm_u)
    hidden = 0.0
    i = 0
    for s, e in comm_u:
        while i < len(compute_u) and compute_u[i][1] <= s:
            i += 1
        j = i
        while j < len(compute_u) and compute_u[j][0] < e:
            hidden += min(e, compute_u[j][1]) - max(s, compute_u[j][0])
            j += 1
    return {
        "comm": comm_total,
        "compute": sum(e - s for s, e in compute_u),
        "hidden_comm": hidden,
        "exposed_comm": comm_total - hidden,
        "hidden_fraction": hidden / comm_total if comm_total > 0 else None,
    }


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def profile_overlap(step_fn: Callable[[], object]) -> dict | None:
    """Profile one GPU step: NCCL kernel time, and how much of it overlapped compute kernels (ms).

    None on the CPU: gloo runs collectives on host threads, with no device timeline to compare.
    """
    if not torch.cuda.is_available():
        return None
    stats = interval_overlap(*device_intervals(record(step_fn).events()))
    result = {f"{k}_ms": round(v / 1e3, 3) for k, v in stats.items() if k != "hidden_fraction"}
    result["hidden_fraction"] = None if stats["hidden_fraction"] is None else round(stats["hidden_fraction"], 4)
    return result


def device_intervals(events) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(start, end) of each NCCL kernel and of each other piece of device work. Annotation spans
    are left out: FSDP's ``FSDP::all_gather`` span covers its collective and would count as
    compute hiding it."""
    comm, compute = [], []
    for event in events:
        if is_device_work(event) and event.time_range.end > event.time_range.start:
            kind = comm if categorize(event.name) == "communication" else compute
            kind.append((event.time_range.start, event.time_range.end))
    return comm, compute
