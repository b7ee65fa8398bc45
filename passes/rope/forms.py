"""A tensor's value as a sum of products, element by element along its trailing dims.

``Forms.of(node)`` describes ``node`` as

    value[..., t] = Σ_k sign_k[t] · leaf_k[..., index_k[t]] · table_k[..., table_index_k[t]]

where ``...`` are leading dims every leaf shares with the value, ``t`` runs over the trailing
dims, and each term has at most one table factor. Rotations are built this way whatever the
spelling: pairs taken by strided or half slices, ``chunk``/``split``, or ``unflatten`` then
``unbind``/indexing, combined by mul/sub/add/neg, put together by ``cat``, or by ``stack`` then
``flatten``, or as complex numbers (``view_as_complex`` times a complex table, ``view_as_real``),
through widening casts. Any other node is a leaf: its own value, indexed by its last dim. The
terms are integer arrays, so a form is checked against a rotation's arithmetic directly
(``passes/rope``).
"""
import dataclasses
import operator

import torch

from passes.graph_edit import CAST_OPS, RESHAPE_OPS, fake_value
from torch_internals import fx

aten = torch.ops.aten
# Fields of a term array, along its dim 1.
LEAF, INDEX, TABLE, TABLE_INDEX, SIGN = range(5)
NO_TABLE = -1
# A rotation has two terms per element, and no part of one has more: a form with more is a leaf
# (which also keeps a long chain of residual adds from growing one).
MAX_TERMS = 2
WIDENING = {(torch.float16, torch.float32), (torch.bfloat16, torch.float32)}
COPY_OPS = {aten.clone.default, aten.alias.default}


@dataclasses.dataclass
class Form:
    """``terms``: int64 [number of terms, 5 fields, *trailing shape]; ``lead``: the leading shape."""
    lead: tuple
    terms: torch.Tensor

    @property
    def trailing(self) -> tuple:
        return tuple(self.terms.shape[2:])


class Forms:
    """Forms of a graph's nodes, memoised; ``nodes`` numbers the leaves and tables they name: a node,
    or (node, 0 or 1) for the real or imaginary part of a complex table."""

    def __init__(self, order: dict[torch.fx.Node, int]):
        self.order = order  # each node's position in its graph
        self.nodes: list[torch.fx.Node | tuple[torch.fx.Node, int]] = []
        self._ids: dict = {}
        self._memo: dict[torch.fx.Node, Form | None] = {}

    def node_id(self, node) -> int:
        return self._id(node, node)

    def table_id(self, node: torch.fx.Node, part: int | None = None) -> int:
        """A table's number: the same for nodes that compute the same thing (``freqs_cis[..., 0]``
        written twice), so one table read twice counts once; it names the earliest of them, which
        any reader of the others comes after."""
        return self._id((_structure(node), part), node if part is None else (node, part))

    def _id(self, key, entry) -> int:
        if key not in self._ids:
            self._ids[key] = len(self.nodes)
            self.nodes.append(entry)
        i = self._ids[key]
        if self._position(entry) < self._position(self.nodes[i]):
            self.nodes[i] = entry
        return i

    def _position(self, entry) -> int:
        return self.order[entry[0] if isinstance(entry, tuple) else entry]

    def of(self, node) -> Form | None:
        """``node``'s form; None for anything but a float or complex tensor of rank >= 1, and for a
        complex one no rule describes."""
        if node not in self._memo:
            val = fake_value(node) if isinstance(node, torch.fx.Node) else None
            if not isinstance(val, torch.Tensor) or val.dim() == 0 or not (val.dtype.is_floating_point
                                                                           or val.dtype.is_complex):
                self._memo[node] = None
            else:
                rule = _RULES.get(node.target) if node.op == "call_function" else None
                form = rule(self, node, val) if rule else None
                form = form if form is not None and form.terms.shape[0] <= MAX_TERMS else None
                # A complex leaf has no form: its elements are pairs no node holds apart.
                self._memo[node] = form or (None if val.dtype.is_complex else self._leaf(node, val))
        return self._memo[node]

    def _leaf(self, node, val) -> Form:
        width = val.shape[-1]
        terms = torch.zeros(1, 5, width, dtype=torch.int64)
        terms[0, LEAF] = self.node_id(node)
        terms[0, INDEX] = torch.arange(width)
        terms[0, TABLE] = NO_TABLE
        terms[0, SIGN] = 1
        return Form(tuple(val.shape[:-1]), terms)


def _structure(value, depth: int = 8):
    """What a value computes, as a hashable tree of targets and arguments; a node that is not a
    call, a random or impure one, or one ``depth`` calls down stands for itself."""
    if isinstance(value, torch.fx.Node):
        seeded = isinstance(value.target, fx.OpOverload) and \
            torch.Tag.nondeterministic_seeded in value.target.tags
        if value.op != "call_function" or depth == 0 or seeded or value.is_impure():
            return value
        kwargs = tuple(sorted(value.kwargs.items()))
        return value.target, _structure(value.args, depth - 1), _structure(kwargs, depth - 1)
    if isinstance(value, (list, tuple)):
        return tuple(_structure(v, depth) for v in value)
    return repr(value)


def _trailing_axis(form: Form, dim: int, rank: int) -> int | None:
    """The term array's axis for tensor dim ``dim``, if it is a trailing dim of ``form``."""
    dim = dim % rank
    first = rank - len(form.trailing)
    return 2 + dim - first if dim >= first else None


def _slice(forms, node, val):
    src, dim, start, end, step = list(node.args) + [None] * (5 - len(node.args))
    form = forms.of(src)
    if form is None or not all(isinstance(v, (int, type(None))) for v in (dim, start, end, step)):
        return None
    axis = _trailing_axis(form, dim or 0, val.dim())
    if axis is None:
        return None
    index = torch.arange(form.terms.shape[axis])[slice(start, end, step or 1)]
    return Form(form.lead, form.terms.index_select(axis, index))


def _cat(forms, node, val):
    tensors, dim = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    parts = [forms.of(t) for t in tensors]
    if any(p is None for p in parts) or len({p.lead for p in parts}) != 1 or \
            len({p.terms.shape[0] for p in parts}) != 1:
        return None
    axes = {_trailing_axis(p, dim, val.dim()) for p in parts}
    if len(axes) != 1 or None in axes:
        return None
    return Form(parts[0].lead, torch.cat([p.terms for p in parts], dim=axes.pop()))


def _unsqueeze(forms, node, val):
    form = forms.of(node.args[0])
    if form is None:
        return None
    dim = node.args[1] % val.dim()
    first = len(form.lead)
    if dim < first:
        return None
    return Form(form.lead, form.terms.unsqueeze(2 + dim - first))


def _view(forms, node, val):
    form = forms.of(node.args[0])
    shape = tuple(val.shape)
    if form is None or shape[:len(form.lead)] != form.lead or len(shape) == len(form.lead):
        return None
    return Form(form.lead, form.terms.reshape(form.terms.shape[:2] + shape[len(form.lead):]))


def _same(forms, node, val):
    return forms.of(node.args[0])


def _convert(forms, node, val):
    src = fake_value(node.args[0])
    return forms.of(node.args[0]) if src.dtype == val.dtype or (src.dtype, val.dtype) in WIDENING else None


def _negated(form: Form) -> Form:
    terms = form.terms.clone()
    terms[:, SIGN] *= -1
    return Form(form.lead, terms)


def _neg(forms, node, val):
    form = forms.of(node.args[0])
    return form and _negated(form)


def _add(forms, node, val, subtract=False):
    a, b = (forms.of(x) for x in node.args[:2])
    if a is None or b is None or node.kwargs.get("alpha", 1) != 1 or len(node.args) > 2 or \
            a.lead != b.lead or a.trailing != b.trailing or a.lead + a.trailing != tuple(val.shape):
        return None
    return Form(a.lead, torch.cat([a.terms, (_negated(b) if subtract else b).terms]))


def _times(form: Form, table: int) -> Form:
    """``form`` (table-free terms) times table ``table``, read along the last trailing dim."""
    terms = form.terms.clone()
    terms[:, TABLE] = table
    terms[:, TABLE_INDEX] = torch.arange(form.trailing[-1]).expand(form.trailing)
    return Form(form.lead, terms)


def _broadcasts_over(table: torch.Tensor, form: Form, width: int) -> bool:
    """Whether ``table`` is ``width`` wide and constant over ``form``'s trailing dims before the last
    (heads split off a projection but not yet moved into the lead)."""
    extra = min(len(form.trailing) - 1, table.dim() - 1)
    return table.shape[-1] == width and all(table.shape[-2 - i] == 1 for i in range(extra))


def _mul(forms, node, val):
    """A form without tables times a table: preferably the operand with fewer elements (it
    broadcasts over the form's leading dims), else the second; any node will do, as the product is
    read either way round when checked. A complex product (``view_as_complex`` pairs times a complex
    table) multiplies out into real and imaginary parts, the table's two parts as two tables."""
    if len(node.args) != 2 or not all(isinstance(a, torch.fx.Node) for a in node.args):
        return None
    a, b = node.args
    if fake_value(a).numel() < fake_value(b).numel():
        a, b = b, a
    for x, table in ((a, b), (b, a)):
        form, t = forms.of(x), fake_value(table)
        if form is None or (form.terms[:, TABLE] != NO_TABLE).any() or not isinstance(t, torch.Tensor) \
                or not 0 < t.dim() <= val.dim():  # a 0-d factor (a scale, an lr) is no table
            continue
        shape, width = tuple(val.shape), val.shape[-1]
        if val.dtype.is_complex:  # the form's trailing pairs are its complex elements
            pairs = Form(form.lead, form.terms[..., 0])
            if t.dtype.is_complex and form.trailing[-1:] == (2,) and pairs.lead + pairs.trailing == shape \
                    and _broadcasts_over(t, pairs, width):
                return _complex_product(forms, form, table)
        elif form.trailing and form.lead + form.trailing == shape and _broadcasts_over(t, form, width):
            return _times(form, forms.table_id(table))
    return None


def _complex_product(forms, form: Form, table: torch.fx.Node) -> Form:
    """(r + i·j)(C + S·j) = (r·C − i·S) + (r·S + i·C)·j, with ``form``'s trailing pairs (r, i)."""
    cos, sin = forms.table_id(table, 0), forms.table_id(table, 1)
    r, i = (Form(form.lead, form.terms[..., k]) for k in (0, 1))
    real = torch.cat([_times(r, cos).terms, _negated(_times(i, sin)).terms])
    imag = torch.cat([_times(r, sin).terms, _times(i, cos).terms])
    return Form(form.lead, torch.stack([real, imag], dim=-1))


def _as_complex(forms, node, val):
    """Pairs along the last dim seen as complex numbers: the form keeps them as a trailing dim of 2
    (a complex node's form is that of its ``view_as_real``)."""
    form = forms.of(node.args[0])
    return form if form is not None and len(form.trailing) >= 2 and form.trailing[-1] == 2 else None


def _stack(forms, node, val):
    tensors, dim = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    parts = [forms.of(t) for t in tensors]
    if any(p is None for p in parts) or len({(p.lead, p.terms.shape) for p in parts}) != 1:
        return None
    dim = dim % val.dim()
    first = len(parts[0].lead)
    if dim < first:
        return None
    return Form(parts[0].lead, torch.stack([p.terms for p in parts], dim=2 + dim - first))


def _take(form: Form, axis: int, index: torch.Tensor, keep_axis: bool) -> Form:
    terms = form.terms.index_select(axis, index)
    return Form(form.lead, terms if keep_axis else terms.squeeze(axis))


def _unpermuted(src, dim: int):
    """(tensor, dim) to take an item along instead of ``src``'s ``dim``: through a permute that keeps
    the other dims in order (einops' ``rearrange(x, "... (d two) -> two ... d")``, then items of dim
    0), the item along the permuted-from dim of the permute's input, the same elements in the same
    order; ``src`` and ``dim`` themselves otherwise."""
    if not isinstance(src, torch.fx.Node) or src.target is not aten.permute.default or not isinstance(dim, int):
        return src, dim
    perm = [d % len(src.args[1]) for d in src.args[1]]
    dim %= len(perm)
    rest = perm[:dim] + perm[dim + 1:]
    return (src.args[0], perm[dim]) if rest == sorted(rest) else (src, dim)


def _select(forms, node, val):
    src, dim, index = node.args
    src, dim = _unpermuted(src, dim)
    form = forms.of(src)
    axis = form and _trailing_axis(form, dim, fake_value(src).dim())
    if axis is None or not isinstance(index, int):
        return None
    return _take(form, axis, torch.tensor([index % form.terms.shape[axis]]), keep_axis=False)


def _piece(forms, node, val):
    """Item ``i`` of a split, split_with_sizes or unbind along a trailing dim."""
    multi, i = node.args
    if not isinstance(multi, torch.fx.Node) or multi.target not in _PIECES or not isinstance(i, int):
        return None
    src = multi.args[0]
    at = 1 if multi.target is aten.unbind.int else 2  # where the dim argument is
    dim = multi.args[at] if len(multi.args) > at else multi.kwargs.get("dim", 0)
    if multi.target is aten.unbind.int:
        src, dim = _unpermuted(src, dim)
    form = forms.of(src)
    axis = form and _trailing_axis(form, dim, fake_value(src).dim())
    if axis is None:
        return None
    size = form.terms.shape[axis]
    if multi.target is aten.unbind.int:
        return _take(form, axis, torch.tensor([i]), keep_axis=False)
    sizes = multi.args[1]
    if multi.target is aten.split.Tensor:
        sizes = [min(sizes, size - start) for start in range(0, size, sizes)]
    start = sum(sizes[:i])
    return _take(form, axis, torch.arange(start, start + sizes[i]), keep_axis=True)


_PIECES = {aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int}
_RULES = {
    aten.slice.Tensor: _slice, aten.select.int: _select, operator.getitem: _piece,
    aten.cat.default: _cat, aten.stack.default: _stack, aten.unsqueeze.default: _unsqueeze,
    aten.neg.default: _neg, aten.add.Tensor: _add, aten.sub.Tensor: lambda f, n, v: _add(f, n, v, subtract=True),
    aten.mul.Tensor: _mul, aten.view_as_complex.default: _as_complex, aten.view_as_real.default: _same,
    **{op: _view for op in RESHAPE_OPS}, **{op: _same for op in COPY_OPS}, **{op: _convert for op in CAST_OPS},
}
