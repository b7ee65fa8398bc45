"""The replacement: our flash-attention forward and backward calls in place of a matched
written-out attention or SDPA call (grouped k/v heads repeated for the op, their grads summed back)."""
import operator

import torch

import custom_ops.attention  # noqa: F401  (registers torch.ops.cstack.flash_attention_*)
from passes.attention.common import _shape, aten, prims
from passes.graph_edit import erase_dead, fake_value, insert_call, save_for_backward


def _replace(graph, old, new) -> None:
    """Make `old`'s users use `new`, copied to `old`'s strides if they differ: later views rely on them."""
    want, have = old.meta["val"], new.meta["val"]
    significant = [d for d in range(want.dim()) if want.shape[d] != 1]
    if any(want.stride(d) != have.stride(d) for d in significant):
        order = sorted(range(want.dim()), key=lambda d: (-want.stride(d), d))
        with graph.inserting_before(old):
            moved = insert_call(graph, aten.permute.default, (new, order))
            dense = insert_call(graph, aten.clone.default, (moved,), {"memory_format": torch.contiguous_format})
            new = insert_call(graph, aten.permute.default, (dense, [order.index(d) for d in range(want.dim())]))
    old.replace_all_uses_with(new)


def _dense(graph, node):
    """``node``, copied to a contiguous tensor in the graph if it is a strided view: v and the
    output grad are [S, H·D] matmul outputs seen head-major when a rank holds one sequence, and
    the Hopper kernels read dense [S, D] rows. Left to the op, the copy was aten's strided copy
    (2.4× slower than Inductor's on the H200, BENCHMARKS.md), in the forward and again in the
    backward; here Inductor generates it, and the partitioner saves or recomputes it as it does
    the rest (at the two-GPU budget the forward's copy of v is saved)."""
    val = fake_value(node)
    if val is None or val.is_contiguous():
        return node
    return insert_call(graph, aten.clone.default, (node,), {"memory_format": torch.contiguous_format})


def _flash(graph, q, k, v, causal, scale, grad, where_fwd, where_bwd):
    """Insert our forward (and backward when `grad` is given); returns out, (dq, dk, dv) nodes."""
    with graph.inserting_before(where_fwd):
        q, k, v = (_dense(graph, t) for t in (q, k, v))
        fwd = insert_call(graph, torch.ops.cstack.flash_attention_fwd.default, (q, k, v, causal, scale))
        out, lse = (insert_call(graph, operator.getitem, (fwd, i)) for i in (0, 1))
    save_for_backward(fwd, out, lse)
    if grad is None:
        return out, None
    with graph.inserting_before(where_bwd):
        grad = _dense(graph, grad)
        bwd = insert_call(graph, torch.ops.cstack.flash_attention_bwd.default, (grad, q, k, v, out, lse, causal, scale))
        return out, tuple(insert_call(graph, operator.getitem, (bwd, i)) for i in range(3))


def _rewrite(graph, plan, order):
    kt = plan["kt"]
    with graph.inserting_before(plan["pv"]):
        k = insert_call(graph, aten.permute.default, (kt, [0, 2, 1]))
    q, learned, dlearned = plan["q"], plan["learned"], plan["dlearned"]
    if learned is not None:  # q' = q·s (or q / s): the op sees the scaled q
        with graph.inserting_before(plan["pv"]):
            s0 = insert_call(graph, aten.view.default, (learned[0], []))
            s0 = insert_call(graph, prims.convert_element_type.default, (s0, fake_value(q).dtype))
            q = insert_call(graph, aten.div.Tensor if learned[1] else aten.mul.Tensor, (plan["q"], s0))
    exits = [e for e in (plan["dq"], plan["dk"], plan["dv"], dlearned) if e is not None]
    first = min(exits, key=order.__getitem__) if exits else None
    out, grads = _flash(graph, q, k, plan["v"], plan["causal"], plan["scale"],
                        plan["grad"] if exits else None, plan["pv"], first)
    _replace(graph, plan["pv"], out)
    if grads is not None:
        dq, dk, dv = grads
        if learned is not None:
            with graph.inserting_before(first):
                if dlearned is not None:  # d(q·s)/ds = q; d(q/s)/ds = -q'/s
                    ds = insert_call(graph, aten.mul.Tensor, (dq, q if learned[1] else plan["q"]))
                    ds = insert_call(graph, aten.sum.default, (ds,), {"dtype": fake_value(dlearned).dtype})
                    if learned[1]:
                        ds = insert_call(graph, aten.div.Tensor, (insert_call(graph, aten.neg.default, (ds,)), s0))
                    ds = insert_call(graph, aten.view.default, (ds, list(_shape(dlearned))))
                    _replace(graph, dlearned, insert_call(
                        graph, prims.convert_element_type.default, (ds, fake_value(dlearned).dtype)))
                dq = insert_call(graph, aten.div.Tensor if learned[1] else aten.mul.Tensor, (dq, s0))
        if plan["dq"] is not None:
            _replace(graph, plan["dq"], dq)
        if plan["dk"] is not None:
            with graph.inserting_before(plan["dk"]):
                _replace(graph, plan["dk"], insert_call(graph, aten.permute.default, (dk, [0, 2, 1])))
        if plan["dv"] is not None:
            _replace(graph, plan["dv"], dv)
    return erase_dead(graph, [plan["pv"], *exits])


def _repeat_heads(graph, t, heads):
    """[B, Hkv, S, D] -> [B, heads, S, D], each k/v head repeated for its group of query heads
    (``enable_gqa``): the op takes one k/v head per query head."""
    b, hkv, s, d = _shape(t)
    t = insert_call(graph, aten.unsqueeze.default, (t, 2))
    t = insert_call(graph, aten.expand.default, (t, [b, hkv, heads // hkv, s, d]))
    t = insert_call(graph, aten.clone.default, (t,), {"memory_format": torch.contiguous_format})
    return insert_call(graph, aten.view.default, (t, [b, heads, s, d]))


def _sum_heads(graph, g, like):
    """The grad of a repeated k/v head: the sum over its group."""
    b, hkv, s, d = _shape(like)
    g = insert_call(graph, aten.view.default, (g, [b, hkv, _shape(g)[1] // hkv, s, d]))
    return insert_call(graph, aten.sum.dim_IntList, (g, [2]))


def _sdpa_rewrite(graph, node, plan):
    bwd = plan["bwd"]
    heads = _shape(plan["q"])[1]
    k, v = plan["k"], plan["v"]
    if _shape(k)[1] != heads:
        with graph.inserting_before(node):
            k, v = _repeat_heads(graph, k, heads), _repeat_heads(graph, v, heads)
    out, grads = _flash(graph, plan["q"], k, v, plan["causal"], plan["scale"],
                        bwd.args[0] if bwd is not None else None, node, bwd)
    if plan["out"] is not None:
        _replace(graph, plan["out"], out)
    if grads is not None and k is not plan["k"]:
        with graph.inserting_before(bwd):  # after the new backward
            grads = (grads[0], _sum_heads(graph, grads[1], plan["k"]), _sum_heads(graph, grads[2], plan["v"]))
    for i, g in plan["grads"].items():
        if i < 3:
            _replace(graph, g, grads[i])
    return erase_dead(graph, [*plan["grads"].values(), plan["out"] or node, node])
