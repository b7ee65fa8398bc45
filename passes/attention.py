"""Joint pass: rewrite attention as people write it into our FlashAttention op.

Runs on AOTAutograd's joint forward+backward graph (or an inference graph),
aten level, after Inductor's decompositions. Two families are recognised:

1. Written-out attention: Q·Kᵀ (``bmm``, as ``@``/``matmul``/``einsum``/
   einops lower to it, or ``baddbmm(mask, Q, Kᵀ)`` as nn.MultiheadAttention
   writes it) → optional scale → optional causal mask → softmax over keys →
   ``bmm(P, V)``, with dtype casts anywhere. The match is structural rather
   than one traced pattern per idiom: idioms × dtypes × which inputs need
   grads would be hundreds of traced joint patterns (~0.7 s each).

   - Scale: mul/div by a positive number, or by a tensor that evaluates to
     one (``torch.sqrt(torch.tensor(d))``). A scale on Q (or K) beforehand,
     learned or not, stays in the graph and the op gets 1 for it. A learned
     one-element temperature on the scores is moved onto Q (s·QKᵀ =
     (s·Q)Kᵀ): dQ = s·dQ', and the backward's sum giving its grad is
     replaced by Σ dQ'⊙Q. Only before the mask: applied after it, a
     negative value would flip the masked entries (left alone with a note).
   - Mask: ``where``/``masked_fill`` with a fill at or below −1e4 (a number
     or a constant tensor, either branch order) or an added 0/−inf bias, in
     any order with the scale. The mask is evaluated symbolically as a
     function of (query i, key j) from how the graph builds it (iota/arange
     compared however broadcast: unsqueeze, None-indexing, view, expand;
     ones/full with tril/triu; logical ops, casts, arithmetic; constant
     tensors the graph holds, read as a diagonal split of the grid) and must
     be exactly ``j <= i``. A mask from a graph input (a buffer such as
     nanoGPT's ``bias``, or one made outside a repeated block) reaches this
     pass built in the graph where its values were one diagonal split when
     compiled (``compile_stack/input_masks.py`` rebuilds it and guards the
     compiled graph); any other is left alone with a note.
   - Softmax: ``_softmax``, or exp/sum/div with or without the max subtracted.
   - Layout: between the scores' ops and between P and the bmm, any chain of
     views/permutes/unsqueezes whose composition keeps the element order (an
     einsum's permute and its inverse), replayed on a meta tensor.

   The backward is not matched op by op: autograd of ``bmm(A, B)`` with
   output grad ``G`` always yields ``bmm(G, Bᵀ)`` and ``bmm(Aᵀ, G)``, so the
   grads of the three bmm operands (the "exits") and the grad of the output
   are found from the two products alone. Everything between (scores,
   softmax, its backward: every S×S tensor) must feed nothing but the output
   bmm and the exits, which is checked before anything changes, and dies
   with them. The op works on the bmm operands themselves ([B·H, S, D]), so
   grouped-query attention whose k/v heads were repeated
   (``repeat_interleave``, ``expand`` + reshape) is matched as it is.
2. ``F.scaled_dot_product_attention`` (its aten flash/efficient/cuDNN/CPU
   kernels and their backward ops) without dropout: ``is_causal``, no mask,
   or an ``attn_mask`` proven causal as above (bool: True keeps; float:
   0/−inf); with fewer k/v heads (``enable_gqa``) they are repeated for the
   op and their grads summed back over each group.

Anything else that looks like a softmax over a Q·Kᵀ product (dropout on the
weights, a non-causal or unknown mask, a learned scale after the mask or per
head, unsupported head dims) is left alone with a ``note`` saying why.
"""
import dataclasses
import math
import operator

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.operator_schemas import normalize_function

import custom_ops.attention  # noqa: F401  (registers torch.ops.cstack.flash_attention_*)
from custom_ops.attention import HEAD_DIMS
from passes.graph_edit import erase_dead, fake_value, insert_call, reachable, save_for_backward
from passes.registry import note, register_pass
from passes.rejection import NoMatch

aten, prims = torch.ops.aten, torch.ops.prims
NAME = "attention"

# Ops that only reshape or alias a tensor; `_chain_keeps_order` says when a run of them keeps the element order.
LAYOUT_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
    aten.alias.default, aten.detach.default, aten.expand.default, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
}
CONVERT_OPS = {prims.convert_element_type.default, aten._to_copy.default}
# Scaling the scores by a Python number: op -> whether it divides.
SCALE_OPS = {aten.mul.Tensor: False, aten.mul.Scalar: False, aten.div.Tensor: True, aten.div.Scalar: True}
# A masked score at or below this is as good as −inf: exp underflows to exactly 0 even after scaling.
MASK_FILL_MAX = -1e4
# SDPA's aten kernels -> their backward; arguments are read by name from the schema.
SDPA_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default:
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_flash_attention.default: aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention.default:
        aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention.default: aten._scaled_dot_product_cudnn_attention_backward.default,
}


# --------------------------------------------------------------------------- masks, evaluated symbolically
# A mask built in the graph is a function of the index along each axis. Integer index tensors are
# linear forms `Lin`; masks and biases are `Piecewise`: value `a` where `coef·idx + c0 <= 0`, else `b`.
# Axes are numbered from the end (-1: keys j, -2: queries i) so broadcasting keeps them aligned.


@dataclasses.dataclass(frozen=True)
class Lin:
    coef: tuple  # sorted ((axis_from_end, coefficient), ...), no zeros
    c0: int

    def plus(self, other: "Lin", sign: int = 1) -> "Lin":
        coef = dict(self.coef)
        for axis, c in other.coef:
            coef[axis] = coef.get(axis, 0) + sign * c
        return Lin(tuple(sorted((a, c) for a, c in coef.items() if c)), self.c0 + sign * other.c0)

    def neg(self) -> "Lin":
        return Lin(tuple((a, -c) for a, c in self.coef), -self.c0)


@dataclasses.dataclass(frozen=True)
class Piecewise:
    pred: Lin | None  # None: a constant `a` (== b)
    a: object
    b: object


def _const(v) -> Piecewise:
    return Piecewise(None, v, v)


def _le_zero(lin: Lin):
    """The predicate `lin <= 0` over integers, normalised (gcd 1), or a bool when it is constant."""
    if not lin.coef:
        return lin.c0 <= 0
    g = math.gcd(*(abs(c) for _, c in lin.coef))
    return Lin(tuple((a, c // g) for a, c in lin.coef), -((-lin.c0) // g))


_COMPARE = {  # op -> (lin of x - y) -> predicate lin <= 0
    "le": lambda d: d, "lt": lambda d: d.plus(Lin((), 1)),
    "ge": lambda d: d.neg(), "gt": lambda d: d.neg().plus(Lin((), 1)),
}
_PY_COMPARE = {"le": operator.le, "lt": operator.lt, "ge": operator.ge, "gt": operator.gt,
               "eq": operator.eq, "ne": operator.ne}
_UNARY = {aten.sqrt.default: math.sqrt, aten.rsqrt.default: lambda x: 1 / math.sqrt(x),
          aten.reciprocal.default: lambda x: 1 / x, aten.neg.default: operator.neg}
_ARITH = {aten.div.Tensor: operator.truediv, aten.pow.Tensor_Scalar: operator.pow}
_LOGICAL = {
    aten.logical_and.default: lambda x, y: bool(x) and bool(y), aten.bitwise_and.Tensor: operator.and_,
    aten.logical_or.default: lambda x, y: bool(x) or bool(y), aten.bitwise_or.Tensor: operator.or_,
    aten.mul.Tensor: operator.mul,
}


def _cast(v, dtype):
    if dtype is None:
        return v
    if dtype == torch.bool:
        return bool(v)
    return float(v) if dtype.is_floating_point else int(v)


def _pointwise(x, y, fn):
    """Combine two values elementwise; None unless their predicates agree (or one is constant)."""
    if isinstance(x, Lin) or isinstance(y, Lin) or x is None or y is None:
        return None
    if x.pred is not None and y.pred is not None and x.pred != y.pred:
        return None
    pred = x.pred if x.pred is not None else y.pred
    try:
        return Piecewise(pred, fn(x.a, y.a), fn(x.b, y.b))
    except (ArithmeticError, ValueError, TypeError):
        return None


def _shape(node):
    val = fake_value(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _reaxis(value, src, dst):
    """`value` seen through a view that only inserts or drops size-1 dims (unsqueeze, squeeze,
    ``view(T, 1)``...): its axes (numbered from the end) renumbered; None for any other view."""
    if value is None or src is None or dst is None:
        return None
    if isinstance(value, Piecewise) and value.pred is None:
        return value
    big_src = [k - len(src) for k, d in enumerate(src) if d != 1]
    big_dst = [k - len(dst) for k, d in enumerate(dst) if d != 1]
    if [src[k] for k in big_src] != [dst[k] for k in big_dst]:
        return None
    where = dict(zip(big_src, big_dst))

    def move(lin):
        if any(a not in where for a, _ in lin.coef):
            return None  # indexes along a size-1 axis: constant there, but keep it simple
        return Lin(tuple(sorted((where[a], c) for a, c in lin.coef)), lin.c0)

    if isinstance(value, Lin):
        return move(value)
    pred = move(value.pred)
    return None if pred is None else Piecewise(pred, value.a, value.b)


def _tensor_value(t):
    """A real tensor (a constant the graph holds) as a Piecewise: a constant, or two values split
    along a diagonal of the last two dims (tril/triu), the same for every leading index."""
    with unset_fake_temporarily():
        return _real_tensor_value(t)


def _real_tensor_value(t):
    if not isinstance(t, torch.Tensor) or t.is_complex() or t.numel() == 0:
        return None
    t = t.detach().cpu()
    py = bool if t.dtype == torch.bool else (float if t.dtype.is_floating_point else int)
    values = torch.unique(t)
    if len(values) == 1:
        return _const(py(values[0].item()))
    if t.dim() < 2 or len(values) != 2:
        return None
    rows, cols = t.shape[-2:]
    flat = t.reshape(-1, rows, cols)
    if not bool((flat == flat[:1]).all()):
        return None
    m = flat[0]
    for a, b in (values, values.flip(0)):
        keep = m == a  # a where j - i - d <= 0 for some diagonal d?
        counts = keep.sum(-1)
        inner = [i for i in range(rows) if 0 < counts[i] < cols]
        d = int(counts[inner[0]]) - inner[0] - 1 if inner else None
        if d is not None and torch.equal(keep, torch.ones(rows, cols, dtype=torch.bool).tril(d)):
            return Piecewise(_le_zero(Lin(((-2, -1), (-1, 1)), -d)), py(a.item()), py(b.item()))
    return None


def _mask_value(node, memo=None):
    """What a mask/bias/index node computes as a Lin or Piecewise of (i, j); None when unknown."""
    memo = {} if memo is None else memo
    if isinstance(node, bool | int | float):
        return _const(node)
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        # A constant tensor the graph holds (``torch.tensor(float("-inf"))`` in the forward): fixed at trace time.
        module = node.graph.owning_module
        if node not in memo:
            memo[node] = _tensor_value(getattr(module, node.target, None)) if module is not None else None
        return memo[node]
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node not in memo:
        memo[node] = _mask_value_of(node, memo)
    return memo[node]


def _mask_value_of(node, memo):
    t, args, kw = node.target, node.args, node.kwargs

    def arg(i):
        return _mask_value(args[i], memo)

    if t is prims.iota.default:
        return Lin(((-1, kw.get("step", 1)),), kw.get("start", 0))
    if t in (aten.arange.default, aten.arange.start, aten.arange.start_step):
        start, step = (0, 1) if t is aten.arange.default else (args[0], args[2] if len(args) > 2 else 1)
        return Lin(((-1, step),), start) if isinstance(start, int) and isinstance(step, int) else None
    if t in (aten.full.default, aten.scalar_tensor.default):
        return _const(_cast(args[-1] if t is aten.full.default else args[0], kw.get("dtype")))
    if t in (aten.ones.default, aten.zeros.default):
        return _const(_cast(int(t is aten.ones.default), kw.get("dtype", torch.float32)))
    if t in (aten.alias.default, aten.clone.default, aten.detach.default, aten.expand.default):
        return arg(0)
    if t in (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.squeeze.dim,
             aten.squeeze.dims, aten.squeeze.default):
        return _reaxis(arg(0), _shape(args[0]), _shape(node))
    if t is aten.slice.Tensor:
        start, step = (list(args[2:]) + [None, None, None])[0], (list(args[2:]) + [None, None, None])[2]
        return arg(0) if start in (None, 0) and step in (None, 1) else None
    if t is aten.unsqueeze.default:
        return _reaxis(arg(0), _shape(args[0]), _shape(node))
    if t in (aten.lift_fresh_copy.default, aten.lift_fresh.default):
        return arg(0)
    if t in _UNARY:
        x = arg(0)
        return _pointwise(x, _const(0), lambda u, _: _UNARY[t](u)) if isinstance(x, Piecewise) \
            and all(isinstance(u, int | float) and not isinstance(u, bool) for u in (x.a, x.b)) else None
    if t in _ARITH:
        return _pointwise(arg(0), arg(1), _ARITH[t])
    if t in CONVERT_OPS:
        value, dtype = arg(0), (args[1] if t in (prims.convert_element_type.default,) else kw.get("dtype"))
        if isinstance(value, Piecewise):
            return Piecewise(value.pred, _cast(value.a, dtype), _cast(value.b, dtype))
        return value
    if t in (aten.add.Tensor, aten.sub.Tensor):
        x, y = arg(0), arg(1)
        sign = 1 if t is aten.add.Tensor else -1
        if isinstance(x, Lin) and isinstance(y, Piecewise) and y.pred is None and isinstance(y.a, int):
            y = Lin((), y.a)
        if isinstance(x, Lin) and isinstance(y, Lin):
            return x.plus(y, sign)
        return _pointwise(x, y, lambda p, q: p + sign * q)
    name = getattr(t, "_opname", "")
    if name in _PY_COMPARE and len(args) == 2:
        x, y = arg(0), arg(1)
        if name in _COMPARE and isinstance(x, Lin | Piecewise) and isinstance(y, Lin | Piecewise):
            lx = x if isinstance(x, Lin) else (Lin((), x.a) if x.pred is None and isinstance(x.a, int) else None)
            ly = y if isinstance(y, Lin) else (Lin((), y.a) if y.pred is None and isinstance(y.a, int) else None)
            if lx is not None and ly is not None:
                pred = _le_zero(_COMPARE[name](lx.plus(ly, -1)))
                return _const(pred) if isinstance(pred, bool) else Piecewise(pred, True, False)
        return _pointwise(x, y, _PY_COMPARE[name])
    if t in (aten.logical_not.default, aten.bitwise_not.default):
        x = arg(0)
        return Piecewise(x.pred, not x.a, not x.b) if isinstance(x, Piecewise) else None
    if t in _LOGICAL:
        return _pointwise(arg(0), arg(1), _LOGICAL[t])
    if t in (aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar):
        c, x, y = arg(0), arg(1), arg(2)
        if not all(isinstance(v, Piecewise) for v in (c, x, y)) or x.pred is not None or y.pred is not None:
            return None
        return _pointwise(c, c, lambda u, _: x.a if u else y.a)
    if t in (aten.tril.default, aten.triu.default):
        x, diag = arg(0), (args[1] if len(args) > 1 else 0)
        if not isinstance(x, Piecewise) or x.pred is not None:
            return None
        j_minus_i = Lin(((-2, -1), (-1, 1)), -diag)  # j - i - diag
        pred = j_minus_i if t is aten.tril.default else j_minus_i.neg()
        return Piecewise(_le_zero(pred), x.a, type(x.a)(0))
    return None


_KEEP_CAUSAL = _le_zero(Lin(((-2, -1), (-1, 1)), 0))  # j - i <= 0
_DROP_CAUSAL = _le_zero(Lin(((-2, 1), (-1, -1)), 1))  # i - j + 1 <= 0, i.e. j > i


def _unknown_mask(node) -> str:
    """Why a mask/bias could not be evaluated: it comes from a graph input, or it is built in the
    graph but is not one diagonal split of the (query, key) grid."""
    inputs = [n for n in reachable([node], lambda n: n.all_input_nodes) if n.op == "placeholder"]
    if inputs:
        return (f"mask {node} comes from graph input {inputs[0]} (a buffer, or a tensor made outside the "
                "block) whose values were not one diagonal split when compiled, so it cannot be proven causal")
    return f"mask {node} is not causal (key <= query): not one diagonal split of the (query, key) grid"


def _is_causal_keep(value, keep_if_true: bool, node, rows: int, cols: int) -> None:
    """Raise NoMatch unless `value` (a bool mask, True meaning keep when keep_if_true) keeps exactly j <= i."""
    if not isinstance(value, Piecewise) or value.pred is None or not isinstance(value.a, bool):
        raise NoMatch(_unknown_mask(node))
    keep_when_pred = value.a if keep_if_true else not value.a
    if value.a == value.b or (value.pred, keep_when_pred) not in ((_KEEP_CAUSAL, True), (_DROP_CAUSAL, False)):
        raise NoMatch(f"mask {node} is not causal (key <= query)")
    shape = _shape(node) or ()
    if len(shape) < 2 or shape[-2] != rows or shape[-1] != cols or rows != cols:
        raise NoMatch(f"mask {node} has shape {shape}, expected a causal [..., {rows}, {cols}]")


def _is_fill(value) -> bool:
    return isinstance(value, Piecewise) and value.pred is None and isinstance(value.a, float | int) \
        and not isinstance(value.a, bool) and value.a <= MASK_FILL_MAX


# --------------------------------------------------------------------------- written-out attention


def _chain_keeps_order(chain) -> bool:
    """Whether layout ops applied in turn (each the input of the next) keep the flat element order
    as a whole: e.g. einsum's permute, view, permute back. Replayed on a meta tensor whose strides
    say where each element came from; a view that could not alias it (a reordering) fails."""
    src = _shape(chain[0].args[0])
    if src is None or any(_shape(n) is None for n in chain):
        return False
    with unset_fake_temporarily():
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


def _causal_bias(bias, rows, cols) -> None:
    """Raise NoMatch unless `bias`, added to the scores, is 0 where j <= i and a -inf fill elsewhere."""
    value = _mask_value(bias)
    if not isinstance(value, Piecewise) or value.pred is None:
        raise NoMatch(_unknown_mask(bias))
    if value.a == 0 and _is_fill(_const(value.b)):
        _is_causal_keep(Piecewise(value.pred, True, False), True, bias, rows, cols)
    elif value.b == 0 and _is_fill(_const(value.a)):
        _is_causal_keep(Piecewise(value.pred, False, True), True, bias, rows, cols)
    else:
        raise NoMatch(f"the scores get a bias {bias} that is not 0 / -inf")


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
        if t in CONVERT_OPS:
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
            elif u.target in CONVERT_OPS:
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


# --------------------------------------------------------------------------- SDPA


def _sdpa_plan(node):
    kw = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
    q, k, v = kw["query"], kw["key"], kw["value"]
    if kw.get("dropout_p", 0.0) != 0.0:
        raise NoMatch(f"SDPA {node} has dropout {kw['dropout_p']}")
    sq, sk = _shape(q), _shape(k)
    if len(sq) != 4 or len(sk) != 4 or _shape(v)[:-1] != sk[:-1] or sk[0] != sq[0] or sq[1] % sk[1] \
            or _shape(v)[-1] != sq[-1] or sk[-1] != sq[-1] or sq[-1] not in HEAD_DIMS:
        raise NoMatch(f"SDPA {node} shapes q{sq} k{sk} v{_shape(v)} (head dim or heads) not supported")
    causal = bool(kw.get("is_causal", False))
    mask = kw.get("attn_mask", kw.get("attn_bias"))
    if mask is not None:  # a causal mask: bool (True keeps) or additive (0 / -inf)
        if causal or sq[-2] != sk[-2]:
            raise NoMatch(f"SDPA {node} has a mask and is_causal, or Sq != Sk")
        value = _mask_value(mask)
        if isinstance(value, Piecewise) and isinstance(value.a, bool):
            _is_causal_keep(value, True, mask, sq[-2], sk[-2])
        else:
            _causal_bias(mask, sq[-2], sk[-2])
        causal = True
    if causal and sq[-2] != sk[-2]:
        raise NoMatch(f"SDPA {node} is causal with Sq != Sk")
    scale = kw.get("scale") or 1.0 / math.sqrt(sq[-1])
    outs = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    out = outs.get(0)
    bwds = [u for u in node.users if u.target is not operator.getitem]
    bwds += [b for g in outs.values() for b in g.users if b.target is SDPA_OPS[node.target]]
    bwds = list(dict.fromkeys(bwds))
    if any(b.target is not SDPA_OPS[node.target] or tuple(b.args[1:4]) != (q, k, v) for b in bwds) or len(bwds) > 1:
        raise NoMatch(f"SDPA {node} has outputs used by something other than its backward")
    for i, g in outs.items():
        if i != 0 and any(u not in bwds for u in g.users):
            raise NoMatch(f"SDPA {node} output {i} (logsumexp/rng state) is used outside its backward")
    bwd = bwds[0] if bwds else None
    grads = {u.args[1]: u for u in bwd.users} if bwd is not None else {}
    if any(i > 2 and g.users for i, g in grads.items()):
        raise NoMatch(f"SDPA backward {bwd} has a used bias grad")
    return dict(q=q, k=k, v=v, causal=causal, scale=float(scale), out=out, bwd=bwd, grads=grads)


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


# --------------------------------------------------------------------------- the pass


@register_pass(NAME, stage="joint")
def replace_attention(graph: torch.fx.Graph) -> int:
    """Rewrite naive attention and SDPA (fwd and bwd together) into cstack.flash_attention_{fwd,bwd}."""
    tangents = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    tangent_deps = reachable(tangents, lambda n: n.users)
    replaced, gone, tried = 0, set(), set()
    order = {n: i for i, n in enumerate(graph.nodes)}  # of the original nodes, which rewrites keep
    for node in list(graph.nodes):
        if node in gone or node.op != "call_function" or node in tangent_deps:
            continue
        if node.target in SDPA_OPS:
            try:
                plan = _sdpa_plan(node)
            except NoMatch as e:
                note(NAME, f"left {node} alone: {e}")
                continue
            gone |= _sdpa_rewrite(graph, node, plan)
            replaced += 1
            continue
        softmax = _match_softmax(node)
        # The hand softmax's backward recomputes exp/sum: try each softmax input once.
        if softmax is None or softmax[0] in tried or len(_shape(softmax[0]) or ()) < 2:
            continue
        tried.add(softmax[0])
        try:
            plan = _plan(node, softmax[0], tangent_deps)
        except NoMatch as e:
            if _looks_like_attention(softmax[0]):
                note(NAME, f"left softmax {node} over a Q·Kᵀ-like product alone: {e}")
            continue
        gone |= _rewrite(graph, plan, order)
        replaced += 1
    return replaced


def _looks_like_attention(x) -> bool:
    """Whether a bmm feeds the softmax input within a few elementwise/layout steps."""
    work, seen = [x], set()
    while work:
        n = work.pop()
        if not isinstance(n, torch.fx.Node) or n in seen or n.op != "call_function" or len(seen) > 64:
            continue
        seen.add(n)
        if n.target is aten.bmm.default:
            return True
        work.extend(n.all_input_nodes)
    return False
