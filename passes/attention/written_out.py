"""Written-out attention: from a softmax back through mask, scale, casts and layout ops to the
Q·Kᵀ bmm, forward to bmm(P, V), and the backward's bmms found from those two products."""
import math
import operator

import torch

from custom_ops.attention import HEAD_DIMS
from passes.attention.common import _shape, aten
from passes.attention.masks import Piecewise, _causal_bias, _is_causal_keep, _is_fill, _mask_value
from passes.graph_edit import CAST_OPS, fake_value, reachable
from passes.rejection import NoMatch
from torch_internals import fx

# Ops that only reshape or alias a tensor; `_chain_keeps_order` says when a run of them keeps the element order.
LAYOUT_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
    aten.alias.default, aten.detach.default, aten.expand.default, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
}
# Scaling the scores by a Python number: op -> whether it divides.
SCALE_OPS = {aten.mul.Tensor: False, aten.mul.Scalar: False, aten.div.Tensor: True, aten.div.Scalar: True}


def _chain_keeps_order(chain) -> bool:
    """Whether layout ops applied in turn (each the input of the next) keep the flat element order
    as a whole: e.g. einsum's permute, view, permute back. Replayed on a meta tensor whose strides
    say where each element came from; a view that could not alias it (a reordering) fails."""
    src = _shape(chain[0].args[0])
    if src is None or any(_shape(n) is None for n in chain):
        return False
    with fx.unset_fake_temporarily():
        return _replay_keeps_order(chain, src)


def _replay_keeps_order(chain, src) -> bool:
    t = torch.empty(src, device="meta")
    for n in chain:
        out = _shape(n)
        try:
            if n.target is aten.permute.default:
                t = t.permute(n.args[1])
            elif n.target is aten.expand.default:
                if math.prod(out) != t.numel():
                    return False  # a real broadcast
                t = t.expand(out)
            elif n.target not in (aten.clone.default, aten.alias.default, aten.detach.default):
                t = t.view(out)  # view/reshape/unsqueeze/squeeze: the output shape says it all
        except RuntimeError:
            return False
    expect = torch.empty(t.shape, device="meta").stride()
    return tuple(t.shape) == _shape(chain[-1]) and all(
        t.stride(d) == expect[d] for d in range(t.dim()) if t.shape[d] != 1)


def _match_softmax(node):
    """If `node` is a softmax over the last dim, return (its input, its internal nodes); else None."""
    last = lambda n, dims: _shape(n) is not None and [d % len(_shape(n)) for d in dims] == [len(_shape(n)) - 1]  # noqa: E731
    if node.target is aten._softmax.default:
        return (node.args[0], [node]) if last(node.args[0], [node.args[1]]) else None
    if node.target is not aten.div.Tensor or not all(isinstance(a, torch.fx.Node) for a in node.args):
        return None
    e, total = node.args
    if total.target is not aten.sum.dim_IntList or total.args[0] is not e or not last(e, total.args[1]) \
            or not (len(total.args) > 2 and total.args[2] or total.kwargs.get("keepdim")):
        return None
    if e.target is not aten.exp.default:
        return None
    if e.args[0].target is not aten.sub.Tensor:  # written without subtracting the max: exp(x) / sum
        return e.args[0], [node, total, e]
    x, mx = e.args[0].args
    while isinstance(mx, torch.fx.Node) and mx.target in (aten.alias.default, aten.detach.default):
        mx = mx.args[0]
    if not isinstance(mx, torch.fx.Node):
        return None
    if mx.target is aten.amax.default:
        ok = mx.args[0] is x and last(x, mx.args[1]) and (len(mx.args) > 2 and mx.args[2] or mx.kwargs.get("keepdim"))
    elif mx.target is operator.getitem and mx.args[1] == 0 and mx.args[0].target is aten.max.dim:
        mmax = mx.args[0]
        ok = mmax.args[0] is x and last(x, [mmax.args[1]]) and len(mmax.args) > 2 and mmax.args[2]
    else:
        ok = False
    return (x, [node, total, e, e.args[0], mx]) if ok else None


def _scale_of(node, scores):
    """The positive number a scale op multiplies `scores` by (a Python number, or a constant tensor
    such as ``torch.sqrt(torch.tensor(d))``); NoMatch for anything else (a learned temperature)."""
    other = [a for a in node.args if a is not scores]
    value = _mask_value(other[0]) if len(other) == 1 else None
    c = value.a if isinstance(value, Piecewise) and value.pred is None else None
    if isinstance(other[0] if other else None, torch.fx.Node) and c is None:
        raise NoMatch(f"{node} scales the scores by a tensor {other[0]} that is neither a constant nor one "
                      "number (a learned temperature per head?)")
    if not isinstance(c, int | float) or isinstance(c, bool) or not math.isfinite(c) or c <= 0 \
            or (SCALE_OPS[node.target] and node.args[0] is not scores):
        raise NoMatch(f"{node} scales the scores by something other than a positive number")
    return 1 / c if SCALE_OPS[node.target] else c


def _is_scores(node, rows, cols) -> bool:
    return isinstance(node, torch.fx.Node) and (_shape(node) or (0, 0))[-2:] == (rows, cols)


def _walk_scores(x, rows: int, cols: int):
    """From the softmax input back to Q·Kᵀ (a bmm, or a baddbmm adding a causal mask):
    returns (product node, Q, Kᵀ, scale, is_causal)."""
    scale, causal, node, chain, learned = 1.0, False, x, [], None
    while True:
        if not isinstance(node, torch.fx.Node) or node.op != "call_function":
            raise NoMatch(f"scores come from {node}, not from a Q·Kᵀ bmm")
        t = node.target
        if t in LAYOUT_OPS:
            chain.append(node)
            node = node.args[0]
            continue
        if chain and not _chain_keeps_order(chain[::-1]):
            raise NoMatch(f"scores are reordered by {chain[-1]}")
        chain = []
        if t in (aten.bmm.default, aten.baddbmm.default):
            if _shape(node)[1:] != (rows, cols):
                raise NoMatch(f"{node} has shape {_shape(node)}, expected [*, {rows}, {cols}]")
            if t is aten.baddbmm.default:
                beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
                if beta != 1 or causal or not isinstance(alpha, int | float) or alpha <= 0:
                    raise NoMatch(f"{node} adds beta={beta}·mask to alpha={alpha}·Q·Kᵀ")
                if learned is not None and not learned[2]:
                    raise NoMatch(f"{learned[0]} scales the scores by a tensor after the mask (its sign could flip it)")
                _causal_bias(node.args[0], rows, cols)
                return node, node.args[1], node.args[2], scale * alpha, True, learned
            if learned is not None and causal and not learned[2]:
                raise NoMatch(f"{learned[0]} scales the scores by a tensor after the mask (its sign could flip it)")
            return node, node.args[0], node.args[1], scale, causal, learned
        if not _is_scores(node, rows, cols):
            raise NoMatch(f"{node} has shape {_shape(node)}, expected [..., {rows}, {cols}]")
        if t in CAST_OPS:
            node = node.args[0]
        elif t in SCALE_OPS:
            scores = [a for a in node.args if _is_scores(a, rows, cols)]
            if len(scores) != 1:
                raise NoMatch(f"{node} multiplies two [.., {rows}, {cols}] tensors")
            other = [a for a in node.args if a is not scores[0]]
            val = fake_value(other[0]) if len(other) == 1 else None
            if learned is None and isinstance(val, torch.Tensor) and val.numel() == 1 and val.dtype.is_floating_point \
                    and (node.target is aten.mul.Tensor or node.args[0] is scores[0]) \
                    and not isinstance(_mask_value(other[0]), Piecewise):
                # A learned temperature: moved onto q (s·QKᵀ = (s·Q)Kᵀ), its grad then Σ dq'⊙q.
                learned = (other[0], node.target is aten.div.Tensor, causal)
            else:
                scale *= _scale_of(node, scores[0])
            node = scores[0]
        elif t in (aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther) and not causal:
            cond, a, b = node.args
            if _is_fill(_mask_value(b)):
                _is_causal_keep(_mask_value(cond), True, cond, rows, cols)
                node = a
            elif _is_fill(_mask_value(a)):
                _is_causal_keep(_mask_value(cond), False, cond, rows, cols)
                node = b
            else:
                raise NoMatch(f"{node} selects between scores and something other than a -inf fill")
            causal = True
        elif t is aten.add.Tensor and not causal:
            scores_first = isinstance(node.args[1], torch.fx.Node) and _mask_value(node.args[1]) is not None
            s, bias = node.args if scores_first else node.args[::-1]
            _causal_bias(bias, rows, cols)
            causal, node = True, s
        else:
            raise NoMatch(f"scores pass through {t} ({node})")


def _find_pv(p, tangent_deps):
    """The bmm(P, V) that the softmax output `p` feeds through layout ops (keeping the element
    order as a whole) and casts."""
    found, work, others = [], [(p, [])], []
    while work:
        n, chain = work.pop()
        for u in n.users:
            if u.target is aten.bmm.default and u.args[0] is n and (not chain or _chain_keeps_order(chain)):
                found.append(u)
            elif u.target is aten.bmm.default and u not in tangent_deps:
                others.append(u)
            elif u.target in CAST_OPS:
                if chain and not _chain_keeps_order(chain):
                    others.append(u)
                else:
                    work.append((u, []))
            elif u.target in LAYOUT_OPS and len(chain) < 16:
                work.append((u, chain + [u]))
            elif u not in tangent_deps:
                others.append(u)
    if len(found) != 1:
        why = f" (it feeds {sorted({str(u.target) for u in others})}: dropout?)" if others else ""
        raise NoMatch(f"softmax output reaches {len(found)} bmm with V{why}")
    return found[0]


def _transpose_bmms(node, side: int):
    """bmm nodes taking `node`.transpose(1, 2) as argument number `side`."""
    return [b for t in node.users if t.target is aten.permute.default and list(t.args[1]) == [0, 2, 1]
            for b in t.users if b.target is aten.bmm.default and b.args[side] is t]


def _plan(softmax_node, x, tangent_deps):
    """Everything needed to rewrite one written-out attention; raises NoMatch."""
    rows, cols = _shape(x)[-2:]
    qk, q, kt, scale, causal, learned = _walk_scores(x, rows, cols)
    pv = _find_pv(softmax_node, tangent_deps)
    v = pv.args[1]
    bh, d, dv = _shape(q)[0], _shape(q)[2], _shape(v)[2]
    if _shape(pv.args[0]) != (bh, rows, cols):
        raise NoMatch(f"weights {pv.args[0]} have shape {_shape(pv.args[0])}, expected {(bh, rows, cols)}")
    dtypes = {n.meta["val"].dtype for n in (q, kt, v)}
    if len(dtypes) != 1 or next(iter(dtypes)) not in (torch.float16, torch.bfloat16, torch.float32):
        raise NoMatch(f"q/k/v dtypes {sorted(map(str, dtypes))} are not one floating dtype")
    if d != dv or d not in HEAD_DIMS:
        raise NoMatch(f"head dims q/k {d}, v {dv}: the op needs them equal and in {HEAD_DIMS}")
    # Backward: the grads of the bmm operands, and the grad of the output.
    dv_mm, dp_mm = _transpose_bmms(pv.args[0], 0), _transpose_bmms(v, 1)
    dq_mm, dk_mm = _transpose_bmms(kt, 1), _transpose_bmms(q, 0)
    if any(len(m) > 1 for m in (dv_mm, dp_mm, dq_mm, dk_mm)):
        raise NoMatch("an operand of the attention bmms has several transposed uses in the backward")
    grads = {m[0].args[1] for m in (dv_mm,) if m} | {m[0].args[0] for m in (dp_mm,) if m}
    if len(grads) > 1:
        raise NoMatch("the backward of bmm(P, V) does not use one output grad")
    exits = {"dq": dq_mm[0] if dq_mm else None, "dk": dk_mm[0] if dk_mm else None, "dv": dv_mm[0] if dv_mm else None}
    region = reachable([qk], lambda n: n.users, {pv, *filter(None, exits.values())})
    dlearned = _learned_scale_grad(region, learned) if learned is not None else None
    if dlearned is not None:
        region = reachable([qk], lambda n: n.users, {pv, dlearned, *filter(None, exits.values())})
    if any(n.op == "output" or n.is_impure() for n in region):
        raise NoMatch("the scores or weights are used beyond attention (returned, or backward not recognised)")
    grad = next(iter(grads), None)
    if grad is not None and (grad in region or grad not in tangent_deps):
        raise NoMatch(f"output grad {grad} is not a backward node outside the attention")
    for key, side in (("dq", 0), ("dk", 1)):
        if exits[key] is not None and exits[key].args[side] not in region:
            raise NoMatch(f"{exits[key]} is not the grad of the scores")
    if any(exits.values()) and grad is None:
        raise NoMatch("grads of q/k flow but the output grad was not found")
    return dict(q=q, kt=kt, v=v, pv=pv, grad=grad, causal=causal, scale=scale, learned=learned,
                dlearned=dlearned, **exits)


def _learned_scale_grad(region, learned):
    """The backward node giving the grad of a learned scalar scale of the scores: the first
    one-element tensor computed from the scores (the sum of grad ⊙ scores); None if no grad flows."""
    small = [n for n in region if n.op == "call_function" and isinstance(fake_value(n), torch.Tensor)
             and fake_value(n).numel() == 1]
    if not small:
        return None
    order = {n: i for i, n in enumerate(next(iter(region)).graph.nodes)}
    first = min(small, key=order.__getitem__)
    if first.target not in (aten.sum.default, aten.sum.dim_IntList) \
            or not set(small) <= reachable([first], lambda n: n.users):
        raise NoMatch(f"the grad of the learned scale {learned[0]} is not one sum over the scores")
    return first


def _looks_like_attention(x) -> bool:
    """Whether a bmm (or a baddbmm: BLOOM adds its ALiBi biases so) feeds the softmax input within a
    few elementwise/layout steps."""
    work, seen = [x], set()
    while work:
        n = work.pop()
        if not isinstance(n, torch.fx.Node) or n in seen or n.op != "call_function" or len(seen) > 64:
            continue
        seen.add(n)
        if n.target in (aten.bmm.default, aten.baddbmm.default):
            return True
        work.extend(n.all_input_nodes)
    return False
