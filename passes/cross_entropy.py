"""Joint pass: LM head + cross-entropy → ``cstack::linear_cross_entropy_fwd``.

A user's ``logits = x @ Wᵀ`` ([T, V]: 20 GB at the full config), a log-softmax,
a pick of each row's target and a reduction: the backward builds the [T, V]
logits gradient again and feeds it to two matmuls. In the joint graph this pass
replaces the whole chain, forward and backward together:

    loss, gh, gw = linear_cross_entropy_fwd(hidden, weight, targets', ignore, "sum")
    d hidden = gh · g,   d weight = gw · g       (g: d output / d loss, built here)

so no [T, V] tensor is left in either graph. The loss is recognised by what it
computes, on the decomposed aten graph (every spelling below ends up there):

1. The rows. ``CE_row = −pick(log_softmax(L))`` or ``logsumexp(L) − pick(L)``, the
   vocabulary at any dim ``vd`` of ``L`` (``logits.transpose(1, 2)``: vd 1), where
   - log_softmax is ``_log_softmax``, ``s − log Σ exp s`` or ``s − logsumexp s`` with
     ``s = L`` or ``L − c``, c a row max (amax, max.values, logsumexp's own): any
     row constant cancels, so which one does not matter; a ``neg`` flips the sign;
   - pick is ``gather`` along vd by the targets unsqueezed at vd, advanced indexing
     ``[arange(T), y]`` (2-D), or ``Σ_vd one_hot(y) · x`` (vocabulary last);
   - a row may then be masked: ``where(cond, r, 0)`` or ``r · m`` with m provably
     0/1 valued (a bool, a cast bool, ones with zeroed slices...) and not derived
     from the logits; masks become ``targets' = where(all masks, targets, IGNORE)``.
     Where the only masks are ``targets != k`` (F.cross_entropy's ignore_index,
     ``mask = (y != pad)``), the op's ignore_index is k and targets stay as they are.
2. The reduction: ``sum`` or ``mean`` of every row, then a chain of scalar ops to
   the graph's loss output: neg, times or divided by anything not computed from the
   logits (F.cross_entropy's count of kept targets, ``mask.sum()``, 3.7), plus or
   minus such a term, casts. The op always sums; the user's own scalar chain stays
   in the forward, and the pass differentiates it (one multiply per op) for g.
3. ``L`` must be a reshape (views, optional upcast) of a matmul ``mm(A, B)`` (``bmm``
   with batch 1 from einsum), possibly with whole rows sliced away first
   (``logits[:, :-1]``: the same slice is taken of the hidden, and its gradient is
   scattered back). The projection's backward matmuls ``mm(G, Bᵀ)`` and
   ``mm(Aᵀ, G)`` are found by their operands. Views are compared by replaying them
   on (possibly symbolic) fake tensors, so any spelling of "the same elements"
   matches, at a symbolic sequence length too.
4. The rewrite is made only if the projection's output then dies: any other use of
   the logits (an extra loss term, returned logits) leaves the graph alone, with a
   note, as does a softmax over a weight projection that nothing above matched
   (label smoothing, focal loss, z-loss, float weights per token, a head's bias).

The op computes in fp32 with an fp32 log-sum-exp: more accurate than a
hand-written bf16 log-softmax, by design. Its loss comes back in the matmul's
dtype, so a loss the user took in fp32 over bf16 logits (``.float()`` first) is
rounded to bf16 (gradients are not affected).
"""
import operator
from dataclasses import dataclass, field

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.node import map_arg
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch._inductor.fx_passes.joint_graph import early_patterns
from torch._inductor.fx_passes.post_grad import remove_noop_ops
from torch._inductor.pattern_matcher import stable_topological_sort

import custom_ops.linear_cross_entropy  # noqa: F401  (registers torch.ops.cstack.linear_cross_entropy_fwd)
from passes.graph_edit import fake_value, insert_call, reachable, save_for_backward
from passes.registry import note, register_pass

aten = torch.ops.aten
prims = torch.ops.prims
PASS = "cross_entropy"
NO_IGNORE = torch.iinfo(torch.int64).min  # the ignore_index of rewrites whose masks are not `targets != k`

# Ops that reinterpret their input's elements without copying them.
_VIEW_OPS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.unsqueeze.default,
    aten.alias.default,
}
# Views that keep the row-major order of the elements (reshapes): safe on per-row values.
_RESHAPES = _VIEW_OPS - {aten.permute.default, aten.transpose.int, aten.t.default}
_CONVERT = prims.convert_element_type.default
_MATMULS = {aten.mm.default, aten.bmm.default}
# Ops that open a softmax: one of them over a weight projection is worth a note if unmatched.
_SOFTMAX_STARTS = {aten.amax.default, aten.max.dim, aten.logsumexp.default, aten._log_softmax.default}


def _call(node, *targets):
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _same(a, b) -> bool:
    """Equal ints, SymInts (provably) or nested tuples of them."""
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b) \
            and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001  (an expression the shape env cannot decide)
        return False


def _shape(node):
    val = fake_value(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _rank(node):
    val = fake_value(node)
    return val.dim() if isinstance(val, torch.Tensor) else None


# --- view bookkeeping ----------------------------------------------------------


def _through_views(node, allow_convert, stop=None, ops=_VIEW_OPS):
    """Walk up from ``node`` through views (and dtype casts if allowed), not past ``stop``.

    Returns (base, the ops from base to node).
    """
    chain = []
    while node is not stop and _call(node, *ops, *([_CONVERT] if allow_convert else [])):
        chain.append(node)
        node = node.args[0]
    return node, chain[::-1]


def _replay(base, chain):
    """(shape, strides, offset) of ``chain`` replayed on a row-major tensor shaped like ``base``; None if it fails.

    Runs under the graph's fake mode, so symbolic sizes replay too.
    """
    val = fake_value(base)
    if not isinstance(val, torch.Tensor):
        return None
    mode = getattr(val, "fake_mode", None)
    try:
        if mode is None:
            if not all(isinstance(s, int) for s in val.shape):
                return None
            t = torch.empty(val.shape, device="meta")
            for n in chain:
                if n.target is not _CONVERT:
                    t = n.target(t, *n.args[1:], **n.kwargs)
        else:
            with mode:
                t = torch.empty(val.shape, dtype=val.dtype, device=val.device)
                for n in chain:
                    if n.target is not _CONVERT:
                        args, kwargs = map_arg((n.args[1:], n.kwargs), fake_value)
                        t = n.target(t, *args, **kwargs)
    except Exception:  # noqa: BLE001  (a view that does not replay: no layout, no match)
        return None
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


def _layout(node, allow_convert=False, stop=None, ops=_VIEW_OPS):
    """(base, (shape, strides, offset)): which elements of ``base`` (row-major) ``node`` reads."""
    base, chain = _through_views(node, allow_convert, stop, ops)
    return base, _replay(base, chain)


def _matrix(layout):
    """A matmul operand's layout as a matrix: drop bmm's batch dim, which must be 1 (else None)."""
    if layout is None:
        return None
    shape, strides, offset = layout
    if len(shape) == 3 and _same(shape[0], 1):
        shape, strides = shape[1:], strides[1:]
    return (shape, strides, offset) if len(shape) == 2 else None


def _transposed(layout):
    shape, strides, offset = layout
    return shape[::-1], strides[::-1], offset


def _row_major(rows, cols):
    return (rows, cols), (cols, 1), 0


# --- the loss: rows of cross-entropy, masks, a reduction --------------------------


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


def _dim(d, rank):
    return d % rank if isinstance(d, int) and rank else None


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

    The targets come back shaped like x without vd.
    """
    node = _strip(node, (aten.squeeze.dim, aten.squeeze.dims))
    if _call(node, aten.gather.default):
        x, d, index = node.args[:3]
        vd = _dim(d, _rank(x))
        if _call(index, aten.unsqueeze.default) and _dim(index.args[1], _rank(x)) == vd:
            return x, vd, index.args[0]
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


def _ce_rows(node):
    """(L, vd, targets, sign) if ``node`` is sign · CE_row; else None."""
    node = _strip(node, (_CONVERT, *_RESHAPES))
    picked = _pick(node)
    if picked is not None:  # ±pick(±log_softmax(L))
        x, vd, targets = picked
        x, vd = _unsqueezed(x, vd)
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
        with unset_fake_temporarily():
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


# --- the projection and its backward ----------------------------------------------


def _projection(loss):
    """(matmul, row ops) when L is the matmul's [N, V] output: a reshape with the vocabulary at
    vd (row ops empty), or whole rows selected by slices, vocabulary last (the ops taking L's rows
    from the matmul's, to be applied to the hidden). None otherwise."""
    L, vd = loss.logits, loss.vd
    base, chain = _through_views(L, allow_convert=True, ops=_VIEW_OPS | {aten.slice.Tensor, aten.clone.default})
    if not _call(base, *_MATMULS):
        return None
    for n in chain:
        if n.target is _CONVERT and n.args[1].itemsize < fake_value(base).dtype.itemsize:
            return None  # a downcast of the logits is not what the op computes
    shape = _shape(base)
    if len(shape) not in (2, 3) or (len(shape) == 3 and not _same(shape[0], 1)):
        return None
    N, V = shape[-2:]
    while chain and chain[-1].target in (aten.clone.default, _CONVERT):  # last copies move no element
        chain = chain[:-1]
    if not any(n.target in (aten.slice.Tensor, aten.clone.default) for n in chain):
        layout = _replay(base, chain)
        if layout is None:
            return None
        shape, strides, offset = layout
        order = [d for d in range(len(shape)) if d != vd] + [vd]
        flat = ((shape[vd],), (strides[vd],), offset)
        rows = [(shape[d], strides[d]) for d in order[:-1]]
        # L with vd moved last must be P reshaped: contiguous, row-major, the vocabulary whole.
        expected = V
        for size, stride in reversed(rows):
            if not (_same(stride, expected) or _same(size, 1)):
                return None
            expected = expected * size
        return (base, []) if _same(flat, ((V,), (1,), 0)) and _same(expected, N * V) else None
    # Row selection: every op keeps the vocabulary as the last dim and acts on rows only.
    if vd != _rank(L) - 1:
        return None
    ops = []
    for n in chain:
        if n.target is _CONVERT:
            continue
        rank_in = _rank(n.args[0])
        if n.target in (aten.view.default, aten._unsafe_view.default):
            if not _same(_shape(n)[-1], V):
                return None
        elif n.target is aten.slice.Tensor:
            if _dim(n.args[1] if len(n.args) > 1 else 0, rank_in) == rank_in - 1:
                return None
        elif n.target in (aten.squeeze.dim, aten.unsqueeze.default):
            if _dim(n.args[1], rank_in + (n.target is aten.unsqueeze.default)) >= rank_in - (
                    n.target is aten.squeeze.dim):
                return None
        elif n.target is not aten.clone.default:
            return None
        ops.append(n)
    return base, ops


# Backward matmul of projection A @ B by operand roles → (gradient it holds, transposed?).
# Autograd writes each gradient either way round, depending on the operands' strides.
_GRAD_ROLES = {
    ("G", "Bt"): ("hidden", False),  # dA = G Bᵀ
    ("B", "Gt"): ("hidden", True),  # dAᵀ = B Gᵀ
    ("At", "G"): ("weight", True),  # dB = Aᵀ G = dWᵀ
    ("Gt", "A"): ("weight", False),  # dBᵀ = Gᵀ A = dW
}


def _backward_matmuls(projection, backward):
    """The projection's backward matmuls: ({"hidden"|"weight": (node, transposed)}, G's base); None if unclear.

    ``projection`` is mm(A, B) (or bmm with batch 1). Each backward matmul of the same kind
    reading A or B (any views of them) and a [T, V] G is one; G must be one tensor for both.
    One of the two is absent when A or B needs no gradient.
    """
    (a_base, a_layout), (b_base, b_layout) = _layout(projection.args[0]), _layout(projection.args[1])
    a_matrix, b_matrix = _matrix(a_layout), _matrix(b_layout)
    if a_matrix is None or b_matrix is None:
        return None
    T, V = a_matrix[0][0], b_matrix[0][1]
    known = {"A": (a_base, a_matrix), "B": (b_base, b_matrix)}

    def role(operand):
        for name, (base, matrix) in known.items():
            found, layout = _layout(operand, stop=base)
            m = _matrix(layout) if found is base else None
            if m is not None and _same(m, matrix):
                return name, None
            if m is not None and _same(m, _transposed(matrix)):
                return name + "t", None
        base, layout = _layout(operand, allow_convert=True)
        m = _matrix(layout)
        if m is not None and _same(m, _row_major(T, V)):
            return "G", base
        if m is not None and _same(m, _transposed(_row_major(T, V))):
            return "Gt", base
        return None, None

    grads, g_bases = {}, set()
    for mm in backward:
        if mm.target is not projection.target:
            continue
        roles = [role(x) for x in mm.args]
        which = _GRAD_ROLES.get(tuple(r for r, _ in roles))
        if which is None:
            continue
        if which[0] in grads:
            return None  # two candidates: another projection of the same operand
        grads[which[0]] = (mm, which[1])
        g_bases.update(b for _, b in roles if b is not None)
    if not grads or len(g_bases) != 1:
        return None
    return grads, g_bases.pop()


# --- the scalar chain from the reduction to the loss output ---------------------


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


def _chain_gradient(graph, chain, tangent, emit):
    """d output / d reduction, emitted: the tangent taken back through the chain's ops."""
    g = tangent
    for u, i in reversed(chain):
        if u.target is aten.neg.default or (u.target is aten.sub.Tensor and i == 1):
            g = emit(aten.neg.default, g)
        elif u.target is aten.mul.Tensor:
            g = emit(aten.mul.Tensor, g, u.args[1 - i])
        elif u.target in (aten.div.Tensor, aten.div.Scalar):
            g = emit(u.target, g, u.args[1])
        dtype = fake_value(u.args[i]).dtype
        if fake_value(g).dtype != dtype:
            g = emit(_CONVERT, g, dtype)
    return g


# --- finding ------------------------------------------------------------------------


def _reductions(graph, backward):
    for node in graph.nodes:
        if node in backward or not _call(node, aten.sum.default, aten.mean.default, aten.sum.dim_IntList):
            continue
        val, source = fake_value(node), fake_value(node.args[0])
        if isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point() \
                and isinstance(source, torch.Tensor) and source.dim() >= 1:
            yield node


def _find(graph):
    """Candidate rewrites: one dict per cross-entropy over a projection that can be replaced."""
    tangents = [n for n in graph.nodes if n.op == "placeholder" and n.target.startswith("tangents")]
    if not tangents:
        return [], set()
    backward = reachable(tangents, lambda n: n.users)
    backward_mms = [n for n in graph.nodes if n in backward and n.target in _MATMULS]
    found, taken = [], set()
    for reduce in _reductions(graph, backward):
        loss = _recognise(reduce, frozenset())
        if loss is None:
            continue
        proj = _projection(loss)
        if proj is None or proj[0] in taken:
            continue
        projection, row_ops = proj
        taken.add(projection)
        why = _reject(loss, projection)
        mms = None if why else _backward_matmuls(projection, backward_mms)
        if why is None and mms is None:
            why = "its backward matmuls are not found (or not fed by one logits gradient)"
        chain = None if why else _scalar_chain(reduce, backward, frozenset(), graph)
        if why is None and chain is None:
            why = "the loss reaches the output through something other than scalar scaling"
        if why is None:
            grads, g_base = mms
            replaced = {reduce, *(n for n, _ in grads.values())}
            inputs = [*projection.args, loss.targets, tangents[0], *(m for m, _ in loss.masks),
                      *(a for u, _ in chain for a in u.args if isinstance(a, torch.fx.Node))]
            live = reachable([graph.output_node(), *inputs], lambda n: n.all_input_nodes, stop=replaced)
            if projection in live or g_base in live:
                why = "the logits or their gradient have other uses"
        if why:
            note(PASS, f"left {projection} alone: cross-entropy matched but {why}")
            continue
        found.append(dict(loss=loss, projection=projection, row_ops=row_ops, grads=grads, chain=chain,
                          tangent=tangents[0], ignore_index=_ignore_index(loss)))
    return found, taken


def _reject(loss, projection):
    """Why a recognised loss over this projection cannot become the op (None if it can)."""
    if len(tangents_of(projection.graph)) != 1 or _rank(tangents_of(projection.graph)[0]) != 0:
        return "the graph has other differentiable outputs than one scalar loss"
    a, b = (fake_value(x) for x in projection.args)
    if a.dtype != b.dtype or a.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the projection's dtype {a.dtype} is not supported"
    if loss.masks and any(not _same(fake_value(m).numel(), fake_value(loss.targets).numel()) for m, _ in loss.masks):
        return "a mask does not cover the rows one to one"
    return None


def tangents_of(graph):
    return [n for n in graph.nodes if n.op == "placeholder" and n.target.startswith("tangents")]


def _note_unmatched_softmaxes(graph, taken):
    """Note softmaxes over a weight projection's output (a matmul with a parameter) left in place."""
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _SOFTMAX_STARTS:
            continue
        base, _ = _through_views(node.args[0], allow_convert=True,
                                 ops=_VIEW_OPS | {aten.slice.Tensor, aten.clone.default})
        if base.target not in _MATMULS | {aten.addmm.default} or base in taken:
            continue
        weight, _ = _through_views(base.args[-1], allow_convert=True)
        if weight.op == "placeholder":
            why = " (a head with a bias: the op takes none)" if base.target is aten.addmm.default else ""
            note(PASS, f"left {base} alone: a softmax ({node}) over its output matched no cross-entropy form{why}")
            taken.add(base)


# --- rewriting --------------------------------------------------------------------


def _sizes(graph, node):
    """``node``'s sizes as view arguments: ints, or sym_size calls for symbolic ones."""
    return [s if isinstance(s, int) else insert_call(graph, aten.sym_size.int, (node, i))
            for i, s in enumerate(_shape(node))]


def _flat(graph, node):
    flat = insert_call(graph, aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
    return insert_call(graph, aten.view.default, (flat, [-1]))


def _apply_row_ops(graph, hidden, ops, d):
    """The projection's row ops applied to its hidden [N, d]: [(node, its input)], last the result."""
    steps = []
    for n in ops:
        args = list(n.args)
        if n.target in (aten.view.default, aten._unsafe_view.default):
            args[1] = [*args[1][:-1], d]
        new = insert_call(graph, n.target, (hidden, *args[1:]), n.kwargs)
        steps.append((new, hidden))
        hidden = new
    return steps


def _unapply_row_ops(graph, grad, steps):
    """The row ops' backward: views back, zeros around each slice."""
    for new, source in reversed(steps):
        if new.target is aten.slice.Tensor:
            val = fake_value(source)
            zeros = insert_call(graph, aten.full.default, (_sizes(graph, source), 0),
                                {"dtype": val.dtype, "device": val.device, "layout": torch.strided,
                                 "pin_memory": False})
            grad = insert_call(graph, aten.slice_scatter.default, (zeros, grad, *new.args[1:]))
        else:
            grad = insert_call(graph, aten.view.default, (grad, _sizes(graph, source)))
    return grad


def _rewrite(graph, c):
    def emit(target, *args, **kwargs):
        return insert_call(graph, target, args, kwargs)

    loss, projection = c["loss"], c["projection"]
    a, b = projection.args
    with graph.inserting_before(loss.reduce):
        d = _shape(a)[-1]
        steps = _apply_row_ops(graph, a, c["row_ops"], d)
        hidden = steps[-1][0] if steps else a
        if _rank(hidden) != 2:
            hidden = emit(aten.view.default, emit(aten.clone.default, hidden, memory_format=torch.contiguous_format),
                          [-1, d])
        b2 = b if _rank(b) == 2 else emit(aten.squeeze.dim, b, 0)
        weight = emit(aten.permute.default, b2, [1, 0])
        targets = _flat(graph, loss.targets)
        ignore_index = c["ignore_index"]
        if ignore_index is None:  # masks of any kind: masked rows get an ignored target
            valid = None
            for mask, _ in loss.masks:
                m = _flat(graph, mask)
                if fake_value(m).dtype is not torch.bool:
                    m = emit(aten.ne.Scalar, m, 0)
                valid = m if valid is None else emit(aten.bitwise_and.Tensor, valid, m)
            targets = emit(aten.where.self, valid, targets, emit(aten.scalar_tensor.default, NO_IGNORE,
                                                                    dtype=torch.int64, device=fake_value(a).device))
            ignore_index = NO_IGNORE
        out = emit(torch.ops.cstack.linear_cross_entropy_fwd.default, hidden, weight, targets, ignore_index, "sum")
        total, grad_hidden, grad_weight = (emit(operator.getitem, out, i) for i in range(3))
        save_for_backward(out, total, grad_hidden, grad_weight)
        scale = None
        if loss.reduce.target is aten.mean.default:
            scale = fake_value(loss.reduce.args[0]).numel()
            if not isinstance(scale, int):
                scale = emit(aten.sym_numel.default, loss.targets)
        new_loss = emit(aten.neg.default, total) if loss.sign < 0 else total
        if scale is not None:
            new_loss = emit(aten.div.Tensor, new_loss, scale)
        if fake_value(new_loss).dtype != fake_value(loss.reduce).dtype:
            new_loss = emit(_CONVERT, new_loss, fake_value(loss.reduce).dtype)
    loss.reduce.replace_all_uses_with(new_loss)
    first = min((n for n, _ in c["grads"].values()), key=lambda n: list(graph.nodes).index(n))
    with graph.inserting_before(first):
        g = _chain_gradient(graph, c["chain"], c["tangent"], emit)
        if loss.sign < 0:
            g = emit(aten.neg.default, g)
        if scale is not None:
            g = emit(aten.div.Tensor, g, scale)
    for which, (node, transposed) in c["grads"].items():
        with graph.inserting_before(node):
            new = emit(aten.mul.Tensor, grad_hidden if which == "hidden" else grad_weight, g)
            if which == "hidden" and steps:
                if _rank(steps[-1][0]) != 2:
                    new = emit(aten.view.default, new, _sizes(graph, steps[-1][0]))
                new = _unapply_row_ops(graph, new, steps)
            if fake_value(new).dtype != fake_value(node).dtype:
                new = emit(_CONVERT, new, fake_value(node).dtype)
            if transposed:
                new = emit(aten.permute.default, new, [1, 0])
            if _rank(node) == 3:
                new = emit(aten.unsqueeze.default, new, 0)
        node.replace_all_uses_with(new)


@register_pass(PASS, stage="joint")
def fuse_linear_cross_entropy(graph: torch.fx.Graph) -> int:
    """Replace LM-head matmul + cross-entropy (forward and backward) by the fused chunked op."""
    if not any(n.op == "call_function" and n.target is aten.exp.default for n in graph.nodes):
        return 0
    remove_noop_ops(graph)
    early_patterns.apply(graph)
    found, taken = _find(graph)
    _note_unmatched_softmaxes(graph, taken)
    if not found:
        return 0
    for c in found:
        _rewrite(graph, c)
    stable_topological_sort(graph)
    graph.eliminate_dead_code()
    return len(found)
