"""The replacement: our flash-attention forward and backward calls in place of a matched
written-out attention or SDPA call (grouped k/v heads repeated for the op, their grads summed back)."""
import operator

import torch

import custom_ops.attention  # noqa: F401  (registers torch.ops.cstack.flash_attention_*)
from custom_ops.attention.layouts import is_sequence_major
from passes.attention.common import _shape, aten, prims
from passes.graph_edit import (
    RESHAPE_OPS, erase_dead, fake_value, insert_call, inverse_permutation, memory_order, save_for_backward)


def _is_dense_copy(node) -> bool:
    return node.target is aten.clone.default and node.kwargs.get("memory_format", torch.contiguous_format) in (
        torch.contiguous_format, torch.preserve_format)


def _merge_as_view(graph, user, new) -> list:
    """Where ``user`` (of the value ``new`` replaces) merges heads (a view to [B, H, S, D] unless old is one already, a
    permute, a dense copy: ``out.transpose(1, 2).reshape(B, S, H·D)``, or dv's way back into its
    projection) and, on ``new`` (our op's output in v's layout), the permute alone is already
    dense: the copies' users take that permute instead. Returns the copies bypassed (none if the
    pattern or the layouts do not fit)."""
    shape = list(_shape(user)) if user.target in RESHAPE_OPS else list(_shape(new))
    permutes = list(user.users) if user.target in RESHAPE_OPS else [user]
    if not permutes or not all(p.target is aten.permute.default and p.users and all(map(_is_dense_copy, p.users))
                               for p in permutes):
        return []
    try:
        seen = fake_value(new).view(shape)
    except RuntimeError:  # new's layout cannot be seen in that shape
        return []
    if not all(seen.permute(p.args[1]).is_contiguous() for p in permutes):
        return []
    copies = [c for p in permutes for c in p.users]
    order = {n: i for i, n in enumerate(graph.nodes)}
    with graph.inserting_before(min(copies, key=order.__getitem__)):
        base = new if shape == list(_shape(new)) else insert_call(graph, aten.view.default, (new, shape))
        for p in permutes:
            merged = insert_call(graph, aten.permute.default, (base, p.args[1]))
            for copy in list(p.users):
                copy.replace_all_uses_with(merged)
    return copies


def _replace(graph, old, new) -> list:
    """Make ``old``'s users use ``new``; returns the nodes this left without users. A user that
    merges heads takes a view of new where new's layout makes its copy a no-op (``_merge_as_view``);
    the others get new copied into old's shape and strides, which later views rely on."""
    bypassed = []
    for user in list(old.users):
        bypassed += _merge_as_view(graph, user, new)
    want = old.meta["val"]
    significant = [d for d in range(want.dim()) if want.shape[d] != 1]
    if old.users:
        with graph.inserting_before(old):
            if want.shape != new.meta["val"].shape:  # a 4-d output for a 3-d bmm's: dense, then the bmm's shape
                new = insert_call(graph, aten.clone.default, (new,), {"memory_format": torch.contiguous_format})
                new = insert_call(graph, aten.view.default, (new, list(want.shape)))
            have = new.meta["val"]
            if any(want.stride(d) != have.stride(d) for d in significant):
                order = memory_order(want)
                moved = insert_call(graph, aten.permute.default, (new, order))
                dense = insert_call(graph, aten.clone.default, (moved,), {"memory_format": torch.contiguous_format})
                new = insert_call(graph, aten.permute.default, (dense, inverse_permutation(order)))
    old.replace_all_uses_with(new)
    return bypassed


def _dense(graph, node, keep_sequence_major=False):
    """``node``, copied to a contiguous tensor in the graph if it is a strided view (unless
    ``keep_sequence_major`` and it is one: the kernels read v and the output grad in place in that
    layout). q and k are [S, H·D] matmul outputs seen head-major when a rank holds one sequence,
    and the Hopper kernels read dense [S, D] rows of them. Left to the op, the copy was aten's strided
    copy (2.4× slower than Inductor's on the H200, docs/decisions.md), in the forward and again in the
    backward; here Inductor generates it, and the partitioner saves or recomputes it as it does
    the rest."""
    val = fake_value(node)
    if val is None or val.is_contiguous() or (keep_sequence_major and is_sequence_major(val)):
        return node
    return insert_call(graph, aten.clone.default, (node,), {"memory_format": torch.contiguous_format})


def _split_heads_source(node):
    """The [B, H, S, D] sequence-major tensor (heads split off a projection) that ``node``, a
    [B·H, S, D] bmm operand, is a dense copy of (matmul's reshape: an expand to the same shape, a
    copy, a view), or None. The op then reads that tensor in place instead of the copy."""
    want = _shape(node)
    while node.target in RESHAPE_OPS or _is_dense_copy(node) or (
            node.target is aten.expand.default and _shape(node) == _shape(node.args[0])):
        node = node.args[0]
        val = fake_value(node)
        if (isinstance(val, torch.Tensor) and val.dim() == 4 and is_sequence_major(val)
                and want == (val.shape[0] * val.shape[1], *val.shape[2:])):
            return node
    return None


def _flash(graph, q, k, v, causal, scale, grad, where_fwd, where_bwd):
    """Insert our forward (and backward when `grad` is given); returns out, (dq, dk, dv) nodes.
    v is passed as it is if sequence-major, or as the sequence-major [B, H, S, D] tensor its
    [B·H, S, D] copy was made from (q, k and the grad then viewed 4-d alike): the op reads it in
    place and lays out and dv out like it, so merging heads needs no copy (``_replace``). The grad
    is passed the same way (sequence-major when heads were merged after attention). dq and dk
    come back in q's and k's shapes."""
    split = _split_heads_source(v)
    with graph.inserting_before(where_fwd):
        q3, k3 = q, k
        q, k = _dense(graph, q), _dense(graph, k)
        if split is not None:
            v, lead = split, list(_shape(split)[:2])
            q, k = (insert_call(graph, aten.view.default, (t, lead + list(_shape(t)[1:]))) for t in (q, k))
        else:
            v = _dense(graph, v, keep_sequence_major=True)
        fwd = insert_call(graph, torch.ops.cstack.flash_attention_fwd.default, (q, k, v, causal, scale))
        out, lse = (insert_call(graph, operator.getitem, (fwd, i)) for i in (0, 1))
    save_for_backward(fwd, out, lse)
    if grad is None:
        return out, None
    with graph.inserting_before(where_bwd):
        grad_split = _split_heads_source(grad) if split is not None else None
        if grad_split is not None and _shape(grad_split) == _shape(q):  # merged heads' gradient, in place like v
            grad = grad_split
        else:
            grad = _dense(graph, grad, keep_sequence_major=True)
            if split is not None:
                grad = insert_call(graph, aten.view.default, (grad, list(_shape(q))))
        bwd = insert_call(graph, torch.ops.cstack.flash_attention_bwd.default, (grad, q, k, v, out, lse, causal, scale))
        dq, dk, dv = (insert_call(graph, operator.getitem, (bwd, i)) for i in range(3))
        if split is not None:
            dq, dk = (insert_call(graph, aten.view.default, (g, list(_shape(t)))) for g, t in ((dq, q3), (dk, k3)))
        return out, (dq, dk, dv)


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
    bypassed = _replace(graph, plan["pv"], out)
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
            bypassed += _replace(graph, plan["dv"], dv)
    return erase_dead(graph, [plan["pv"], *exits, *bypassed])


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
    bypassed = _replace(graph, plan["out"], out) if plan["out"] is not None else []
    if grads is not None and k is not plan["k"]:
        with graph.inserting_before(bwd):  # after the new backward
            grads = (grads[0], _sum_heads(graph, grads[1], plan["k"]), _sum_heads(graph, grads[2], plan["v"]))
    for i, g in plan["grads"].items():
        if i < 3:
            bypassed += _replace(graph, g, grads[i])
    return erase_dead(graph, [*plan["grads"].values(), plan["out"] or node, node, *bypassed])
