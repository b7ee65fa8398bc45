"""The LM head under a recognised loss: the matmul whose output the logits are (possibly plus a bias,
possibly with whole rows sliced away), and its backward matmuls and bias sum (step 3 of the package
docstring)."""
import torch

from passes.cross_entropy.common import (_CONVERT, _HEAD_TO_LOGITS, _MATMULS, _call, _dim, _layout,
                                         _matrix, _rank, _replay, _row_major, _same, _shape, _through_views,
                                         _transposed, aten)
from passes.graph_edit import fake_value


def _head(node):
    """(matmul, the views from its output to the bias add, bias or None) when ``node`` is an LM head's
    output: a matmul, an addmm, or a matmul's output reshaped (vocabulary last) plus a bias: V elements
    of a graph input (a parameter), broadcast over the rows. None otherwise."""
    if _call(node, *_MATMULS):
        return node, [], None
    if _call(node, aten.addmm.default):
        unscaled = node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1
        return (node, [], node.args[0]) if unscaled and _is_bias(node.args[0], node) else None
    if not _call(node, aten.add.Tensor) or node.kwargs.get("alpha", 1) != 1:
        return None
    for x, bias in (node.args, node.args[::-1]):
        mm, views = _through_views(x, allow_convert=False)
        if not (_call(mm, *_MATMULS) and _is_bias(bias, mm) and _same(_shape(node), _shape(x))):
            continue
        # x must read the matmul's [N, V] row-major, V last: then x's rows are the matmul's.
        layout, (N, V) = _replay(mm, views), _shape(mm)[-2:]
        if layout is not None and _same(layout[0][-1], V) and _row_major_over(layout, N * V):
            return mm, views, bias
    return None


def _row_major_over(layout, numel) -> bool:
    """Whether ``layout`` reads the first ``numel`` elements of its base in row-major order (the
    strides of size-1 dims aside, which read nothing)."""
    shape, strides, offset = layout
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if not (_same(stride, expected) or _same(size, 1)):
            return False
        expected = expected * size
    return _same((offset, expected), (0, numel))


def _is_bias(bias, matmul) -> bool:
    """Whether ``bias`` is V elements of a graph input (a view of it), V the matmul's columns."""
    val, shape = fake_value(bias), _shape(matmul)
    return isinstance(val, torch.Tensor) and shape is not None and val.dim() >= 1 \
        and _same((val.shape[-1], val.numel()), (shape[-1], shape[-1])) \
        and _through_views(bias, allow_convert=False)[0].op == "placeholder"


def _projection(loss):
    """(matmul, row ops, bias or None) when L is the matmul's [N, V] output (plus a bias): a reshape with
    the vocabulary at vd (row ops empty), or whole rows selected by slices, vocabulary last (the ops
    taking L's rows from the matmul's, to be applied to the hidden). None otherwise."""
    L, vd = loss.logits, loss.vd
    base, chain = _through_views(L, allow_convert=True, ops=_HEAD_TO_LOGITS)
    head = _head(base)
    if head is None:
        return None
    base, views, bias = head
    chain = views + chain  # the bias add is elementwise over the rows: views commute with it
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
        moved = (tuple(shape[d] for d in order), tuple(strides[d] for d in order), offset)
        # L with vd moved last must be P reshaped: contiguous, row-major, the vocabulary whole.
        whole = _same((shape[vd], strides[vd]), (V, 1)) and _row_major_over(moved, N * V)
        return (base, [], bias) if whole else None
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
    return base, ops, bias


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

    ``projection`` is mm(A, B) (or bmm with batch 1, or addmm(bias, A, B)). Each backward matmul of
    the same kind (mm for addmm) reading A or B (any views of them) and a [T, V] G is one; G must be one
    tensor for both. One of the two is absent when A or B needs no gradient.
    """
    a, b = projection.args[-2:]
    (a_base, a_layout), (b_base, b_layout) = _layout(a), _layout(b)
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

    kind = aten.mm.default if projection.target is aten.addmm.default else projection.target
    grads, g_bases = {}, set()
    for mm in backward:
        if mm.target is not kind:
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


def _bias_gradient(projection, g_base, backward):
    """The bias's gradient: the one sum in ``backward`` of G (G's base read row-major, V last) over every
    dim but the vocabulary, as autograd makes it for addmm and for a broadcast add; None if not one."""
    N, V = _shape(projection)[-2:]
    found = []
    for n in backward:
        if not _call(n, aten.sum.dim_IntList) or not isinstance(n.args[1], (list, tuple)) or "dtype" in n.kwargs:
            continue
        base, layout = _layout(n.args[0], allow_convert=True)
        if base is not g_base or layout is None:
            continue
        shape = layout[0]
        summed = {_dim(d, len(shape)) for d in n.args[1]}
        if _same(shape[-1], V) and _row_major_over(layout, N * V) and summed == set(range(len(shape) - 1)):
            found.append(n)
    return found[0] if len(found) == 1 else None
