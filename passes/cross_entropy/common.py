"""What every part of the cross-entropy pass reads: the op sets it walks through, node tests,
and which elements of a base tensor a chain of views reads (so spellings of one view compare equal)."""
import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.node import map_arg

from passes.graph_edit import fake_value

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
# What may stand between the head's matmul and the logits: views, whole rows sliced away, copies.
_HEAD_TO_LOGITS = _VIEW_OPS | {aten.slice.Tensor, aten.clone.default}
_CONVERT = prims.convert_element_type.default
_MATMULS = {aten.mm.default, aten.bmm.default}


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


def _dim(d, rank):
    return d % rank if isinstance(d, int) and rank else None


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
