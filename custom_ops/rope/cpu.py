"""The plain-torch rotation the op runs on CPU tensors (and on CUDA where the kernel does not
apply): the same formulas as the kernel, in fp32, rounded once to the result's dtype."""
import torch


def split_pairs(t: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The two members of each pair along the last dim: (t[2i], t[2i+1]) or (t[i], t[i + D/2])."""
    if interleaved:
        return t[..., 0::2], t[..., 1::2]
    half = t.shape[-1] // 2
    return t[..., :half], t[..., half:]


def join_pairs(a: torch.Tensor, b: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return torch.stack([a, b], dim=-1).flatten(-2) if interleaved else torch.cat([a, b], dim=-1)


def torch_rope(x, cos, sin, interleaved_in: bool, interleaved_out: bool, inverse: bool,
               dtype: torch.dtype) -> torch.Tensor:
    width = x.shape[-1]
    c, s = cos.float(), sin.float()
    # A full-width table holds a value per output position, a half-width one a value per pair.
    c_a, c_b = split_pairs(c, interleaved_out) if c.shape[-1] == width else (c, c)
    s_a, s_b = split_pairs(s, interleaved_out) if s.shape[-1] == width else (s, s)
    if not inverse:
        first, second = split_pairs(x.float(), interleaved_in)
        out = join_pairs(first * c_a - second * s_a, second * c_b + first * s_b, interleaved_out)
    else:
        g_a, g_b = split_pairs(x.float(), interleaved_out)
        out = join_pairs(g_a * c_a + g_b * s_b, g_b * c_b - g_a * s_a, interleaved_in)
    return out.to(dtype).contiguous()
