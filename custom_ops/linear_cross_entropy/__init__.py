"""Fused LM head + cross-entropy that never builds the full [T, V] logits.

At T = 65,536 tokens and V = 151,936 the logits alone are 20 GB in bf16, so the
op walks the tokens in chunks whose logits stay under ``CHUNK_BYTES``. Per chunk:

    logits = h_chunk @ Wᵀ (+ bias)              (cuBLAS, input dtype)
    row kernel, in place: logits ← (softmax − onehot(target)) · scale,
                          loss_rows ← logsumexp − logit[target]      (fp32)
    grad_hidden[chunk] = G @ W ;  grad_weight += Gᵀ @ h_chunk ;  grad_bias += Σ_rows G   (fp32)

so the gradients come out of the forward at the cost of the three matmuls that
any fused design needs; the backward only multiplies them by the upstream
gradient. scale is 1/count for "mean" (count of non-ignored targets, computed on
device: no host sync) and 1 for "sum"; ignored rows get zero loss and gradient.

Ops (the bias optional, [V], weight's dtype and device):
  * ``cstack::linear_cross_entropy_fwd(hidden, weight, targets, ignore_index,
    reduction, bias=None) -> (loss, grad_hidden, grad_weight, grad_bias)``: the
    work; no autograd. grad_bias is empty without a bias (an op's output cannot be None).
  * ``cstack::linear_cross_entropy(hidden, weight, targets, ignore_index,
    reduction, bias=None) -> loss``: differentiable in hidden, weight and bias. A
    CompositeImplicitAutograd op: under autograd (eager or AOTAutograd tracing)
    it becomes the fwd op in the forward graph and scalar multiplies in the
    backward graph. A custom_op with register_autograd cannot do that, since its
    backward only sees the op's inputs and outputs and the gradients are neither.

A target outside [0, V) gives NaN and sets a per-device flag (``custom_ops.flags``) that
``fused_adamw_`` reads: ``op``'s docstring.

One role a module:
- ``op``: the ops' registration (CUDA, CPU, fake, composite), argument checks, FLOP formula and
  autograd, the chunk loop (``fwd_chunked``), ``check_targets_flag``, and ``linear_cross_entropy``;
- ``configs``: the chunk size (``CHUNK_BYTES``, ``chunk_tokens``) and the row kernel's tile and warps;
- ``triton_kernels``: the row kernel and its launcher (``xent_rows_triton_``), which run on any
  CUDA GPU and, under ``TRITON_INTERPRET=1``, on CPU tensors (how the tests check them);
- ``cpu``: the plain-torch row step the op runs on CPU tensors (``xent_rows_torch_``).

Importing this package registers the ops. The names below are those callers, tests and
benchmarks reach through the package.
"""
from custom_ops.linear_cross_entropy.configs import CHUNK_BYTES, chunk_tokens, chunk_tokens_for
from custom_ops.linear_cross_entropy.cpu import xent_rows_torch_
from custom_ops.linear_cross_entropy.triton_kernels import _xent_rows_kernel, xent_rows_triton_
from custom_ops.linear_cross_entropy.op import (
    check_targets_flag, fwd_chunked, linear_cross_entropy, linear_cross_entropy_fwd)

__all__ = [
    "CHUNK_BYTES", "chunk_tokens", "chunk_tokens_for", "xent_rows_torch_", "_xent_rows_kernel",
    "xent_rows_triton_", "check_targets_flag", "fwd_chunked", "linear_cross_entropy", "linear_cross_entropy_fwd",
]
