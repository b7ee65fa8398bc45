"""Rotary position embedding (RoPE) as the ``cstack`` custom op.

    torch.ops.cstack.rope(x, cos, sin, interleaved_in, interleaved_out, inverse, dtype=None) -> out

Rotates each pair of ``x``'s last dim by a per-position angle (``rope``'s docstring has the
formula and the two pairings); ``inverse`` rotates back, which is also the gradient. The RoPE
pass (``passes/rope``) puts it in place of the forward rotation as people write it.

One role a module:
- ``op``: the op's registration (CUDA, CPU, fake, autograd), its argument checks, and ``rope``;
- ``configs``: the kernel's launch config;
- ``triton_kernels``: the Triton kernel and its launcher (``triton_rope``); it runs on any CUDA GPU
  and, under ``TRITON_INTERPRET=1``, on CPU tensors (how the tests check it);
- ``cpu``: the plain-torch rotation the op runs on CPU tensors and where the kernel does not apply.

Importing this package registers the op.
"""
from custom_ops.rope.configs import BLOCK_ROWS, NUM_WARPS
from custom_ops.rope.cpu import torch_rope
from custom_ops.rope.op import check_rope_args, rope, rope_op
from custom_ops.rope.triton_kernels import _rope_kernel, kernel_applies, kernel_takes, triton_rope

__all__ = ["BLOCK_ROWS", "NUM_WARPS", "torch_rope", "check_rope_args", "rope", "rope_op", "_rope_kernel",
           "kernel_applies", "kernel_takes", "triton_rope"]
