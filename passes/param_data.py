"""Capture pass: let a hand-written optimizer that updates ``p.data`` compile.

``p.data -= u`` reaches Dynamo's graph as ``d = _get_data_attr(p); d -= u;
p.set_(d)``. AOTAutograd cannot functionalize the ``set_`` ("cannot mutate
tensors with frozen storage", REFERENCE.md §4). Under ``no_grad`` that
sequence is an in-place update of ``p`` itself, so this pass rewrites it to
one: uses of ``_get_data_attr(p)`` become ``p`` and the ``set_`` of ``p`` to
its own in-place result (plus Dynamo's version-counter fix-up on it) is
dropped. A ``set_`` to any other tensor is a real storage swap and stays.
"""
import operator

import torch

from passes.registry import note, register_pass

_GET_DATA = torch._C._autograd._get_data_attr
# In-place operators Dynamo emits for `p.data op= x`; each returns its first argument.
_INPLACE_OPERATORS = {operator.isub, operator.iadd, operator.imul, operator.itruediv}
_INPLACE_METHODS = {"sub_", "add_", "mul_", "div_", "addcdiv_", "addcmul_", "copy_", "lerp_"}


def _updates_in_place(node: torch.fx.Node, target: torch.fx.Node) -> bool:
    """Whether ``node`` is an in-place update of ``target`` that returns it."""
    if not node.args or node.args[0] is not target:
        return False
    if node.op == "call_function":
        return node.target in _INPLACE_OPERATORS
    return node.op == "call_method" and node.target in _INPLACE_METHODS


@register_pass("param_data", stage="pre_grad")
def rewrite_param_data_updates(graph: torch.fx.Graph) -> int:
    """Rewrite `p.data <op>= x` (get-data, in-place op, set_) into an in-place update of p."""
    replaced = 0
    grad_enabled = torch.is_grad_enabled()
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            grad_enabled = bool(node.args[0])
        elif node.op == "call_function" and node.target is _GET_DATA:
            if grad_enabled:
                note("param_data", f"left {node} alone: `.data` read while grad is enabled")
                continue
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif _is_set(node):
            param, source = node.args[0], node.args[1]
            if grad_enabled or not (isinstance(source, torch.fx.Node) and _updates_in_place(source, param)):
                note("param_data", f"left {node} alone: not a `.data` in-place update under no_grad")
                continue
            for user in list(node.users):
                if "version_count" in getattr(user.target, "__name__", ""):
                    graph.erase_node(user)
            node.replace_all_uses_with(param)
            graph.erase_node(node)
            replaced += 1
    return replaced


def _is_set(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target == "set_"
    return node.op == "call_function" and node.target is torch.Tensor.set_
