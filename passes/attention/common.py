"""What every part of the attention pass reads: its name, the op namespaces, node shapes."""
import torch

from passes.graph_edit import fake_value

aten, prims = torch.ops.aten, torch.ops.prims
NAME = "attention"


def _shape(node):
    val = fake_value(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None
