"""The plain-torch row step the op runs on CPU tensors (fp32 math)."""
import torch


def xent_rows_torch_(logits, targets, loss_rows, scale, flag, ignore_index: int):
    """Same contract as xent_rows_triton_, in plain torch with fp32 math (the CPU path)."""
    V = logits.shape[1]
    kept = targets != ignore_index
    bad = kept & ((targets < 0) | (targets >= V))
    valid = kept & (targets >= 0) & (targets < V)
    safe_targets = torch.where(valid, targets, 0)[:, None]
    x = logits.float()
    lse = torch.logsumexp(x, dim=1)
    nan = torch.full_like(lse, float("nan"))
    loss = torch.where(valid, lse - x.gather(1, safe_targets)[:, 0], 0.0)
    loss_rows.copy_(torch.where(bad, nan, loss))
    row_scale = torch.where(bad, nan, torch.where(valid, scale, 0.0))[:, None]
    g = torch.exp(x - lse[:, None]) * row_scale
    g.scatter_add_(1, safe_targets, -row_scale)
    logits.copy_(g)
    flag.bitwise_or_(bad.any())
