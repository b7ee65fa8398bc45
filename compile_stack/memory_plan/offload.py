"""Saved activations moved to host memory: which ones can, and the edit of the partitioned graphs.

On one GPU the budget search (partitioner.py) can find that the plan saving every
matmul output the backward needs does not fit, and settle on one that
recomputes some (the full preset's block recomputes its V, O and FFN input
projections: ~0.75 s of matmul a step). With offload on, partitioner.py compares
plans of larger budgets, each with enough of its saved values moved to host
memory for the rest to fit the GPU, and keeps the one recomputing the fewest
matmul FLOPs. A moved value is copied out in the forward once its last
reader there is done, and copied back in the backward before its first use,
the next ones' copies started ahead (custom_ops/activation_offload).

A saved value stays on the GPU (counted as such) if it is small, overlapping
or with gaps (not dense), a view, a graph input, one of the forward's own
outputs, or viewed by anything the forward returns. A dense value laid out in
another dimension order (attention's output in v's layout) travels as its
memory seen contiguous, and is permuted back after the reload.
"""
import torch
import torch.fx as fx

import custom_ops.activation_offload  # noqa: F401 (registers the ops)
from compile_stack.memory_plan.sizes import size_hint, tensor_bytes
from passes.graph_edit import inverse_permutation, memory_order
from torch_internals.fx import OpOverload

# Smaller values are left on the GPU: a copy's fixed costs would outweigh what they free.
MIN_BYTES = 16 * 2**20
OFFLOAD = torch.ops.cstack.offload_to_host.default
RELOAD = torch.ops.cstack.reload_to_device.default


def saved_inputs(backward: fx.GraphModule) -> list[fx.Node]:
    """A partition's backward inputs that its forward saved (all but the incoming gradients)."""
    return [n for n in backward.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]


def saved_names(backward: fx.GraphModule) -> set[str]:
    """Names of the values a partition's forward saves for its backward."""
    return {n.name for n in saved_inputs(backward)}


def _is_dense(val: torch.Tensor) -> bool:
    """Whether ``val`` fills its memory without overlaps or gaps, in some order of its dims."""
    return val.permute(memory_order(val)).is_contiguous()


def _is_view(node: fx.Node) -> bool:
    return isinstance(node.target, OpOverload) and node.target.is_view


def _readers(node: fx.Node, viewed: bool = False) -> list[fx.Node] | None:
    """The nodes that read ``node``'s memory (through views too); None if the graph's output
    takes a view of it (``viewed``: ``node`` is one)."""
    readers = []
    for user in node.users:
        if user.op == "output":
            if viewed:
                return None
        elif user.target is OFFLOAD and user.args[0] is not node:
            continue  # another value's copy, ordered after this one: it never reads it
        elif _is_view(user):
            if (through := _readers(user, viewed=True)) is None:
                return None
            readers += through
        else:
            readers.append(user)
    return readers


def _tensor_results(node: fx.Node) -> list[fx.Node] | None:
    """Nodes holding ``node``'s tensor results (itself, or the items taken of a tuple); None if it
    has none."""
    if isinstance(node.meta.get("val"), torch.Tensor):
        return [node]
    items = [u for u in node.users if isinstance(u.meta.get("val"), torch.Tensor)]
    return items or None


def _own_kernel(node: fx.Node) -> bool:
    """Whether Inductor runs ``node`` as a kernel of its own (a library matmul or a custom op),
    so its result is in memory anyway: never fused away, free to wait for."""
    target = node.target
    return (isinstance(target, OpOverload) and target is not OFFLOAD
            and (target in MATMULS or target.namespace not in ("aten", "prims")))


MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default}


def _order_after(node: fx.Node) -> list[fx.Node] | None:
    """Tensors whose existence implies every reader of ``node`` ran: the first kernel of its own
    that depends on all of them, or else the readers' own results (which Inductor then has to
    keep in memory); None if that cannot be said."""
    readers = _readers(node)
    if readers is None:
        return None
    if not readers:  # saved only (a gradient an op made in the forward): free to go at once
        return []
    wanted = set(readers)
    reached: dict[fx.Node, frozenset] = {}  # node -> the readers it depends on
    for later in node.graph.nodes:
        got = frozenset({later} & wanted).union(*(reached.get(i, ()) for i in later.all_input_nodes))
        if got:
            reached[later] = got
        if len(got) == len(readers) and _own_kernel(later) and (results := _tensor_results(later)):
            return results[:1]
    after = []
    for reader in readers:
        if (results := _tensor_results(reader)) is None:
            return None
        after += results
    return after


def movable_values(forward: fx.GraphModule, backward: fx.GraphModule, user_outputs: int,
                   device: torch.device) -> list[fx.Node]:
    """The values on ``device`` this partition saves that can move to host memory (module
    docstring)."""
    outputs = forward.graph.find_nodes(op="output")[0].args[0]
    returned = set(outputs[:user_outputs])
    saved = saved_names(backward)
    movable = []
    for node in outputs[user_outputs:]:
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if (node.name in saved and node not in returned and node.op == "call_function" and not _is_view(node)
                and isinstance(val, torch.Tensor) and val.device == device and _is_dense(val)
                and tensor_bytes(val) >= MIN_BYTES and _order_after(node) is not None):
            movable.append(node)
    return list(dict.fromkeys(movable))


def value_bytes(nodes: list[fx.Node]) -> int:
    return sum(tensor_bytes(n.meta["val"]) for n in nodes)


def matmul_flops(graph: fx.GraphModule) -> int:
    """FLOPs of a graph's matmuls (by their example sizes): what a plan's backward recomputes
    shows here, the backward's own matmuls being the same in every plan."""
    flops = 0
    for node in graph.graph.nodes:
        if node.target in MATMULS:
            out = node.meta["val"]
            flops += 2 * size_hint(out.numel()) * size_hint(node.args[-1].meta["val"].shape[-2])
    return flops


def apply(forward: fx.GraphModule, backward: fx.GraphModule, nodes: list[fx.Node]) -> None:
    """Edit a partition so that ``nodes`` (forward values it saves) travel through host memory;
    each offload lets one call's worth of them stay on the GPU while their copies run, each reload
    keeps one call's worth copying ahead. No nodes: no edit."""
    if not nodes:
        return
    ahead = value_bytes(nodes)
    graph = forward.graph
    output = graph.find_nodes(op="output")[0]
    position = {n: i for i, n in enumerate(graph.nodes)}
    moved: dict[str, torch.Tensor] = {}
    replacement = {}
    for node in nodes:
        after = _order_after(node)
        val = node.meta["val"]
        order = memory_order(val)
        source, memory = node, val.permute(order)  # memory: val seen contiguous (val itself if it is)
        anchor = max([node, *after], key=position.__getitem__)  # a sibling item may come first
        if order != sorted(order):
            with graph.inserting_after(anchor):
                source = anchor = graph.call_function(torch.ops.aten.permute.default, (node, order))
            source.meta["val"] = memory
        with graph.inserting_after(anchor):
            host = graph.call_function(OFFLOAD, (source, after, ahead))
        with val.fake_mode:
            host.meta["val"] = OFFLOAD(memory, [a.meta["val"] for a in after], ahead)
        replacement[node] = host
        moved[node.name] = val, memory, order
    output.args = (tuple(replacement.get(n, n) for n in output.args[0]),) + output.args[1:]
    forward.recompile()

    graph = backward.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    for placeholder in graph.find_nodes(op="placeholder"):
        if placeholder.name not in moved or not placeholder.users:
            continue
        val, memory, order = moved[placeholder.name]
        first = min(placeholder.users, key=position.__getitem__)
        with val.fake_mode:
            placeholder.meta["val"] = torch.empty(memory.shape, dtype=val.dtype, device="cpu")
        with graph.inserting_before(first):
            gpu = graph.call_function(RELOAD, (placeholder, val.device, ahead))
            gpu.meta["val"] = memory
            back = gpu
            if order != sorted(order):
                back = graph.call_function(torch.ops.aten.permute.default, (gpu, inverse_permutation(order)))
                back.meta["val"] = val
        placeholder.replace_all_uses_with(back, delete_user_cb=lambda user: user is not gpu)
    backward.recompile()
