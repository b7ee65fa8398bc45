"""Fused multi-tensor AdamW as the ``cstack`` custom op.

    torch.ops.cstack.fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, lr, step,
                                  beta1, beta2, eps, weight_decay, torch_semantics) -> None

One optimizer step over all parameters in one Triton launch per dtype group
(params, grads, moments each bf16, fp16 or fp32; math in fp32, each result
rounded once to its storage dtype). The kernel reads every tensor through a
device-side table of raw data pointers, so the whole model is one grid.
``lr`` and ``step`` are 0-d float32 tensors read by the kernel from device
memory: a new lr or step value needs no recompile of a graph and no host sync.
How bad input, bad lr/step values and the fused cross-entropy's bad targets are
refused: ``op``'s docstring.

Semantics (docs/reference.md §2), step t = ``step`` (already incremented):
  reference (default):  p ← p·(1 − lr·wd);  m ← β₁m + (1−β₁)g;  v ← β₂v + (1−β₂)g²;
                        p ← p − lr·√(1−β₂ᵗ)/(1−β₁ᵗ) · m / (√v + eps)
  torch_semantics=True: as torch.optim.AdamW, eps inside the bias correction:
                        p ← p − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + eps)

Only parameters that have a gradient are passed: the caller skips the rest.

One role a module:
- ``op``: the op's registration (CUDA, CPU, fake), its argument checks, the CUDA path's plan
  cache (``_triton_step``), and ``fused_adamw``;
- ``configs``: the kernel's launch config;
- ``triton_kernels``: the Triton kernel, its pointer tables, its launcher and its per-device
  error flag (``raise_if_refused``); it runs on any CUDA GPU and, under ``TRITON_INTERPRET=1``,
  on CPU tensors (how the tests check it);
- ``cpu``: the plain-torch step the op runs on CPU tensors.

Importing this package registers the op. The names below are those callers, tests and
benchmarks reach through the package.
"""
from custom_ops.adamw.configs import BLOCK, NUM_WARPS
from custom_ops.adamw.triton_kernels import (
    REFUSED_LR, REFUSED_STEP, REFUSED_TARGETS, _adamw_kernel, _refusals_for, forget_refused_targets,
    raise_if_refused)
from custom_ops.adamw.op import _plans, _triton_step, fused_adamw, fused_adamw_

__all__ = [
    "BLOCK", "NUM_WARPS", "REFUSED_LR", "REFUSED_STEP", "REFUSED_TARGETS", "_adamw_kernel", "_refusals_for",
    "forget_refused_targets", "raise_if_refused", "_plans", "_triton_step", "fused_adamw", "fused_adamw_",
]
