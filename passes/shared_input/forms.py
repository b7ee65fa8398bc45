"""The spellings of a matmul by a weight in a torch-level graph, read as one form.

``F.linear(x, W)``, ``x @ W.T``, ``torch.matmul(x, W.t())``, ``x.mm(W.transpose(0, 1))``,
``x @ W.permute(1, 0)`` are all ``x Wᵀ`` with ``W`` stored ``[out, in]``; ``x @ W`` is the same
product with ``W`` stored ``[in, out]``. ``W`` is a graph input (a parameter or buffer): the
concatenation of such inputs is a copy, never a recomputation of work.
"""
import builtins
import dataclasses
import operator

import torch
import torch.nn.functional as F

_LINEAR = {torch._C._nn.linear, F.linear}
_MATMUL_FUNCTIONS = {operator.matmul, torch.matmul, torch.mm}
_MATMUL_METHODS = {"matmul", "mm", "__matmul__"}


@dataclasses.dataclass(frozen=True)
class WeightProduct:
    """``node`` computes ``x @ weight.T + bias`` (``transposed``) or ``x @ weight``."""

    node: torch.fx.Node
    x: torch.fx.Node
    weight: torch.fx.Node
    transposed: bool
    bias: torch.fx.Node | None

    @property
    def in_features(self) -> int:
        return example(self.weight).shape[1 if self.transposed else 0]

    @property
    def out_features(self) -> int:
        return example(self.weight).shape[0 if self.transposed else 1]


def example(node):
    """The value Dynamo traced for ``node`` (a fake tensor), or None."""
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def weight_product(node: torch.fx.Node) -> WeightProduct | None:
    """``node`` read as a product of an activation by a 2-D graph-input weight, or None."""
    if node.op == "call_function" and node.target in _LINEAR:
        x, weight = _arg(node, 0, "input"), _arg(node, 1, "weight")
        bias = _arg(node, 2, "bias")
        if _is_weight(weight) and (bias is None or _is_weight(bias, ndim=1)):
            return _checked(WeightProduct(node, x, weight, True, bias))
        return None
    is_matmul = (node.op == "call_function" and node.target in _MATMUL_FUNCTIONS) or (
        node.op == "call_method" and node.target in _MATMUL_METHODS)
    if not is_matmul or len(node.args) != 2 or node.kwargs:
        return None
    x, right = node.args
    base = _transposed_weight(right)
    if base is not None:
        return _checked(WeightProduct(node, x, base, True, None))
    if _is_weight(right):
        return _checked(WeightProduct(node, x, right, False, None))
    return None


def _arg(node, index, name):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _is_weight(node, ndim: int = 2) -> bool:
    value = example(node)
    return node.op in ("placeholder", "get_attr") and isinstance(value, torch.Tensor) and value.ndim == ndim


def _checked(product: WeightProduct) -> WeightProduct | None:
    """The product if its activation is a tensor of at least 2 dims whose last is the weight's input."""
    x = example(product.x)
    if not isinstance(x, torch.Tensor) or x.ndim < 2 or not isinstance(product.x, torch.fx.Node):
        return None
    if product.node.target is torch.mm and x.ndim != 2:
        return None
    return product if x.shape[-1] == product.in_features else None


def _transposed_weight(node) -> torch.fx.Node | None:
    """``W`` when ``node`` is ``W.T``, ``W.mT``, ``W.t()``, ``W.transpose(0, 1)`` or ``W.permute(1, 0)`` of a
    2-D weight ``W``; None otherwise."""
    if not isinstance(node, torch.fx.Node) or not node.args:
        return None
    base = node.args[0]
    if not isinstance(base, torch.fx.Node) or not _is_weight(base):
        return None
    rest = node.args[1:]
    if node.op == "call_function" and node.target is builtins.getattr:
        swaps = rest in (("T",), ("mT",))
    elif node.target in ("t", torch.t):
        swaps = not rest
    elif node.target in ("transpose", torch.transpose):
        swaps = len(rest) == 2 and all(isinstance(d, int) for d in rest) and rest[0] % 2 != rest[1] % 2
    elif node.target in ("permute", torch.permute):
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
        swaps = tuple(dims) in ((1, 0), (-1, -2), (1, -2), (-1, 0))
    else:
        return None
    return base if swaps and not node.kwargs else None
