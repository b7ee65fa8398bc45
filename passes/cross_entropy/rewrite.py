"""The replacement: one ``cstack::linear_cross_entropy_fwd`` call for a candidate's loss, and its
gradients (scaled by the user's scalar chain, taken back through the head's row ops) in place of the
backward matmuls."""
import operator

import torch

import custom_ops.linear_cross_entropy  # noqa: F401  (registers torch.ops.cstack.linear_cross_entropy_fwd)
from passes.cross_entropy.common import NO_IGNORE, _CONVERT, _call, _rank, _shape, aten
from passes.graph_edit import fake_value, insert_call, save_for_backward


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


def _rewrite(graph, c):
    """The fused call in place of the loss and its backward matmuls.

    The op's gradients come unscaled (reduction "sum") and are multiplied by g, the user's scalar
    chain's derivative, which is not finite when a mean's count is 0 (every target ignored). Rows
    masked by ``where`` (F.cross_entropy's ignore_index included) get exact zeros from where's
    backward in eager, whatever g is, so the op's zeros are kept as they are, not made 0·inf = NaN;
    rows masked by a multiply get mask·g in eager, NaN then too, as here."""
    def emit(target, *args, **kwargs):
        return insert_call(graph, target, args, kwargs)

    loss, projection, bias = c["loss"], c["projection"], c["bias"]
    a, b = projection.args[-2:]
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
        if bias is not None and _rank(bias) != 1:
            bias = emit(aten.view.default, bias, [-1])
        out = emit(torch.ops.cstack.linear_cross_entropy_fwd.default, hidden, weight, targets, ignore_index, "sum",
                   bias)
        total, *op_grads = (emit(operator.getitem, out, i) for i in range(4))
        save_for_backward(out, total, *op_grads)
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
    where_masked = bool(loss.masks) and all(_call(at, aten.where.self) for _, at in loss.masks)
    for which, (node, transposed) in c["grads"].items():
        with graph.inserting_before(node):
            op_grad = op_grads[("hidden", "weight", "bias").index(which)]
            new = emit(aten.mul.Tensor, op_grad, g)
            if where_masked:  # masked rows' exact zeros stay zero, as where's backward leaves them
                new = emit(aten.where.self, emit(aten.eq.Scalar, op_grad, 0), op_grad, new)
            if which == "hidden" and steps:
                if _rank(steps[-1][0]) != 2:
                    new = emit(aten.view.default, new, _sizes(graph, steps[-1][0]))
                new = _unapply_row_ops(graph, new, steps)
            if fake_value(new).dtype != fake_value(node).dtype:
                new = emit(_CONVERT, new, fake_value(node).dtype)
            if transposed:
                new = emit(aten.permute.default, new, [1, 0])
            if which == "bias":  # [V] → the sum's kept dims, [1, V] or [1, 1, V]
                new = emit(aten.view.default, new, [1] * (_rank(node) - 1) + [-1])
            elif _rank(node) == 3:
                new = emit(aten.unsqueeze.default, new, 0)
        node.replace_all_uses_with(new)
