"""``cstack::offload_to_host`` and ``cstack::reload_to_device``: an activation's trip to host
memory between the forward and the backward.

The activation-offload plan (compile_stack/memory_plan/offload.py) puts them in the
partitioned graphs: the forward returns the host copy instead of the GPU
tensor, the backward copies it back before its first use. On CUDA both are
asynchronous (transfers.py); on the CPU they are copies, so a plan can be
tested anywhere. Values never change on the way.
"""
import torch

from custom_ops.activation_offload.transfers import Transfers
from custom_ops.checks import check_tensor, require

TRANSFERS = Transfers()


def _check_offloadable(x: torch.Tensor) -> None:
    check_tensor("x", x)
    require(x.is_contiguous(), "x", "a contiguous tensor", f"strides {tuple(x.stride())} for shape {tuple(x.shape)}")


@torch.library.custom_op("cstack::offload_to_host", mutates_args=())
def offload_to_host(x: torch.Tensor, after: list[torch.Tensor], in_flight: int) -> torch.Tensor:
    """``x``'s values in host memory (pinned; copied asynchronously from a GPU).

    ``after``: tensors the copy must follow, never read: results that exist only
    once every other reader of ``x`` has run (compile_stack/memory_plan/offload.py picks
    them), so that in any schedule the copy is ``x``'s last use and nothing
    writes its memory before the copy has read it.
    ``in_flight``: bytes of earlier offloads whose GPU memory may stay held while
    their copies run (the main stream waits for the copies of older ones).
    """
    _check_offloadable(x)
    require(in_flight >= 0, "in_flight", "a byte count >= 0", in_flight)
    if x.device.type == "cuda":
        return TRANSFERS.offload(x, in_flight)
    return x.clone()


@offload_to_host.register_fake
def _offload_to_host_fake(x, after, in_flight):
    _check_offloadable(x)
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


@torch.library.custom_op("cstack::reload_to_device", mutates_args=())
def reload_to_device(x: torch.Tensor, device: torch.device, ahead: int) -> torch.Tensor:
    """``x`` (in host memory) on ``device``; on a GPU, ready for the current stream's next kernels.

    ``ahead``: bytes of the activations offloaded before ``x`` whose copies back to start now,
    latest first (the backward asks for them next).
    """
    _check_offloadable(x)
    require(x.device.type == "cpu", "x", "a tensor in host memory", x.device)
    require(ahead >= 0, "ahead", "a byte count >= 0", ahead)
    if device.type == "cuda":
        return TRANSFERS.reload(x, device, ahead)
    return x.to(device, copy=True)


@reload_to_device.register_fake
def _reload_to_device_fake(x, device, ahead):
    _check_offloadable(x)
    return torch.empty(x.shape, dtype=x.dtype, device=device)


def _save_device(ctx, inputs, output):
    ctx.device = inputs[0].device
    ctx.after = len(inputs[1]) if isinstance(inputs[1], list) else 0


def _offload_backward(ctx, grad):
    """The values moved unchanged: the gradient goes back to the GPU; none for ``after``."""
    return grad.to(ctx.device), [None] * ctx.after, None


def _reload_backward(ctx, grad):
    """The values moved unchanged: the gradient goes back to the host."""
    return grad.to(ctx.device), None, None


offload_to_host.register_autograd(_offload_backward, setup_context=_save_device)
reload_to_device.register_autograd(_reload_backward, setup_context=_save_device)


def release_host_memory() -> None:
    """Unpin the host buffers no saved activation holds (after a compiled step is dropped)."""
    TRANSFERS.release()
