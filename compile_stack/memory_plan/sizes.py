"""Sizes the memory plan works in: bytes of (fake) tensors and what a device has."""
import os

import torch

GIB = 2**30
# Of the memory a device reports, the share a run may plan to use (allocator slack: the CUDA
# context, NCCL and cuBLAS buffers, fragmentation).
USABLE_FRACTION = 0.95


def fits(estimate_bytes: float, device_bytes: float) -> bool:
    """Whether an estimated peak leaves the allocator its slack on a device of ``device_bytes``."""
    return estimate_bytes <= USABLE_FRACTION * device_bytes


def device_bytes(device: torch.device) -> float:
    """Memory a run on ``device`` can have: the GPU's, or the machine's RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def size_hint(size) -> int:
    """A size as an int: a symbolic one by the example value it was traced with (0 if none)."""
    if isinstance(size, torch.SymInt):
        return int(size.node.hint) if size.node.has_hint() else 0
    return int(size)


def tensor_bytes(value) -> int:
    """Bytes of a (fake) tensor, a symbolic size by its example value; 0 for anything else."""
    if not isinstance(value, torch.Tensor):
        return 0
    return size_hint(value.numel()) * value.element_size()
