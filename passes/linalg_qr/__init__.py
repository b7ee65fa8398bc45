"""Joint pass: a user's ``torch.linalg.qr``/``torch.geqrf`` becomes our batched QR where it is faster.

Optimizers such as SOAP and Shampoo refresh eigenbases with QR of batches of
fp32 matrices (``Q, _ = torch.linalg.qr(P @ Q)``); torch runs one cuSOLVER call
a matrix. Every spelling (``torch.linalg.qr(M)``, ``mode="reduced"``,
``M.qr()``, ``torch.geqrf(M)``) reaches the joint stage as one aten node,
``aten.linalg_qr.default(A, mode)`` or ``aten.geqrf.default(A)``, whose outputs
the graph reads through ``getitem`` (neither op has a decomposition in torch's
or Inductor's tables). This pass swaps it for ``cstack::batched_qr`` /
``cstack::batched_geqrf`` (same outputs, LAPACK's signs) when A is a CUDA
float32 tensor of static shape and ``prefer_ours(shape, device, op)`` — the
ops' measured table — says ours is faster for that shape on that device.
``mode="r"`` (R only, Q an empty tensor) becomes ``batched_geqrf`` and
``triu`` of its first min(m, n) rows, as torch computes it, when our geqrf is
the faster.

Why the joint stage: the graph there is aten level, one node per QR, and
already holds the backward. Where Q or R needs a gradient, that backward is
torch's QR derivative traced into aten ops that read the forward's Q and R:
the swap gives them the same values, so it stays right with no autograd of
ours involved (pre-grad, the op's own registered autograd would be used).

Left alone: a CPU tensor (torch's LAPACK call; the table says ours is never
faster there), and, with a note, a CUDA QR of another dtype (float64, half:
ours is float32), in mode "complete" (ours is reduced only), of a dynamic
shape (the table is per shape), or of a shape the table says torch is faster
for.
"""
import operator

import torch
from torch.fx import Graph, Node

from custom_ops import batched_qr
from passes.graph_edit import erase_dead, fake_value, insert_call
from passes.registry import note, register_pass
from passes.rejection import NoMatch

NAME = "linalg_qr"
aten = torch.ops.aten
# Where our ops can be faster than torch's: prefer_ours is False on any other device type.
DEVICES = ("cuda",)


def _mode(node: Node) -> str:
    """The node's QR mode: ``reduced``, ``complete`` or ``r``; ``geqrf`` for a geqrf."""
    if node.target is aten.geqrf.default:
        return "geqrf"
    return node.kwargs.get("mode", node.args[1] if len(node.args) > 1 else "reduced")


def _op(node: Node) -> str | None:
    """Which of our ops replaces ``node`` (``qr``, ``geqrf``); None for a CPU QR; NoMatch, saying why,
    for a CUDA one that stays."""
    a, mode = fake_value(node.args[0]), _mode(node)
    if not isinstance(a, torch.Tensor) or a.device.type not in DEVICES:
        return None
    if mode == "complete":
        raise NoMatch("mode 'complete' (ours is reduced)")
    if a.dtype != torch.float32:
        raise NoMatch(f"{a.dtype} (ours is float32)")
    if not all(isinstance(s, int) for s in a.shape):
        raise NoMatch(f"dynamic shape {tuple(a.shape)}")
    op = "qr" if mode == "reduced" else "geqrf"
    if not batched_qr.prefer_ours(tuple(a.shape), a.device, op):
        raise NoMatch(f"torch's {op} is faster for shape {tuple(a.shape)} on {a.device} (measured)")
    if mode == "r" and any(u.target is not operator.getitem for u in node.users):
        raise NoMatch("its result is read other than by index")
    return op


def _r_mode(graph: Graph, node: Node, a: Node) -> None:
    """Replace mode "r": R = triu of geqrf's first min(m, n) rows, Q the empty tensor torch returns."""
    m, n = fake_value(a).shape[-2:]
    factored = insert_call(graph, torch.ops.cstack.batched_geqrf.default, (a,))
    packed = insert_call(graph, operator.getitem, (factored, 0))
    r = insert_call(graph, aten.triu.default, (insert_call(graph, aten.slice.Tensor, (packed, -2, 0, min(m, n))),))
    for user in list(node.users):
        if user.args[1] == 1:
            user.replace_all_uses_with(r)
        else:
            user.replace_all_uses_with(insert_call(graph, aten.new_empty.default, (a, list(fake_value(user).shape))))
        graph.erase_node(user)


@register_pass(NAME, stage="joint")
def use_batched_qr(graph: Graph) -> int:
    """Swap CUDA fp32 QRs and geqrfs of static shape for our batched ops where the table prefers them."""
    replaced = 0
    for node in graph.find_nodes(op="call_function", target=aten.linalg_qr.default) \
            + graph.find_nodes(op="call_function", target=aten.geqrf.default):
        try:
            op = _op(node)
        except NoMatch as why:
            note(NAME, f"left {node.name} alone: {why}")
            continue
        if op is None:
            continue
        a = node.args[0]
        with graph.inserting_before(node):
            if _mode(node) == "r":
                _r_mode(graph, node, a)
            else:
                target = torch.ops.cstack.batched_qr if op == "qr" else torch.ops.cstack.batched_geqrf
                node.replace_all_uses_with(insert_call(graph, target.default, (a,)))
        erase_dead(graph, [node])
        replaced += 1
    return replaced
