"""The LM head under a recognised loss: the matmul whose output the logits are (possibly with
whole rows sliced away), and its two backward matmuls (step 3 of the package docstring)."""
from passes.cross_entropy.common import (_CONVERT, _HEAD_TO_LOGITS, _MATMULS, _call, _dim, _layout, _matrix, _rank,
                                         _replay, _row_major, _same, _shape, _through_views, _transposed, aten)
from passes.graph_edit import fake_value


def _projection(loss):
    """(matmul, row ops) when L is the matmul's [N, V] output: a reshape with the vocabulary at
    vd (row ops empty), or whole rows selected by slices, vocabulary last (the ops taking L's rows
    from the matmul's, to be applied to the hidden). None otherwise."""
    L, vd = loss.logits, loss.vd
    base, chain = _through_views(L, allow_convert=True, ops=_HEAD_TO_LOGITS)
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
