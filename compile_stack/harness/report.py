"""What a run says: progress lines, the summary table and file, from one process only."""
import json
import os
from pathlib import Path

from passes import registry


def is_rank0() -> bool:
    """Whether this process prints and writes files: the only one, or torchrun's rank 0."""
    return os.environ.get("RANK", "0") == "0"


def log(msg: str) -> None:
    if is_rank0():
        print(msg, flush=True)


def pass_summary(passes: list[str] | None) -> dict:
    """What each of the run's passes replaced (``passes``: the names given, None: all) and the notes."""
    names = [p.name for p in registry.resolve(passes)]
    report = registry.current()
    return {"passes": report.as_dict(names), "pass_notes": list(report.notes)}


def print_summary(s: dict) -> None:
    log("")
    log(f"{'mode':<22}{'compiled' if s['compiled'] else 'eager'}")
    for key in ("compile_s", "step_ms", "tokens_per_s", "peak_mem_gib", "mfu", "loss"):
        log(f"{key:<22}{s[key]}")
    for key in ("world_size", "step_ms_per_rank", "peak_mem_gib_per_rank", "comm_overlap"):
        if key in s:
            log(f"{key:<22}{s[key]}")
    log(f"{'passes':<22}{s['passes']}")
    for n in s["pass_notes"]:
        log(f"{'':<22}note: {n}")
    if "check" in s:
        log(f"{'check':<22}{'ok' if s['check']['ok'] else 'FAILED'} {s['check']}")
    if "compare" in s:
        c = s["compare"]
        if c.get("stock") is None:
            log(f"{'stock':<22}not run: {c['not_run']}")
            return
        log(f"{'stock step_ms':<22}{c['stock']['step_ms']} (ours {s['step_ms']}: {c['speedup']}x)")
        log(f"{'stock peak_mem_gib':<22}{c['stock']['peak_mem_gib']} (ours {s['peak_mem_gib']})")


def write_summary(s: dict, path: Path | None) -> None:
    """``--json``: the summary as a file, written by rank 0."""
    if path and is_rank0():
        path.write_text(json.dumps(s, indent=2))
        log(f"summary written to {path}")
