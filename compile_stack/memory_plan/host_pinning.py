"""The pinned host buffers an offloading step needed, remembered for its next start.

Pinning is slow (15-17 GiB/s on the H200 host: the full preset's 91-108 GiB take
~6-7 s), and a step's first forward pins what it offloads as it goes, so a
warm start waited for it after its tracing. The buffers a step needed (how
many of each size at once) are written beside the compile caches after its
first call, keyed by what decides them: the step's inputs and parameters,
the device's and the host's capacity and the plan's code. The next process
with the same key starts pinning them on background threads as its first
call begins, under Dynamo's tracing.
"""
import hashlib
from pathlib import Path

import torch

from compile_stack import caches
from compile_stack.memory_plan.partitioner import plan_code_hash
from custom_ops.activation_offload import TRANSFERS

FILE = "offload_host_buffers.json"


def _path() -> Path:
    return caches.default_cache_dir() / "inductor" / FILE


def step_key(args, models: list, device_capacity: float, host_capacity: int) -> str:
    """What decides a step's offload plan, and so its buffers: its tensor arguments and
    parameters (shapes and dtypes), the two capacities and the plan's code."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    tensors += [p for model in models for p in model.parameters()]
    h = hashlib.sha256(plan_code_hash().encode())
    h.update(repr([(tuple(t.shape), str(t.dtype)) for t in tensors]).encode())
    h.update(f"{device_capacity:.0f}:{host_capacity}".encode())
    return h.hexdigest()


def _read() -> dict:
    table = caches.read_record(_path())
    return table if isinstance(table, dict) else {}  # none yet, or damaged: only a head start is lost


def pin_remembered(key: str) -> None:
    """Start pinning the buffers the step of ``key`` needed last time, within the pool's limit."""
    needed = _read().get(key)
    if needed:
        TRANSFERS.pool.pin_ahead({int(n): int(c) for n, c in needed.items()})


def remember(key: str) -> None:
    """Write the buffers this process's steps needed under ``key`` (atomically; not at all where
    the cache cannot be written)."""
    needed = TRANSFERS.pool.needed()
    if not needed:
        return
    table = _read()
    table[key] = {str(n): c for n, c in needed.items()}
    caches.write_record(_path(), table)  # where it cannot be written, the next start pins as it goes
