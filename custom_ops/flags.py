"""The per-device bad-target flag two fused ops share, without either importing the other.

The fused cross-entropy (``linear_cross_entropy``) sets a device's flag when it sees a target outside
[0, V) that is not ignore_index (its gradients are NaN then); the fused AdamW (``adamw``) reads it and
skips its update while it is set, so NaN gradients never reach the weights. Setting and reading stay on
the device (no host sync). Whichever op reports a bad target first clears the record the other keeps of
it, so the user hears of it once: ``check_targets_flags`` runs the ``on_targets_reported`` callbacks
(AdamW's), and AdamW calls ``clear_targets_flag`` when it reports.
"""
from collections.abc import Callable

import torch

# int32 [1] per device: 0, or nonzero once a cross-entropy call saw a bad target, until cleared.
_flags: dict[torch.device, torch.Tensor] = {}
_reported: list[Callable[[], None]] = []


def targets_flag(device: torch.device | str) -> torch.Tensor:
    """The device's flag (made on first use), for a kernel to set or read in device memory."""
    device = torch.device(device)
    flag = _flags.get(device)
    if flag is None:
        flag = _flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return flag


def targets_flag_set(device: torch.device | str) -> bool:
    """Whether the device's flag is set: a host read (a sync on a GPU)."""
    flag = _flags.get(torch.device(device))
    return flag is not None and bool(flag.item())


def clear_targets_flag(device: torch.device | str) -> None:
    """Reset the device's flag (no read, no sync): a bad target it recorded has been reported."""
    flag = _flags.get(torch.device(device))
    if flag is not None:
        flag.zero_()


def check_targets_flags() -> bool:
    """Whether any device's flag was set (a host read of each); resets them all, and if one was set
    runs the ``on_targets_reported`` callbacks: the caller reports that target now."""
    seen = False
    for flag in _flags.values():
        seen = bool(flag.item()) or seen
        flag.zero_()
    if seen:
        for callback in _reported:
            callback()
    return seen


def on_targets_reported(callback: Callable[[], None]) -> None:
    """Have ``callback`` run whenever ``check_targets_flags`` finds a flag set (once per callback)."""
    if callback not in _reported:
        _reported.append(callback)
