"""The plain-torch Newton–Schulz iteration the op runs on CPU tensors: fp32 math on the input's
values, each stored product (A, B, the new X) rounded once to the input's dtype, as the kernels do."""
import torch


def iterate(x: torch.Tensor, steps: int, a: float, b: float, c: float) -> torch.Tensor:
    """``steps`` iterations of X ← a·X + (b·A + c·A²)·X, A = X Xᵀ, on x's transpose when x has more
    rows than columns (the same result: p(XXᵀ)X = X p(XᵀX)); a new contiguous tensor of x's shape."""
    dtype = x.dtype
    transposed = x.size(-2) > x.size(-1)
    w = (x.mT if transposed else x).float()
    for _ in range(steps):
        gram = (w @ w.mT).to(dtype).float()
        poly = (b * gram + c * (gram @ gram)).to(dtype).float()
        w = (a * w + poly @ w).to(dtype).float()
    out = w.to(dtype)
    return (out.mT if transposed else out).contiguous()
