"""The op on CPU tensors: torch.linalg.qr / torch.geqrf themselves (LAPACK), the reference the
Triton kernels are checked against. LAPACK returns column-major matrices; the op's outputs are
contiguous (row-major), as the fake and the CUDA path give them."""
import torch


def torch_qr(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    Q, R = torch.linalg.qr(A, mode="reduced")
    return Q.contiguous(), R.contiguous()


def torch_geqrf(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, tau = torch.geqrf(A)
    return a.contiguous(), tau.contiguous()
