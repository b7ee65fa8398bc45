"""Capture pass: let a hand-written optimizer that updates ``p.data`` compile.

``p.data -= u`` reaches Dynamo's graph as ``d = _get_data_attr(p); d -= u;
p.set_(d)`` (Dynamo puts the ``set_`` under ``no_grad`` itself). AOTAutograd
cannot functionalize the ``set_`` ("cannot mutate tensors with frozen
storage", docs/reference.md §4). ``d`` shares ``p``'s storage, sizes and strides,
so the in-place op has already written the new values into ``p``'s storage
and the ``set_`` points ``p`` at that same storage: a no-op on the data.
This pass rewrites the sequence into a plain in-place update of ``p``'s
storage: uses of ``_get_data_attr(p)`` become ``p`` (under ``no_grad``) or
``p.detach()`` (with grad enabled: like ``.data``, an alias of ``p``'s
storage that autograd does not track, so reads stay invisible to autograd as
in eager; the in-place update itself is put under ``no_grad``, which tells
AOTAutograd the parameter's mutation is hidden from autograd), and the
``set_`` of ``p`` to its own in-place result (plus Dynamo's version-counter
fix-up on it) is dropped.

``p.data = t`` with a new tensor ``t`` (not an in-place result of ``p``) is
a ``set_`` to other storage; it becomes ``p.detach().copy_(t)`` when that
gives ``p`` the same values and nothing in the graph can tell the two apart:
``t`` is computed in the graph (not an input, nor a view of one) with
``p``'s shape, dtype, device and strides, and nothing uses ``t`` after the
``set_``. The one difference is outside the graph: a view of ``p``'s old
storage held elsewhere sees the new values rather than keeping the old
(a parameter that is itself a view of a flat buffer, say). Any other
``set_`` stays, with a note.
"""
import operator

import torch

from passes.registry import note, register_pass
from torch_internals import fx

_GET_DATA = fx.get_data_attr
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
    """Rewrite `p.data <op>= x` (get-data, in-place op, set_) into an in-place update of p's storage,
    and `p.data = t` into a copy into it where that is equivalent."""
    replaced = 0
    grad_enabled = torch.is_grad_enabled()
    aliases: dict[torch.fx.Node, torch.fx.Node] = {}  # alias of p's storage made here -> p
    grad_at: dict[torch.fx.Node, bool] = {}  # grad mode each node runs in
    for node in list(graph.nodes):
        grad_at[node] = grad_enabled
        if node.op == "call_function" and node.target is fx.set_grad_enabled:
            grad_enabled = bool(node.args[0])
        elif node.op == "call_function" and node.target is _GET_DATA:
            source = node.args[0]
            if grad_enabled:
                with graph.inserting_before(node):
                    alias = graph.call_method("detach", (source,))
                alias.meta.update(node.meta)
                aliases[alias] = source
            else:
                alias = source
            node.replace_all_uses_with(alias)
            graph.erase_node(node)
        elif _is_set(node):
            param, source = node.args[0], node.args[1]
            if not isinstance(source, torch.fx.Node):
                note("param_data", f"left {node} alone: not a `.data` update")
                continue
            if _updates_in_place(source, param) or aliases.get(source.args[0] if source.args else None) is param \
                    and _updates_in_place(source, source.args[0]):
                if grad_at.get(source, False):
                    _without_grad(graph, source)
            elif _copy_equivalent(graph, node, param, source):
                with graph.inserting_before(node):
                    alias = graph.call_method("detach", (param,))
                    copy = graph.call_method("copy_", (alias, source))
                # Traced values, as Dynamo gives its nodes: AOTAutograd's cache accepts a method call
                # only on a node known to be a tensor.
                if "example_value" in param.meta:
                    alias.meta["example_value"] = param.meta["example_value"]
                copy.meta.update(source.meta)
                if grad_at.get(node, False):
                    _without_grad(graph, copy)
            else:
                note("param_data", f"left {node} alone: not a `.data` in-place update, nor a new tensor "
                                   "`p.data = t` could copy into p's storage")
                continue
            for user in list(node.users):
                if "version_count" in getattr(user.target, "__name__", ""):
                    graph.erase_node(user)
            node.replace_all_uses_with(param)
            graph.erase_node(node)
            replaced += 1
    return replaced


def _without_grad(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Run ``node`` (an in-place update of a parameter's storage) under ``no_grad``, as ``.data``'s
    update is in eager: AOTAutograd then knows the mutation is hidden from autograd and the graph
    stays an inference graph."""
    with graph.inserting_before(node):
        graph.call_function(fx.set_grad_enabled, (False,))
    with graph.inserting_after(node):
        graph.call_function(fx.set_grad_enabled, (True,))


def _copy_equivalent(graph: torch.fx.Graph, set_node: torch.fx.Node, param: torch.fx.Node,
                     source: torch.fx.Node) -> bool:
    """Whether ``param.set_(source)`` may become a copy of ``source`` into ``param``'s storage: ``source``
    is a tensor the graph computes (not an input or a view of something), shaped, strided and typed as
    ``param``, and unused after the ``set_`` (but for Dynamo's version-counter fix-up)."""
    p, t = param.meta.get("example_value"), source.meta.get("example_value")
    if not (isinstance(p, torch.Tensor) and isinstance(t, torch.Tensor)):
        return False
    if source.op not in ("call_function", "call_method") or (p.shape, p.stride(), p.dtype, p.device) != \
            (t.shape, t.stride(), t.dtype, t.device):
        return False
    if t._base is not None:
        return False  # a view (of p, or of something else the graph may read)
    order = {n: i for i, n in enumerate(graph.nodes)}
    later = [u for u in source.users if u is not set_node and order[u] > order[set_node]]
    return not later

def _is_set(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target == "set_"
    return node.op == "call_function" and node.target is torch.Tensor.set_
