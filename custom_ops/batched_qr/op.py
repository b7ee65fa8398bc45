"""The ``cstack::batched_qr`` and ``cstack::batched_geqrf`` ops: registration (CUDA, CPU, fake,
autograd), their argument checks, and ``batched_qr`` / ``batched_geqrf``, the functions callers use.

CUDA tensors run the Triton kernels (``triton_kernels``), CPU tensors ``cpu`` (torch's LAPACK).

Input A [..., m, n], checked before any launch (ValueError naming ``A``):
- a tensor of dtype float32 only. float64 is refused: the kernels compute in fp32, and a float64
  caller wants float64 accuracy (torch.linalg.qr gives it); bfloat16/float16 are refused too:
  Householder QR in 8 or 11 mantissa bits loses orthogonality, so such callers upcast first;
- rank >= 2;
- any layout: a non-contiguous A is factored from a contiguous copy (one copy, as
  torch.linalg.qr makes for LAPACK);
- zero sizes (m, n or a batch dimension 0) are handled as torch does: outputs of the same
  shapes (all empty, k = min(m, n)), no launch.
NaN/Inf are not looked for (that would be a host sync): they propagate through the matrix
they are in, as in torch.linalg.qr on CUDA, and the other matrices of the batch are unaffected
(each is its own program).

Autograd: batched_qr has the standard reduced-QR backward for m >= n, in plain torch ops
(``_qr_backward``); m < n raises. batched_geqrf has none, as torch.geqrf has none.
"""
import torch

from custom_ops.batched_qr.configs import DEFAULT, QRConfig
from custom_ops.batched_qr.cpu import torch_geqrf, torch_qr
from custom_ops.batched_qr.triton_kernels import triton_geqrf, triton_qr
from custom_ops.checks import require


def _check(A) -> None:
    require(isinstance(A, torch.Tensor), "A", "a torch.Tensor", type(A).__name__)
    require(A.dtype == torch.float32, "A", "dtype torch.float32 (float64 is left to torch.linalg.qr; "
            "bfloat16/float16 lose orthogonality: upcast to float32)", A.dtype)
    require(A.dim() >= 2, "A", "a tensor of rank >= 2 [..., m, n]", f"rank {A.dim()}")


def _qr_shapes(A):
    *batch, m, n = A.shape
    k = min(m, n)
    return (*batch, m, k), (*batch, k, n)


def _geqrf_shapes(A):
    *batch, m, n = A.shape
    return tuple(A.shape), (*batch, min(m, n))


def _run(A, launcher, shapes, cfg):
    """The Triton path: A as a contiguous [B, m, n], one launcher call, outputs reshaped back."""
    first, second = shapes(A)
    if A.numel() == 0:
        return A.new_empty(first), A.new_empty(second)
    m, n = A.shape[-2:]
    x, y = launcher(A.contiguous().view(-1, m, n), cfg)
    return x.view(first), y.view(second)


def _triton_qr(A: torch.Tensor, cfg: QRConfig = DEFAULT):
    """batched_qr's Triton path on A's device (CPU tensors: the interpreter)."""
    _check(A)
    return _run(A, triton_qr, _qr_shapes, cfg)


def _triton_geqrf(A: torch.Tensor, cfg: QRConfig = DEFAULT):
    """batched_geqrf's Triton path on A's device (CPU tensors: the interpreter)."""
    _check(A)
    return _run(A, triton_geqrf, _geqrf_shapes, cfg)


@torch.library.custom_op("cstack::batched_qr", mutates_args=(), device_types="cuda")
def batched_qr_op(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, R) = torch.linalg.qr(A) (mode "reduced") for fp32 A [..., m, n]."""
    with torch.cuda.device(A.device):
        return _triton_qr(A)


@batched_qr_op.register_kernel("cpu")
def _batched_qr_cpu(A):
    _check(A)
    return torch_qr(A)


@batched_qr_op.register_fake
def _batched_qr_fake(A):
    _check(A)
    first, second = _qr_shapes(A)
    return A.new_empty(first), A.new_empty(second)


@torch.library.custom_op("cstack::batched_geqrf", mutates_args=(), device_types="cuda")
def batched_geqrf_op(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, tau) = torch.geqrf(A) for fp32 A [..., m, n]: R on and above a's diagonal, the
    Householder vectors below it, tau [..., min(m, n)]."""
    with torch.cuda.device(A.device):
        return _triton_geqrf(A)


@batched_geqrf_op.register_kernel("cpu")
def _batched_geqrf_cpu(A):
    _check(A)
    return torch_geqrf(A)


@batched_geqrf_op.register_fake
def _batched_geqrf_fake(A):
    _check(A)
    first, second = _geqrf_shapes(A)
    return A.new_empty(first), A.new_empty(second)


def _qr_backward(Q, R, gQ, gR):
    """dA of the reduced QR, m >= n: M = R·gRᵀ − gQᵀ·Q, dA = (gQ + Q·copyltu(M))·R⁻ᵀ with
    copyltu(M) the symmetric matrix of M's lower triangle (its diagonal once)."""
    gQ = torch.zeros_like(Q) if gQ is None else gQ
    gR = torch.zeros_like(R) if gR is None else gR
    M = R @ gR.mT - gQ.mT @ Q
    lower = M.tril(-1)
    B = gQ + Q @ (lower + lower.mT + M.diagonal(dim1=-2, dim2=-1).diag_embed())
    return torch.linalg.solve_triangular(R.mT, B, upper=False, left=False)


def _qr_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*output)


def _qr_autograd(ctx, gQ, gR):
    Q, R = ctx.saved_tensors
    m, n = Q.shape[-2], R.shape[-1]
    if m < n:
        raise RuntimeError(f"cstack::batched_qr backward: supported for m >= n only (reduced QR of a "
                           f"wide matrix has no unique derivative formula here), got m={m} < n={n}")
    return _qr_backward(Q, R, gQ, gR)


def _geqrf_autograd(ctx, ga, gtau):
    raise RuntimeError("cstack::batched_geqrf has no derivative (torch.geqrf has none either): "
                       "differentiate cstack::batched_qr instead")


batched_qr_op.register_autograd(_qr_autograd, setup_context=_qr_setup_context)
batched_geqrf_op.register_autograd(_geqrf_autograd, setup_context=lambda ctx, inputs, output: None)


def batched_qr(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q, R of the reduced QR of every matrix of fp32 A [..., m, n] (as torch.linalg.qr)."""
    _check(A)
    return torch.ops.cstack.batched_qr(A)


def batched_geqrf(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a, tau of every matrix of fp32 A [..., m, n] (as torch.geqrf)."""
    _check(A)
    return torch.ops.cstack.batched_geqrf(A)
