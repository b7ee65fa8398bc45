"""Pinned host buffers for offloaded activations: sized exactly, pinned ahead, reused.

torch's pinned allocator rounds each block up to a power of two (a 1.34 GiB
activation would take 2 GiB of a host that has no memory to spare), so these
are plain host allocations registered with CUDA (``cudaHostRegister``), which
take what they hold. Pinning costs ~0.06 s per GiB on the H200 host (pages
faulted in by a fill, in 2 MiB pages where Linux gives them, then locked), so
a buffer taken from the pool starts the pinning of spares of its size on a
background thread, and a step's later offloads find them ready or nearly; up
to SPARES buffers beyond a step's need stay pinned, as far as the bytes pinned
stay within the pool's ``limit`` (the host share the offloading step was given).
A buffer is free again when no tensor but the pool's own views its memory: a
saved activation keeps its buffer until autograd lets it go, however long
that is. ``needed()`` says how many of each size a step held at once, and
``pin_ahead`` pins that many in the background before a step asks (a warm
start: compile_stack/memory_plan/host_pinning.py remembers them beside the caches).
"""
import ctypes
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch_internals import fx

# One pinning thread: with 2 MiB pages one pinned 15-17 GiB/s on the H200 host, four at once 11-14
# (the driver's lock), and fewer threads leave more of the CPU to a first call's tracing.
PIN_THREADS = 1
# Spare buffers of a size pinned ahead of demand, once that size has been asked for.
SPARES = PIN_THREADS


def _views(buffer: torch.Tensor) -> int:
    """How many tensors hold ``buffer``'s memory (the pool's own included, and the storage
    object this call makes)."""
    return fx.storage_use_count(buffer)


# ``_views`` of a buffer only the pool holds.
_IDLE = _views(torch.empty(1, dtype=torch.uint8))


def is_free(buffer: torch.Tensor) -> bool:
    """Whether only the pool holds ``buffer``."""
    return _views(buffer) <= _IDLE


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux's madvise advice for transparent huge pages
_madvise = getattr(ctypes.CDLL(None), "madvise", None)  # None where the C library has none


def advise_huge_pages(buffer: torch.Tensor) -> tuple[int, int]:
    """Ask Linux to back the whole 2 MiB pages inside ``buffer`` with huge pages (transparent huge
    pages in ``madvise`` or ``always`` mode; elsewhere the advice is refused and small pages stay).
    On the H200 host filling and registering such memory ran 2.3x faster (one thread: 15-17 GiB/s
    against 6.4-7.0). Returns the advised address range."""
    start = -(-buffer.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (buffer.data_ptr() + buffer.numel() * buffer.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end <= start or _madvise is None:
        return start, start
    _madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(_MADV_HUGEPAGE))
    return start, end


def _pinned(nbytes: int) -> torch.Tensor:
    """A new buffer, its pages faulted in by a fill first (registering fresh memory pins it page by
    page under the driver's lock, 2.4 GiB/s on the H200 host), in huge pages where Linux gives them."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    advise_huge_pages(buffer)
    buffer.zero_()
    error = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
    if int(error):  # not cudaSuccess
        raise RuntimeError(f"activation offload: could not pin {nbytes / 2**30:.2f} GiB of host memory "
                           f"({error}); offload less (a smaller model or batch) or turn offload_activations off")
    return buffer


class HostBufferPool:
    """Exact-size pinned host buffers, handed out as uint8 tensors and reused once free."""

    def __init__(self):
        self._lock = threading.Lock()
        self._buffers: dict[int, list[torch.Tensor]] = {}  # nbytes -> buffers, free or not
        self._pending: dict[int, list[Future]] = {}  # nbytes -> buffers being pinned
        self._needed: dict[int, int] = {}  # nbytes -> the most buffers of that size held at once
        self._executor: ThreadPoolExecutor | None = None
        self._limit: int | None = None  # bytes pinned beyond which nothing is pinned ahead

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A pinned uint8 buffer of ``nbytes`` that no other tensor views; pinned now if none is."""
        with self._lock:
            buffers = self._buffers.setdefault(nbytes, [])
            free = next((b for b in buffers if is_free(b)), None)
            held = sum(not is_free(b) for b in buffers) + 1
            self._needed[nbytes] = max(self._needed.get(nbytes, 0), held)
            pending = self._pending.setdefault(nbytes, [])
            ready = free is None and pending and pending[0]
        if free is None:
            if ready:  # the oldest spare being pinned: wait for it rather than pin another now
                free = ready.result()
                with self._lock:
                    pending.remove(ready)
                    buffers.append(free)
            else:
                free = self._add(nbytes)
        self._pin_spares(nbytes, taken=free)
        return free

    def _add(self, nbytes: int) -> torch.Tensor:
        buffer = _pinned(nbytes)
        with self._lock:
            self._buffers[nbytes].append(buffer)
        return buffer

    def _submit(self, nbytes: int, count: int) -> None:
        """Pin ``count`` more buffers of ``nbytes`` on the background threads (the lock held)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(PIN_THREADS, thread_name_prefix="pin-host")
        self._pending.setdefault(nbytes, []).extend(self._executor.submit(_pinned, nbytes) for _ in range(count))

    def limit(self, nbytes: int) -> None:
        """Pin ahead (spares, ``pin_ahead``) only while the pool's bytes, pinned or being pinned,
        stay within ``nbytes``; buffers a step asks for are pinned regardless."""
        with self._lock:
            self._limit = nbytes

    def _claimed(self) -> int:
        """Bytes pinned or being pinned (the lock held)."""
        return sum(n * (len(self._buffers.get(n, ())) + len(self._pending.get(n, ())))
                   for n in self._buffers.keys() | self._pending.keys())

    def needed(self) -> dict[int, int]:
        """The most buffers of each size held at once so far."""
        with self._lock:
            return dict(self._needed)

    def pin_ahead(self, needed: dict[int, int]) -> None:
        """Start pinning buffers up to ``needed`` of each size (nbytes -> count), within the pool's
        limit, largest sizes first."""
        with self._lock:
            total = self._claimed()
            for nbytes, count in sorted(needed.items(), reverse=True):
                have = len(self._buffers.setdefault(nbytes, [])) + len(self._pending.setdefault(nbytes, []))
                more = max(0, count - have)
                if self._limit is not None:
                    more = min(more, (self._limit - total) // nbytes)
                self._submit(nbytes, more)
                total += more * nbytes

    def _pin_spares(self, nbytes: int, taken: torch.Tensor) -> None:
        """Keep SPARES free buffers of this size, besides the one just ``taken``, pinned or being pinned."""
        with self._lock:
            free = sum(is_free(b) for b in self._buffers[nbytes] if b is not taken)
            missing = SPARES - free - len(self._pending[nbytes])
            if self._limit is not None:
                missing = min(missing, (self._limit - self._claimed()) // nbytes)
            if missing > 0:
                self._submit(nbytes, missing)

    def pinned_bytes(self) -> int:
        """Bytes pinned by the pool (its buffers, free or not)."""
        with self._lock:
            return sum(nbytes * len(buffers) for nbytes, buffers in self._buffers.items())

    def release(self) -> None:
        """Unpin and drop every buffer no tensor views; buffers still viewed stay."""
        with self._lock:
            pending = [f for futures in self._pending.values() for f in futures]
            self._pending.clear()
        for future in pending:
            if future.exception() is not None:
                continue  # never pinned: nothing to unpin
            buffer = future.result()
            with self._lock:
                self._buffers.setdefault(buffer.numel(), []).append(buffer)
        with self._lock:
            for nbytes, buffers in list(self._buffers.items()):
                kept = []
                for buffer in buffers:
                    if is_free(buffer):
                        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))
                    else:
                        kept.append(buffer)
                self._buffers[nbytes] = kept
