"""The plain-torch attention the ops run on CPU tensors: fp32, one chunk of queries at a time,
so no Sq x Sk score block is ever whole. Outputs in the ops' layouts (``layouts``)."""
import torch

from custom_ops.attention.layouts import empty_like_v

CPU_CHUNK = 256  # queries per step: bounds the score block to CPU_CHUNK x Sk per (batch, head)


def _causal_mask(c0: int, c1: int, device: torch.device) -> torch.Tensor:
    """True where key j > query i, for queries [c0, c1) and keys [0, c1)."""
    rows = torch.arange(c0, c1, device=device)[:, None]
    return torch.arange(c1, device=device)[None, :] > rows


def torch_fwd(q, k, v, is_causal: bool, scale: float):
    """Attention in fp32, one chunk of queries at a time; returns (out, lse)."""
    sq = q.shape[-2]
    kf, vf = k.float(), v.float()
    out = empty_like_v(q.shape, q.dtype, v)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for c0 in range(0, sq, CPU_CHUNK):
        c1 = min(c0 + CPU_CHUNK, sq)
        kc, vc = (kf[..., :c1, :], vf[..., :c1, :]) if is_causal else (kf, vf)
        s = q[..., c0:c1, :].float() @ kc.transpose(-1, -2) * scale
        if is_causal:
            s.masked_fill_(_causal_mask(c0, c1, q.device), float("-inf"))
        lse_c = torch.logsumexp(s, dim=-1)
        out[..., c0:c1, :] = torch.exp(s - lse_c[..., None]) @ vc
        lse[..., c0:c1] = lse_c
    return out, lse


def torch_bwd(dout, q, k, v, out, lse, is_causal: bool, scale: float):
    """Backward of torch_fwd from the saved lse, in fp32 chunks of queries; returns (dq, dk, dv)."""
    sq = q.shape[-2]
    kf, vf = k.float(), v.float()
    delta = (dout.float() * out.float()).sum(-1)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for c0 in range(0, sq, CPU_CHUNK):
        c1 = min(c0 + CPU_CHUNK, sq)
        nk = c1 if is_causal else k.shape[-2]
        kc, vc = kf[..., :nk, :], vf[..., :nk, :]
        qc, doc = q[..., c0:c1, :].float(), dout[..., c0:c1, :].float()
        s = qc @ kc.transpose(-1, -2) * scale
        if is_causal:
            s.masked_fill_(_causal_mask(c0, c1, q.device), float("-inf"))
        p = torch.exp(s - lse[..., c0:c1, None])
        dv[..., :nk, :] += p.transpose(-1, -2) @ doc
        ds = p * (doc @ vc.transpose(-1, -2) - delta[..., c0:c1, None])
        dq[..., c0:c1, :] = ds @ kc * scale
        dk[..., :nk, :] += ds.transpose(-1, -2) @ qc * scale
    return dq, dk.to(k.dtype), empty_like_v(v.shape, v.dtype, v).copy_(dv)
