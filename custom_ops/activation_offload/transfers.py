"""Copies between a GPU and pinned host memory on a side stream, and the backward's prefetch.

An offloaded activation is copied out on the device's transfer stream after
everything the main stream has queued so far (the kernel that produced it and
every reader of it). Nothing in the forward waits for the copy.

No tensor is marked as used on the transfer stream (``record_stream``): the
caching allocator would then keep such memory from reuse until an event on
that stream passed, and when the device is nearly full it waits on the host
for those events, so the main stream ran dry behind the copies (the full
preset's step lost ~450 ms in such gaps on the H200). Instead this object
holds each tensor a copy reads or writes until the main stream is ordered
after the copy:

- a source copied out stays held (``in_flight``: the bytes the graph lets
  stay so) until its copy has finished, seen at a later offload, or until
  newer sources pass that limit, when the main stream waits for its copy
  first. Sources still held when the backward asks for them come back as
  they are, with no copy: the last call's activations never cross PCIe back;
- a copy back is written into memory taken on the main stream, after that
  memory's last readers there; the main stream waits for the copy before its
  first use, so its release later is in stream order. A copy started ahead
  and never asked for makes the main stream wait before it is dropped.

The backward asks for activations in the reverse of the order the forward
offloaded them. Each reload also starts the copies back of the activations
offloaded most recently and not yet asked for, up to the bytes the graph
asks to have ahead (one call's offloads: the plan counts them in its memory),
so one block's activations travel while the block after it runs its
backward. Copies out and in share the one transfer stream, so a host buffer
is never refilled before its copy back has read it.
"""
import dataclasses

import torch

from custom_ops.activation_offload.host_buffers import HostBufferPool, is_free


@dataclasses.dataclass
class Offloaded:
    """An activation on the host, as the forward left it."""

    buffer: torch.Tensor  # the pool's pinned uint8 buffer
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def host(self) -> torch.Tensor:
        return self.buffer.view(self.dtype).view(self.shape)


@dataclasses.dataclass
class Copy:
    """A GPU tensor a copy on the transfer stream reads (out) or writes (back), held until the main
    stream is ordered after ``done``."""

    tensor: torch.Tensor
    done: torch.cuda.Event
    version: int = 0  # the source's version counter when copied out: unchanged, it can come back as is

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def release(self) -> None:
        """Order the main stream after the copy; the tensor may then be dropped."""
        torch.cuda.current_stream(self.tensor.device).wait_event(self.done)


class Transfers:
    """The offloads of one process: its transfer streams, host buffers, sources held and copies
    started ahead (each keyed by its host buffer's address)."""

    def __init__(self):
        self.pool = HostBufferPool()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._offloaded: list[Offloaded] = []  # forward order, not yet reloaded
        self._held: dict[int, Copy] = {}  # sources being (or just) copied out, oldest first
        self._ahead: dict[int, Copy] = {}  # copies back started ahead

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _start_copy(self, dst: torch.Tensor, src: torch.Tensor, device: torch.device) -> torch.cuda.Event:
        """``dst.copy_(src)`` on the transfer stream, after what the main stream has queued so far."""
        stream = self._stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            done.record(stream)
        return done

    def offload(self, x: torch.Tensor, in_flight: int) -> torch.Tensor:
        """``x`` (contiguous, on a GPU) copied to a pinned host buffer; returns at once. ``x`` stays
        held while its copy runs, within ``in_flight`` bytes of earlier sources."""
        buffer = self.pool.acquire(x.numel() * x.element_size())
        self._forget(buffer.data_ptr())
        entry = Offloaded(buffer, x.shape, x.dtype, x.device)
        host = entry.host()
        self._held[buffer.data_ptr()] = Copy(x, self._start_copy(host, x, x.device), x._version)
        self._offloaded.append(entry)
        self._let_go(keep=buffer.data_ptr(), limit=in_flight)
        return host

    def _let_go(self, keep: int, limit: int) -> None:
        """Drop held sources whose copy has finished, or whose host copy nothing holds any more, and
        the oldest others beyond ``limit`` bytes (the main stream waiting for their copies)."""
        held = sum(c.nbytes for a, c in self._held.items() if a != keep)
        buffers = {e.buffer.data_ptr(): e.buffer for e in self._offloaded}
        for address, copy in list(self._held.items()):
            if address == keep:
                continue
            if copy.done.query() or is_free(buffers[address]) or held > limit:
                copy.release()
                del self._held[address]
                held -= copy.nbytes

    def reload(self, host: torch.Tensor, device: torch.device, ahead: int) -> torch.Tensor:
        """``host`` on ``device``, ready for the main stream's next kernels; the copies back of the
        next ``ahead`` bytes started."""
        if device.index is None:  # "cuda": the current one, as tensors name it
            device = torch.device(device.type, torch.cuda.current_device())
        address = host.data_ptr()
        source = self._held.pop(address, None)
        if source is not None and source.tensor._version == source.version and source.tensor.device == device:
            copy = source  # never let go: the values are still on the GPU
        else:
            if source is not None:
                source.release()
            copy = self._ahead.pop(address, None) or self._copy_back(host, device)
        self._forget(address)  # asked for: no longer to start ahead
        self._start_ahead(device, ahead)
        copy.release()
        return copy.tensor

    def _copy_back(self, host: torch.Tensor, device: torch.device) -> Copy:
        tensor = torch.empty(host.shape, dtype=host.dtype, device=device)
        return Copy(tensor, self._start_copy(tensor, host, device))

    def _start_ahead(self, device: torch.device, limit: int) -> None:
        """Start the copies back of the latest offloads until ``limit`` bytes are on the GPU for the
        backward (held sources count); an offload whose host copy was let go without a reload is
        dropped."""
        on_gpu = [*self._ahead.values(), *(c for c in self._held.values() if c.tensor.device == device)]
        ahead = sum(c.nbytes for c in on_gpu)
        for entry in reversed(list(self._offloaded)):
            address = entry.buffer.data_ptr()
            if address in self._held:
                continue
            if ahead + entry.buffer.numel() > limit:
                break
            if is_free(entry.buffer):
                self._forget(address)
            elif entry.device == device and address not in self._ahead:
                self._ahead[address] = self._copy_back(entry.host(), device)
                ahead += entry.buffer.numel()

    def _forget(self, address: int) -> None:
        """Drop what is known of a host buffer's contents: asked for back, or handed out again."""
        for copies in (self._ahead, self._held):
            if (copy := copies.pop(address, None)) is not None:
                copy.release()
        self._offloaded = [e for e in self._offloaded if e.buffer.data_ptr() != address]

    def release(self) -> None:
        """Drop the sources held and the copies started ahead; unpin the host buffers no tensor holds."""
        for copies in (self._ahead, self._held):
            for copy in copies.values():
                copy.release()
            copies.clear()
        self._offloaded = [e for e in self._offloaded if not is_free(e.buffer)]
        self.pool.release()
