"""Recognising a cross-entropy loss by what it computes: rows of ``−log_softmax`` picked at the
targets (any spelling that decomposes to one), their masks, the reduction over all rows, and the
scalar chain that takes it to the graph's loss output (steps 1 and 2 of the package docstring)."""
import operator
from dataclasses import dataclass, field

import torch

from passes.cross_entropy.common import (NO_IGNORE, _CONVERT, _RESHAPES, _VIEW_OPS, _call, _dim, _rank, _same,
                                         _shape, aten, prims)
from passes.graph_edit import fake_value
from torch_internals import fx


@dataclass
class Loss:
    """A recognised ``Σ/mean over rows of sign · mask · CE_row(L, targets)``."""

    reduce: torch.fx.Node  # the sum/mean of all rows
    logits: torch.fx.Node  # L, vocabulary at dim vd
    vd: int
    targets: torch.fx.Node  # the rows' targets, shaped like L without vd
    sign: int
    masks: list = field(default_factory=list)  # (node, is a bool condition), each of a row tensor's numel
    nodes: set = field(default_factory=set)  # the forward nodes between L and reduce


def _dims_arg(node, i):
    d = node.args[i] if len(node.args) > i else None
    return d if isinstance(d, (list, tuple)) else [d]


def _is_vocab_reduction(node, target, x, vd, keepdim):
    """``node`` is ``target(x, [vd], keepdim)`` (sum.dim_IntList / amax / logsumexp)."""
    if not _call(node, target) or node.args[0] is not x:
        return False
    dims = _dims_arg(node, 1)
    kd = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return len(dims) == 1 and _dim(dims[0], _rank(x)) == vd and bool(kd) == keepdim


def _strip(node, ops):
    while _call(node, *ops):
        node = node.args[0]
    return node


def _row_constant(c, x, vd):
    """Whether ``c`` is a per-row max of ``x`` along vd, kept dim (amax, max.values, logsumexp's guard)."""
    c = _strip(c, (aten.detach.default, aten.alias.default))
    if _call(c, aten.where.self) and _is_zero(c.args[1]):  # logsumexp: where(|m| == inf, 0, m)
        c = c.args[2]
    if _call(c, operator.getitem) and c.args[1] == 0 and _call(c.args[0], aten.max.dim):
        m = c.args[0]
        return m.args[0] is x and _dim(m.args[1], _rank(x)) == vd and len(m.args) > 2 and m.args[2]
    return _is_vocab_reduction(c, aten.amax.default, x, vd, True)


def _log_sum_exp(node, keepdim):
    """(x, vd) if ``node`` is logsumexp of x over vd (aten op or its decomposition); else None."""
    if _call(node, aten.logsumexp.default):
        x, rank = node.args[0], _rank(node.args[0])
        dims = _dims_arg(node, 1)
        kd = node.args[2] if len(node.args) > 2 else False
        return (x, _dim(dims[0], rank)) if len(dims) == 1 and bool(kd) == keepdim else None
    if not _call(node, aten.add.Tensor):  # log Σ exp(x − c) + c
        return None
    for log, c in (node.args, node.args[::-1]):
        if not (_call(log, aten.log.default) and _call(log.args[0], aten.sum.dim_IntList)):
            continue
        exp = log.args[0].args[0]
        if not (_call(exp, aten.exp.default) and _call(exp.args[0], aten.sub.Tensor)):
            continue
        x, c_inner = exp.args[0].args
        vd = _dim(_dims_arg(log.args[0], 1)[0], _rank(x))
        if vd is None or not _is_vocab_reduction(log.args[0], aten.sum.dim_IntList, exp, vd, keepdim):
            continue
        c_outer = c if keepdim else (c.args[0] if _call(c, aten.squeeze.dim, aten.squeeze.dims) else None)
        if c_outer is c_inner and _row_constant(c_inner, x, vd):
            return x, vd
    return None


def _log_softmax(node):
    """(L, vd, sign) if ``node`` is ±log_softmax(L) over vd (through casts); else None."""
    sign = 1
    while True:
        node = _strip(node, (_CONVERT,))
        if _call(node, aten.neg.default):
            sign, node = -sign, node.args[0]
        else:
            break
    if _call(node, aten._log_softmax.default):
        return node.args[0], _dim(node.args[1], _rank(node.args[0])), sign
    if not _call(node, aten.sub.Tensor):
        return None
    s, norm = node.args
    lse = _log_sum_exp(_strip(norm, (_CONVERT,)), keepdim=True)  # bf16: lse taken in fp32, cast back
    if lse is not None and _strip(lse[0], (_CONVERT,)) is _strip(s, (_CONVERT,)):
        vd = lse[1]
    elif _call(norm, aten.log.default):  # s − log Σ exp s
        total = norm.args[0]
        if not (_call(total, aten.sum.dim_IntList) and _call(total.args[0], aten.exp.default)
                and total.args[0].args[0] is s):
            return None
        vd = _dim(_dims_arg(total, 1)[0], _rank(s))
        if not _is_vocab_reduction(total, aten.sum.dim_IntList, total.args[0], vd, True):
            return None
    else:
        return None
    if _call(s, aten.sub.Tensor) and _row_constant(s.args[1], s.args[0], vd):  # s = L − row max
        return s.args[0], vd, sign
    return s, vd, sign


def _iota(node, n):
    return (_call(node, prims.iota.default) and _same(node.args[0], n)
            and node.kwargs.get("start", 0) == 0 and node.kwargs.get("step", 1) == 1)


def _pick(node):
    """(x, vd, targets) if ``node`` holds each row's element of x at its target, along vd; else None.

    The targets come back shaped like x without vd, or as a tensor that a view makes so: flattened,
    they line up with x's rows.
    """
    node = _strip(node, (aten.squeeze.dim, aten.squeeze.dims))
    if _call(node, aten.gather.default):
        x, d, index = node.args[:3]
        vd = _dim(d, _rank(x))
        if _call(index, aten.unsqueeze.default) and _dim(index.args[1], _rank(x)) == vd:
            return x, vd, index.args[0]
        if _call(index, aten.view.default, aten._unsafe_view.default) and _same(
                _shape(index), [1 if i == vd else s for i, s in enumerate(_shape(x))]):
            return x, vd, index.args[0]  # targets.view(-1, 1): the same targets in the same order
        return None
    if _call(node, aten.index.Tensor) and _rank(node.args[0]) == 2:
        x, (rows, y) = node.args[0], (list(node.args[1]) + [None, None])[:2]
        if rows is not None and y is not None and _iota(rows, _shape(x)[0]) and _rank(y) == 1:
            return x, 1, y
        return None
    if _call(node, aten.sum.dim_IntList) and _call(node.args[0], aten.mul.Tensor):  # Σ one_hot(y) · x
        for one_hot, x in (node.args[0].args, node.args[0].args[::-1]):
            eq = _strip(one_hot, (_CONVERT,))
            vd = _rank(x) - 1 if _rank(x) else None
            if not (_call(eq, aten.eq.Tensor) and _is_vocab_reduction(node, aten.sum.dim_IntList, node.args[0],
                                                                       vd, _rank(node) == _rank(x))):
                continue
            for col, row in (eq.args, eq.args[::-1]):
                if (_iota(row, _shape(x)[vd]) and _call(col, aten.unsqueeze.default)
                        and _dim(col.args[1], _rank(x)) == vd):
                    return x, vd, col.args[0]
    return None


def _unsqueezed(x, vd):
    """(y, its vd) if x is a view of y that only adds or drops size-1 dims (nll_loss2d's 4-D view)."""
    if not _call(x, aten.view.default, aten._unsafe_view.default):
        return x, vd
    y, xs = x.args[0], _shape(x)
    ys = _shape(y)
    kept_x = [i for i, s in enumerate(xs) if not _same(s, 1) or i == vd]
    for vd_y in range(len(ys)):
        kept_y = [i for i, s in enumerate(ys) if not _same(s, 1) or i == vd_y]
        if (len(kept_x) == len(kept_y) and kept_x.index(vd) == kept_y.index(vd_y)
                and _same([xs[i] for i in kept_x], [ys[i] for i in kept_y])):
            return y, vd_y
    return x, vd


def _rows_regrouped(x, vd):
    """(y, its vd) if x is a view of y that only regroups the rows, the vocabulary last in both
    (log_softmax(logits).view(-1, V)): row-major, so x's rows are y's in order. Else (x, vd)."""
    if not _call(x, aten.view.default, aten._unsafe_view.default):
        return x, vd
    y = x.args[0]
    if vd == _rank(x) - 1 and _rank(y) and _same(_shape(x)[-1], _shape(y)[-1]):
        return y, _rank(y) - 1
    return x, vd


def _ce_rows(node):
    """(L, vd, targets, sign) if ``node`` is sign · CE_row; else None."""
    node = _strip(node, (_CONVERT, *_RESHAPES))
    picked = _pick(node)
    if picked is not None:  # ±pick(±log_softmax(L))
        x, vd, targets = picked
        x, vd = _rows_regrouped(*_unsqueezed(x, vd))
        lsm = _log_softmax(x)
        if lsm is not None and lsm[1] == vd:
            return lsm[0], vd, targets, -lsm[2]
        return None
    if _call(node, aten.sub.Tensor):  # logsumexp(L) − pick(L)
        lse, picked = _log_sum_exp(_strip(node.args[0], (_CONVERT,)), keepdim=False), _pick(node.args[1])
        if lse and picked and _strip(lse[0], (_CONVERT,)) is _strip(picked[0], (_CONVERT,)) \
                and lse[1] == picked[1]:
            return picked[0], picked[1], picked[2], 1
    return None


def _get_attr_value(node):
    owner = node.graph.owning_module
    try:
        return getattr(owner, node.target) if owner is not None else None
    except AttributeError:
        return None


def _is_zero(x):
    if isinstance(x, (int, float)):
        return x == 0
    if _call(x, aten.scalar_tensor.default, aten.full.default):
        return x.args[-1] == 0
    return False


def _zero_one(node) -> bool:
    """Whether every element of ``node`` is provably 0 or 1 (a mask)."""
    if isinstance(node, (int, float, bool)):
        return node in (0, 1)
    val = fake_value(node)
    if isinstance(val, torch.Tensor) and val.dtype is torch.bool:
        return True
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "get_attr":
        value = _get_attr_value(node)
        with fx.unset_fake_temporarily():
            return isinstance(value, torch.Tensor) and bool(((value == 0) | (value == 1)).all())
    if _call(node, aten.full.default, aten.scalar_tensor.default):
        return node.args[-1] in (0, 1)
    if _call(node, aten.ones_like.default, aten.zeros_like.default):
        return True
    if _call(node, _CONVERT, aten.clone.default, aten.lift_fresh_copy.default, aten.expand.default,
             aten.slice.Tensor, *_VIEW_OPS):
        return _zero_one(node.args[0])
    if _call(node, aten.copy.default, aten.slice_scatter.default, aten.mul.Tensor):
        return _zero_one(node.args[0]) and _zero_one(node.args[1])
    if _call(node, aten.where.self):
        return _zero_one(node.args[1]) and _zero_one(node.args[2])
    return False


def _recognise(reduce, from_logits):
    """A Loss if ``reduce`` (sum/mean of a whole tensor) sums masked CE rows; else None."""
    row = reduce.args[0]
    if _call(reduce, aten.sum.dim_IntList):
        dims = _dims_arg(reduce, 1)
        if sorted(_dim(d, _rank(row)) for d in dims) != list(range(_rank(row) or 0)):
            return None
    sign, masks, nodes = 1, [], {reduce}
    while True:
        nodes.add(row)
        if _call(row, aten.neg.default):
            sign, row = -sign, row.args[0]
        elif _call(row, *_RESHAPES, _CONVERT):
            row = row.args[0]
        elif _call(row, aten.where.self) and _is_zero(row.args[2]):
            masks.append((row.args[0], row))
            row = row.args[1]
        elif _call(row, aten.mul.Tensor):
            a, b = row.args
            for value, mask in ((a, b), (b, a)):
                if isinstance(mask, torch.fx.Node) and mask not in from_logits and _zero_one(mask):
                    masks.append((mask, row))
                    row = value
                    break
            else:
                return None
        else:
            break
    rows = _ce_rows(row)
    if rows is None:
        return None
    logits, vd, targets, ce_sign = rows
    for mask, at in masks:  # a mask covers its row tensor's elements one to one (no broadcast)
        if (mask in from_logits or not isinstance(fake_value(mask), torch.Tensor)
                or not _same(fake_value(mask).numel(), fake_value(at).numel())):
            return None
    # The targets may come masked themselves (F.cross_entropy: where(y != k, y, 0)); such a row
    # must then be masked by the same condition, whatever its pick read.
    if _call(targets, aten.where.self) and isinstance(targets.args[2], torch.fx.Node) \
            and _call(targets.args[2], aten.scalar_tensor.default):
        cond, targets = targets.args[0], targets.args[1]
        if not any(_same_condition(cond, m) for m, _ in masks):
            return None
    if fake_value(targets) is None or fake_value(targets).dtype is not torch.int64:
        return None
    return Loss(reduce, logits, vd, targets, sign * ce_sign, masks, nodes)


def _same_condition(a, b) -> bool:
    """The same node, or the same comparison of the same node with the same scalar."""
    if a is b:
        return True
    return (_call(a, aten.ne.Scalar) and _call(b, aten.ne.Scalar)
            and _strip(a.args[0], _RESHAPES) is _strip(b.args[0], _RESHAPES) and a.args[1] == b.args[1])


def _ignore_index(loss):
    """k if every mask is ``targets != k`` (one k, the rows' own targets); else None."""
    values = set()
    for mask, _ in loss.masks:
        mask = _strip(mask, (_CONVERT,))
        if not (_call(mask, aten.ne.Scalar) and isinstance(mask.args[1], int)
                and _strip(mask.args[0], _RESHAPES) is _strip(loss.targets, _RESHAPES)):
            return None
        values.add(mask.args[1])
    if not values:
        return NO_IGNORE
    return values.pop() if len(values) == 1 else None


def _scalar_chain(reduce, backward, from_logits, graph):
    """[(op node, index of the chain's value in its args)] from the reduction to output 0; None if
    a step is not linear in the loss with a factor not computed from the logits."""
    chain, node = [], reduce
    out = graph.output_node()
    while True:
        users = [u for u in node.users if u not in backward or u is out]
        if users == [out]:
            outputs = out.args[0]
            return chain if isinstance(outputs, (list, tuple)) and outputs and outputs[0] is node \
                and list(outputs).count(node) == 1 else None
        if len(users) != 1 or _rank(node) != 0 or _rank(users[0]) != 0:
            return None
        u = users[0]
        positions = [i for i, a in enumerate(u.args) if a is node]
        if len(positions) != 1 or any(a is node for a in u.kwargs.values()):
            return None
        i = positions[0]
        others = [a for j, a in enumerate(u.args) if j != i]
        if any(isinstance(a, torch.fx.Node) and a in from_logits for a in others):
            return None
        ok = (
            _call(u, aten.neg.default, aten.sum.default, aten.mean.default, aten.alias.default, aten.clone.default,
                  _CONVERT, aten.view.default)
            or (_call(u, aten.mul.Tensor, aten.add.Tensor) and not u.kwargs)
            or (_call(u, aten.sub.Tensor) and not u.kwargs)
            or (_call(u, aten.div.Tensor, aten.div.Scalar) and i == 0 and not u.kwargs)
        )
        if not ok:
            return None
        chain.append((u, i))
        node = u
