"""Masks evaluated symbolically, and the proofs that one is causal (keeps exactly key j <= query i).

A mask built in the graph is a function of the index along each axis. Integer index tensors are
linear forms `Lin`; masks and biases are `Piecewise`: value `a` where `coef·idx + c0 <= 0`, else `b`.
Axes are numbered from the end (-1: keys j, -2: queries i) so broadcasting keeps them aligned.
"""
import dataclasses
import math
import operator

import torch

from passes.attention.common import _shape, aten, prims
from passes.graph_edit import CAST_OPS, reachable
from passes.rejection import NoMatch
from torch_internals import fx

# A masked score at or below this is as good as −inf: exp underflows to exactly 0 even after scaling.
MASK_FILL_MAX = -1e4


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
    with fx.unset_fake_temporarily():
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
    if t in CAST_OPS:
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
