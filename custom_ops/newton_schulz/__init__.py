"""Muon's Newton–Schulz orthogonalisation as the ``cstack`` custom op.

    torch.ops.cstack.newton_schulz(X, steps, a, b, c) -> Tensor

``steps`` iterations of the odd quintic, on bf16 X ([m, n] or [batch, m, n], any strides)
exactly as given (the caller normalises X first):

    A = X Xᵀ;  B = b·A + c·A²;  X ← a·X + B·X

When m > n the op iterates on Xᵀ (p(XXᵀ)X = X·p(XᵀX): the same result with an n×n A instead
of m×m) and returns the result in X's orientation. Out of place: a new contiguous tensor of X's
shape and dtype. Not differentiable (a backward through it raises). ``zeropower`` is the whole
Muon orthogonalisation (bf16 cast, orientation, Frobenius normalisation, the op) for code that
calls us directly; the graph pass in passes/newton_schulz rewrites the iteration chain of a
compiled optimizer into the op.

Why our own kernels: A and B are symmetric, so only the tiles on and above their diagonal are
computed (a SYRK-style kernel storing each tile and its mirror), and the b·A + c·A² and
a·X + B·X sums are the epilogues of the products, each element rounded once to bf16.

One role a module:
- ``op``: the op's registration (CUDA, CPU, fake, the backward that raises), its argument
  checks, ``MUON_COEFFICIENTS`` and ``zeropower``;
- ``configs``: the kernels' tiles;
- ``triton_kernels``: the two Triton kernels and the launcher ``newton_schulz_triton``; it runs on
  CUDA GPUs with TMA and, under ``TRITON_INTERPRET=1``, on CPU tensors (how the tests check it);
- ``cpu``: the plain-torch iteration the op runs on CPU tensors.

Importing this package registers the op.
"""
from custom_ops.newton_schulz.configs import TILES, Gemm, Syrk, Tiles
from custom_ops.newton_schulz.op import MUON_COEFFICIENTS, newton_schulz, zeropower
from custom_ops.newton_schulz.triton_kernels import newton_schulz_triton

__all__ = ["MUON_COEFFICIENTS", "TILES", "Gemm", "Syrk", "Tiles", "newton_schulz", "newton_schulz_triton",
           "zeropower"]
