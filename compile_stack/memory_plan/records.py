"""What a graph's partition decided, kept beside the compile caches for the next start.

A warm start is served each graph from AOTAutograd's and Inductor's caches
without partitioning it, so the ledger would hold nothing for the
graphs served, and a graph missing from the caches (an edited loss beside
cached blocks, say) would be planned against the memory their saved
activations take. So once the step's first call has settled it, each
partitioned graph's reservation (its saved bytes on the device and in host
memory, all call sites, and its working set; the share of its call sites on a
richer plan, share.py, included) is written here with that share, keyed
by what decides them: the graph and the partitioner's identity. A graph served
from the caches reserves the recorded bytes again as it is compiled, before
the graphs traced after it plan, and its call sites take the recorded share.
"""
import dataclasses
import hashlib
from pathlib import Path

from compile_stack import caches
from compile_stack.memory_plan.share import Share
from torch_internals import inductor


@dataclasses.dataclass(frozen=True)
class PlanRecord:
    """A graph's reservation in the ledger (``MemoryLedger.reserve``'s arguments) and its share."""

    saved: int
    working: int
    host: int
    share: Share | None


def _path(key: str, identity: str) -> Path:
    digest = hashlib.sha256(f"{key}\n{identity}".encode()).hexdigest()[:32]
    return Path(inductor.cache_dir()) / "cstack_plan_records" / f"{digest}.json"


def remember(key: str, identity: str, record: PlanRecord) -> None:
    """Write the record of the graph ``key`` partitioned by a partitioner of ``identity``."""
    caches.write_record(_path(key, identity), dataclasses.asdict(record))


def recall(key: str, identity: str) -> PlanRecord | None:
    """The record ``remember`` left for the graph ``key`` and ``identity``; None if there is none, or
    it is damaged."""
    data = caches.read_record(_path(key, identity))
    try:
        share = data["share"]
        share = None if share is None else Share(**{**share, "moved": tuple(share["moved"])})
        return PlanRecord(int(data["saved"]), int(data["working"]), int(data["host"]), share)
    except (TypeError, KeyError, ValueError):
        return None
