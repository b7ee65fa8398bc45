"""The host memory an offloading step may pin: what is free when the step is compiled, less a reserve.

Pinned buffers for saved activations are the largest host allocation of an
offloading step (108 GiB of the H200 host's 125 GiB at the full preset), and
the fastest plan takes as much as it is given. The default share is therefore
read from the host, not fixed: ``MemAvailable`` when ``compile_step`` plans,
less ``RESERVE_BYTES`` (at least 8 GiB, or 1/16 of the host's memory) left to
the user's data loader, Inductor's compile workers and the rest of the
machine. Ranks sharing one host (torchrun's ``LOCAL_WORLD_SIZE``) split it.
It is rounded down to whole GiB, so that the plan (and the compile caches
keyed by it) stays the same from run to run while the free memory drifts.
An explicit share (``offload_activations=0.88``) is of the physical memory,
as before.
"""
import os

from compile_stack.memory_plan.sizes import GIB

MIN_RESERVE_BYTES = 8 * GIB
RESERVE_FRACTION = 1 / 16


def reserve_bytes(total: int) -> int:
    """Host memory an offloading step leaves to everything else."""
    return max(MIN_RESERVE_BYTES, int(RESERVE_FRACTION * total))


def host_memory() -> tuple[int, int]:
    """(physical, available now) bytes of this host's memory (``/proc/meminfo``; the physical
    pages for both where it cannot be read)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return total, int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return total, total


def local_ranks() -> int:
    """Processes of this job sharing the host (torchrun's ``LOCAL_WORLD_SIZE``; 1 outside torchrun)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def default_host_bytes(total: int, available: int, ranks: int = 1) -> int:
    """One rank's default host share: ``available`` less the reserve of a ``total``-byte host,
    split between ``ranks``, in whole GiB (0 if nothing is left)."""
    share = max(0, available - reserve_bytes(total)) // max(1, ranks)
    return share // GIB * GIB


def host_bytes(share: float | None) -> int:
    """The host bytes an offloading step may pin: ``share`` of the physical memory if given, else
    the default share of what is free now (module docstring)."""
    total, available = host_memory()
    if share is not None:
        return int(share * total)
    return default_host_bytes(total, available, local_ranks())


def offload_host_bytes(offload: bool | float | None) -> int:
    """The host bytes of ``offload_activations`` (``options.py``): 0 when off, and by default under
    torchrun (offload is not built for FSDP2's sharded steps); else ``host_bytes``."""
    if offload is False or (offload is None and int(os.environ.get("WORLD_SIZE", "1")) > 1):
        return 0
    return host_bytes(offload if isinstance(offload, float) else None)
