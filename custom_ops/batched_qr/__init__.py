"""Batched Householder QR of fp32 matrices as the ``cstack`` custom ops.

    torch.ops.cstack.batched_qr(A) -> (Q, R)        # = torch.linalg.qr(A), mode "reduced"
    torch.ops.cstack.batched_geqrf(A) -> (a, tau)   # = torch.geqrf(A)

For A [..., m, n], k = min(m, n): Q [..., m, k], R [..., k, n]; a [..., m, n] holds R on and
above its diagonal and the Householder vectors below it, tau [..., k]. LAPACK's reflectors
(slarfg's signs), so Q and R equal cuSOLVER's for full-rank input up to rounding: a drop-in
replacement. Optimizers such as SOAP/Shampoo factor batches of fp32 matrices; torch loops over
the batch on CUDA (one cuSOLVER call a matrix), while every kernel here has the batch as its
grid's first axis. A graph pass swaps torch's calls for these ops where ``prefer_ours`` says
ours was measured faster.

How a batch is factored (``triton_kernels``): a small matrix (up to 64×64 padded) is one
program holding it in registers, unblocked, Q formed in the same program. A larger one is
blocked: panels of nb columns factored in registers (or streamed through L2 when too tall),
each panel's T factor (compact WY, I − V·T·Vᵀ), the trailing columns updated by the blocks,
and Q formed by applying the blocks backwards to the identity. Bad input, zero sizes, NaN:
``op``'s docstring.

One role a module:
- ``op``: the ops' registration (CUDA, CPU, fake, autograd), their checks, ``batched_qr`` and
  ``batched_geqrf``, and ``_triton_qr``/``_triton_geqrf``, the Triton path on any device (the tests
  run it on CPU tensors under ``TRITON_INTERPRET=1``);
- ``triton_kernels``: the kernels and their launchers; ``householder``: the device functions of
  one Householder step they share;
- ``cpu``: torch's LAPACK QR, the op on CPU tensors and the reference;
- ``configs``: launch configs, and ``prefer_ours`` with the speed table it reads.

Importing this package registers the ops.
"""
from custom_ops.batched_qr.configs import DEFAULT, SPEED_TABLE, QRConfig, prefer_ours
from custom_ops.batched_qr.op import _triton_geqrf, _triton_qr, batched_geqrf, batched_qr

__all__ = ["DEFAULT", "SPEED_TABLE", "QRConfig", "prefer_ours", "_triton_geqrf", "_triton_qr", "batched_geqrf",
           "batched_qr"]
