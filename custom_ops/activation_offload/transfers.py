"""Copies between a GPU and pinned host memory on a side stream, and the backward's prefetch.

An offloaded activation is copied out on the device's transfer stream after
everything the main stream has queued so far (the kernel that produced it and
every reader of it); the GPU tensor is marked as used on that stream, so the
caching allocator does not hand its memory out again before the copy has
read it. Nothing in the forward waits for the copy.

The backward asks for activations in the reverse of the order the forward
offloaded them. Each reload also starts the copies back of the activations
offloaded most recently and not yet asked for, up to the bytes the graph
asks to have ahead (one call's offloads: the plan counts them in its memory),
so one block's activations travel while the block after it runs its
backward; the main stream waits only for the copy it asks for. Copies out and
in share the one transfer stream, so a host buffer is never refilled before
its copy back has read it.
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
class CopyBack:
    tensor: torch.Tensor  # on the GPU, filled once ``done`` has passed
    done: torch.cuda.Event


class Transfers:
    """The offloads of one process: its transfer streams, host buffers and copies started ahead."""

    def __init__(self):
        self.pool = HostBufferPool()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._offloaded: list[Offloaded] = []  # forward order, not yet reloaded
        self._ahead: dict[int, CopyBack] = {}  # host address -> its copy back, started ahead

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def offload(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (contiguous, on a GPU) copied to a pinned host buffer; returns at once."""
        buffer = self.pool.acquire(x.numel() * x.element_size())
        self._forget(buffer.data_ptr())
        entry = Offloaded(buffer, x.shape, x.dtype, x.device)
        host = entry.host()
        stream = self._stream(x.device)
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream):
            host.copy_(x, non_blocking=True)
        x.record_stream(stream)
        self._offloaded.append(entry)
        return host

    def reload(self, host: torch.Tensor, device: torch.device, ahead: int) -> torch.Tensor:
        """``host`` on ``device``, ready for the main stream's next kernels; the copies back of the
        next ``ahead`` bytes started."""
        copy = self._ahead.get(host.data_ptr()) or self._copy_back(host, device)
        self._forget(host.data_ptr())  # asked for: no longer to start ahead
        self._start_ahead(device, ahead)
        torch.cuda.current_stream(device).wait_event(copy.done)
        return copy.tensor

    def _copy_back(self, host: torch.Tensor, device: torch.device) -> CopyBack:
        stream = self._stream(device)
        tensor = torch.empty(host.shape, dtype=host.dtype, device=device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the memory's last readers first
        done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            tensor.copy_(host, non_blocking=True)
            done.record(stream)
        tensor.record_stream(stream)  # dropped unused, its memory waits for the copy
        return CopyBack(tensor, done)

    def _start_ahead(self, device: torch.device, limit: int) -> None:
        """Start the copies back of the latest offloads until ``limit`` bytes are on their way; an
        offload whose tensor was let go without a reload is dropped."""
        ahead = sum(c.tensor.numel() * c.tensor.element_size() for c in self._ahead.values())
        for entry in reversed(list(self._offloaded)):
            if ahead + entry.buffer.numel() > limit:
                break
            address = entry.buffer.data_ptr()
            if is_free(entry.buffer):
                self._offloaded.remove(entry)
            elif entry.device == device and address not in self._ahead:
                self._ahead[address] = self._copy_back(entry.host(), device)
                ahead += entry.buffer.numel()

    def _forget(self, address: int) -> None:
        """Drop what is known of a host buffer's contents: asked for back, or handed out again."""
        self._ahead.pop(address, None)
        self._offloaded = [e for e in self._offloaded if e.buffer.data_ptr() != address]

    def release(self) -> None:
        """Drop the copies started ahead and unpin the host buffers no tensor holds."""
        self._ahead.clear()
        self._offloaded = [e for e in self._offloaded if not is_free(e.buffer)]
        self.pool.release()
