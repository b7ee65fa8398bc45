"""What every part of the attention pass reads: its name, the casts it looks through, node shapes."""
import torch

from passes.graph_edit import fake_value

aten, prims = torch.ops.aten, torch.ops.prims
NAME = "attention"
CONVERT_OPS = {prims.convert_element_type.default, aten._to_copy.default}


def _shape(node):
    val = fake_value(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None
