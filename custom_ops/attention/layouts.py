"""The two memory layouts the attention ops read and write in place, and the rule for their outputs.

A [B, H, S, D] tensor is heads-major when contiguous, and sequence-major when its memory is
[B, S, H, D]: what splitting heads off a [B, S, H·D] projection gives (``view``, then
``transpose(1, 2)``). ``out`` and ``dv`` are laid out like ``v``, so that merging heads after
attention (``transpose(1, 2).reshape``) and dv's way back into v's projection are views, not
copies; every other output is contiguous. A 3-d [N, S, D] tensor counts as [1, N, S, D]. Where
H or S is 1 the two layouts are one, and a contiguous tensor counts as heads-major.
"""
import torch


def is_sequence_major(t: torch.Tensor) -> bool:
    """Whether ``t`` ([B, H, S, D] or [N, S, D]) is a non-contiguous view of [B, S, H, D] memory."""
    if t.dim() not in (3, 4) or t.is_contiguous():
        return False
    t4 = t if t.dim() == 4 else t.unsqueeze(0)
    _, h, s, d = t4.shape
    want = (s * h * d, d, h * d, 1)
    return all(size == 1 or stride == w for size, stride, w in zip(t4.shape, t4.stride(), want))


def empty_like_v(shape, dtype: torch.dtype, v: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``shape`` ([B, H, S, D] or [N, S, D], like v's), sequence-major if ``v`` is."""
    if not is_sequence_major(v):
        return torch.empty(shape, dtype=dtype, device=v.device)
    *lead, s, d = shape
    return torch.empty((*lead[:-1], s, lead[-1], d), dtype=dtype, device=v.device).transpose(-3, -2)
