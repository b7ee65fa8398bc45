"""Pass reports that stay true on warm caches: each graph's counts and notes, kept beside the caches.

When Inductor's caches serve a graph our passes do not run, so after each
compile the backend stores the graph's counts and notes (with a digest) under
a key of the graph's code and the passes' identity, replays them on a cache
hit, and reports the counts unknown where no valid record exists.
"""
import dataclasses
import hashlib
import json
from collections import Counter
from pathlib import Path

import torch

from compile_stack import caches
from passes import registry
from torch_internals import inductor


@dataclasses.dataclass(frozen=True)
class Mark:
    """Where a report stood before a graph's compile: the runs of each stage, the counts, the notes."""

    runs: Counter
    replacements: Counter
    notes: int

    @classmethod
    def of(cls, report: registry.PassReport) -> "Mark":
        return cls(Counter(report.runs), Counter(report.replacements), len(report.notes))


def report_dir() -> Path:
    """Where graphs' pass records live: inside Inductor's cache directory, beside the compiled
    artifacts they describe, so a warm cache comes with them wherever that directory is."""
    return Path(inductor.cache_dir()) / "cstack_pass_reports"


def record_key(gm: torch.fx.GraphModule, pass_list: list[registry.RegisteredPass]) -> Path:
    """The record of ``gm`` compiled with ``pass_list``: by its code and the passes' identity."""
    stages = [sp.uuid() for sp in registry.stage_passes(pass_list).values()]
    digest = hashlib.sha256(gm.code.encode() + b"".join(stages)).hexdigest()[:32]
    return report_dir() / f"{digest}.json"


def settle(report: registry.PassReport, gm: torch.fx.GraphModule, pass_list: list[registry.RegisteredPass],
           before: Mark, uses: int) -> None:
    """This graph's replacements, counted once per segment that shares it, and its notes.

    Where a cache hit skipped a stage's passes, its counts and notes are replayed from the
    record the compile that ran them left; with no record, or one that is damaged or was
    edited (its digest no longer matches), those passes are reported unknown, never 0. Only
    a compile whose passes all ran writes the record.
    """
    key = record_key(gm, pass_list)
    record = _read(key)
    counts, replayed = {}, False
    for p in pass_list:
        if report.runs[p.stage] != before.runs[p.stage]:
            counts[p.name] = report.replacements[p.name] - before.replacements[p.name]
        elif record is not None and isinstance(record["counts"].get(p.name), int):
            counts[p.name], replayed = record["counts"][p.name], True
            report.replacements[p.name] += counts[p.name]
        else:
            report.unknown.add(p.name)
            continue
        report.replacements[p.name] += counts[p.name] * (uses - 1)
    if replayed:
        for entry in record["notes"]:
            if entry not in report.notes:
                report.notes.append(entry)
    if len(counts) == len(pass_list) and not replayed:
        _write(key, {"counts": counts, "notes": report.notes[before.notes:]})


def _digest(key: Path, payload: dict) -> str:
    return hashlib.sha256(f"{key.name}:{json.dumps(payload, sort_keys=True)}".encode()).hexdigest()


def _read(key: Path) -> dict | None:
    """A graph's stored counts and notes; None if missing, unreadable, malformed or edited."""
    try:
        data = caches.read_record(key)
        payload = {"counts": dict(data["counts"]), "notes": [str(n) for n in data["notes"]]}
        return payload if data["digest"] == _digest(key, payload) else None
    except (ValueError, KeyError, TypeError):
        return None


def _write(key: Path, payload: dict) -> None:
    caches.write_record(key, {**payload, "digest": _digest(key, payload)})
