"""FlashAttention (forward + backward) as the ``cstack`` custom ops.

    torch.ops.cstack.flash_attention_fwd(q, k, v, is_causal, scale) -> (out, lse)
    torch.ops.cstack.flash_attention_bwd(dout, q, k, v, out, lse, is_causal, scale) -> (dq, dk, dv)

q is ``[B, H, Sq, D]`` or ``[N, Sq, D]``, k and v ``[..., Sk, D]``. ``lse`` is the fp32
natural-log row log-sum-exp of ``scale * q @ k^T`` (masked); the backward recomputes the
probabilities from it, so nothing of size Sq x Sk is ever stored.

One role a module:
- ``op``: the ops' registration (fake, autograd, FLOP formulas), their argument checks, and
  ``flash_attention``;
- ``layouts``: the two memory layouts the kernels read and write in place, and the rule that
  lays out and dv out like v;
- ``configs``: the launch configs of every kernel, and the constants the kernels share;
- ``triton_kernels``: the Triton kernels and launchers (``triton_fwd``, ``triton_bwd``), which
  run on any CUDA GPU and, under ``TRITON_INTERPRET=1``, on CPU tensors (how the tests check them);
- ``gluon_forward``, ``gluon_backward``: the Hopper (sm_90) Gluon kernels (``hopper_fwd``,
  ``hopper_bwd``), which the CUDA ops run instead for 16-bit D=128 attention over whole 128-row
  tiles (the 8B model's); ``gluon_common``: their dispatch rule and shared descriptors;
- ``cpu``: the plain-torch path the ops run on CPU tensors (fp32, chunks of queries).

Importing this package registers the ops (once: Python imports ``op`` once). The names below
are those callers, tests and benchmarks reach through the package.
"""
from custom_ops.attention.configs import (
    CONFIGS, DELTA_BLOCK_M, DQ_FRAGMENT_ROW, HEAD_DIMS, HOPPER_BWD, HOPPER_BWD_ROWS, HOPPER_FWD,
    HOPPER_FWD_COMPUTE_REGS, HOPPER_HEAD_DIMS, INTERPRETER_CONFIG, LOG2E, AttnConfig, Tiles, pick_config)
from custom_ops.attention.cpu import CPU_CHUNK, torch_bwd, torch_fwd
from custom_ops.attention.layouts import empty_like_v, is_sequence_major
from custom_ops.attention.triton_kernels import (
    _as_4d, _attn_bwd_delta_kernel, _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _attn_fwd_kernel, _delta,
    triton_bwd, triton_fwd)
from custom_ops.attention.gluon_backward import (
    _attn_bwd_hopper_kernel, _attn_dq_from_fragments_kernel, _dq_fragments, _dq_layout, _fragments_desc,
    dq_from_fragments, hopper_bwd)
from custom_ops.attention.gluon_common import _rows_desc, hopper_kernels_accept, uses_hopper_kernels
from custom_ops.attention.gluon_forward import _attn_fwd_hopper_kernel, hopper_fwd
from custom_ops.attention.op import (
    attention_flops, check_attention_args, check_bwd_args, flash_attention, flash_attention_bwd,
    flash_attention_fwd)
