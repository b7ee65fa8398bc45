"""Activation offload: saved activations kept in pinned host memory between forward and backward.

On one GPU the full step cannot keep every matmul output its backward needs,
so the partitioner's plan recomputes some (the FFN input projections of the
full preset). ``compile_stack/memory_plan/offload.py`` chooses a plan that saves them and
moves the extra ones to host memory, which these ops do: ``offload_to_host``
in the forward (a copy on a side stream, nothing waits for it) and
``reload_to_device`` in the backward (started ahead for the next blocks).
See op.py, transfers.py (streams, ordering, prefetch) and host_buffers.py
(exact-size pinned buffers).
"""
from custom_ops.activation_offload.op import TRANSFERS, offload_to_host, release_host_memory, reload_to_device

__all__ = ["TRANSFERS", "offload_to_host", "release_host_memory", "reload_to_device"]
