"""FX graph editing the passes share: the cast and reshape ops they look through,
reading a node's fake value, a tensor's memory order, inserting a call with the
fake value later stages read, marking what the partitioner must save, finding
what a set of nodes reaches, erasing what a rewrite left dead, and copying a
graph module to edit or partition while the original stays."""
from collections.abc import Callable, Iterable

import torch
from torch.fx.node import map_arg
from torch.utils.checkpoint import CheckpointPolicy
from torch_internals import fx

aten, prims = torch.ops.aten, torch.ops.prims
# A cast to another dtype, as Inductor's decompositions leave it.
CAST_OPS = {prims.convert_element_type.default, aten._to_copy.default}
# A new shape for the same elements in the same row-major order.
RESHAPE_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def fake_value(node, index: int | None = None):
    """The value tracing recorded for ``node`` (a fake tensor, a SymInt, a tuple of them...),
    element ``index`` of a tuple-valued node; None for constants and untraced nodes."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val[index] if index is not None and isinstance(val, (list, tuple)) else val


def memory_order(val: torch.Tensor) -> list[int]:
    """``val``'s dims by stride, largest first: the permute that makes a dense tensor contiguous."""
    return sorted(range(val.dim()), key=lambda d: (-val.stride(d), d))


def inverse_permutation(order: list[int]) -> list[int]:
    """The permute that undoes permuting by ``order``."""
    return [order.index(d) for d in range(len(order))]


def insert_call(graph: torch.fx.Graph, target, args, kwargs=None, fake_mode=None) -> torch.fx.Node:
    """A call node at the graph's insert point, with ``meta['val']`` computed from its arguments'
    fake values (the partitioner and Inductor read it), under ``fake_mode`` or the arguments' own.
    Without a fake mode, as in a graph traced without fake values, the node gets no value.

    The fake arguments are also kept as ``meta['eager_input_vals']``: Inductor holds a custom
    op's inputs to exactly those strides only when they are there, and leaves the layout of an op
    a pass inserted without them to its own choice (a strided view where the graph copied the
    input dense)."""
    node = graph.call_function(target, tuple(args), kwargs or {})
    fake_args, fake_kwargs = map_arg((node.args, node.kwargs), fake_value)
    fake_mode = fake_mode or fx.detect_fake_mode((fake_args, fake_kwargs))
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        node.meta["eager_input_vals"] = (fake_args, fake_kwargs)
    return node


def reachable(starts: Iterable[torch.fx.Node], neighbours: Callable[[torch.fx.Node], Iterable[torch.fx.Node]],
              stop=frozenset()) -> set[torch.fx.Node]:
    """``starts`` and every node reached from them through ``neighbours``, not going past ``stop`` nodes."""
    seen, work = set(), list(starts)
    while work:
        node = work.pop()
        if node in seen:
            continue
        seen.add(node)
        if node not in stop:
            work.extend(neighbours(node))
    return seen


def save_for_backward(*nodes: torch.fx.Node) -> None:
    """Make AOTAutograd's partitioner save these joint-graph values, never recompute them.

    Our ops' outputs (attention's output and log-sum-exp, the fused
    cross-entropy's gradients) cost a whole kernel to recompute and little
    memory to keep; under an activation memory budget the partitioner would
    otherwise trade them away first. Mark the op and its outputs.
    """
    for node in nodes:
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def erase_dead(graph: torch.fx.Graph, roots: Iterable[torch.fx.Node]) -> set[torch.fx.Node]:
    """Erase the nodes among ``roots`` and their inputs that nothing uses any more; returns them."""
    work, erased = list(roots), set()
    while work:
        n = work.pop()
        if n in erased or n.op != "call_function" or n.users or n.is_impure():
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        erased.add(n)
        work.extend(inputs)
    return erased


def copy_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` with its own nodes (their ``meta`` dicts copied, the values in them
    shared), sharing ``gm``'s submodules and attributes."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)
