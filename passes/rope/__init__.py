"""Joint pass: rotary position embeddings (RoPE) as people write them → ``cstack.rope``.

Runs on AOTAutograd's joint graph, aten level, and replaces the forward rotation only: RoPE is
linear in its input, so the backward autograd derived (the rotation back, which Inductor already
fuses with the gradients' layout copies at the memory's rate) reads nothing of the forward's
intermediates, and is left as it is. The forward is where Inductor's code is slow (each pair
member read by its own strided, masked load: about half the memory's rate on the H200); the op
reads each vector once, contiguously.

The match is by value, not by spelling: ``forms.py`` describes each candidate node as a sum of
products of its leaves (``Forms.of``), and the pass accepts it when that sum is, at every output
position, exactly a rotation of pairs of one tensor x by two tables:

    out[p] = a·C[t] − b·S[t],   out[q] = b·C[t'] + a·S[t']

for the pair (a, b) = (x[2i], x[2i+1]) or (x[i], x[i + D/2]) landing at (p, q) = (2i, 2i+1) or
(i, i + D/2), where a table D/2 wide is read at the pair's index (t = t' = i) and one D wide at
the output position (t = p, t' = q). Matched so: the reference model's pairs-then-halves; HF's
``q * cos + rotate_half(q) * sin``; NeoX halves written out; the interleaved ``stack`` +
``flatten`` (gpt-fast's, cos and sin read off one [S, D/2, 2] table); complex numbers (Meta's and
torchtitan's ``view_as_complex(x) * freqs_cis``); on heads moved first or still in the projection's
view; either operand order, sub or add of a neg, casts up to fp32 on the way and one cast at the
end. The tables are whatever the graph computes (buffers sliced to the sequence, gathered by
positions, cos/sin of a product, a complex table's parts). A rotation the op has no kernel for
(D/2 not a power of two, more than three leading dims, a 64-bit dtype), or two tables combined
some other way, is left alone with a note.
"""
import itertools
import math

import torch

import custom_ops.rope  # noqa: F401 (registers the op)
from custom_ops.checks import FLOAT_DTYPES
from custom_ops.rope import check_rope_args, kernel_takes
from passes.graph_edit import CAST_OPS, RESHAPE_OPS, erase_dead, fake_value, insert_call, reachable
from passes.registry import note, register_pass
from passes.rejection import NoMatch
from passes.rope.forms import (
    COPY_OPS, INDEX, LEAF, NO_TABLE, SIGN, TABLE, TABLE_INDEX, Form, Forms)
from torch_internals import fx

aten = torch.ops.aten
NAME = "rope"
# Ops a rotation can end in.
FINAL_OPS = {aten.cat.default, aten.add.Tensor, aten.sub.Tensor, *RESHAPE_OPS, *COPY_OPS, *CAST_OPS}


def _expected_terms(width: int, interleaved_in: bool, interleaved_out: bool, full_table: bool,
                    leaf: int, cos: int, sin: int) -> torch.Tensor:
    """The rotation's two terms per output position, the cos term first: [2, 5, width]."""
    half = width // 2
    j = torch.arange(width)
    pair, second = (j // 2, j % 2 == 1) if interleaved_out else (j % half, j >= half)
    a, b = (2 * pair, 2 * pair + 1) if interleaved_in else (pair, pair + half)
    t = j if full_table else pair
    terms = torch.empty(2, 5, width, dtype=torch.int64)
    terms[:, LEAF] = leaf
    terms[:, TABLE_INDEX] = t
    terms[0, TABLE], terms[1, TABLE] = cos, sin
    terms[0, INDEX] = torch.where(second, b, a)
    terms[1, INDEX] = torch.where(second, a, b)
    terms[0, SIGN] = 1
    terms[1, SIGN] = torch.where(second, 1, -1)
    return terms


def _folded(form: Form, leaf_width: int) -> Form | None:
    """``form`` with its trailing dims but the last moved into the lead, where along each the leaf's
    index steps by the width of the dims after it and nothing else changes (heads split off a
    projection by a view, not yet moved by a transpose); None if one does not."""
    while len(form.trailing) > 1:
        n = form.trailing[0]
        leaf_width //= n
        first = form.terms[:, :, :1]
        step = torch.zeros_like(first)
        step[:, INDEX] = leaf_width
        k = torch.arange(n).view(n, *[1] * (len(form.trailing) - 1))
        if not torch.equal(form.terms, first + step * k):
            return None
        form = Form(form.lead + (n,), form.terms[:, :, 0])
    return form


def _rotation(forms: Forms, node: torch.fx.Node):
    """(x, x's shape for the op, cos, sin, interleaved_in, interleaved_out) if ``node`` is a rotation;
    None if it is not one; NoMatch if it is one the op cannot take. A final cast is the op's
    result dtype."""
    form = forms.of(node.args[0] if node.target in CAST_OPS else node)
    if form is None or not form.trailing or form.terms.shape[0] != 2:
        return None
    leaves, tables = form.terms[:, LEAF].unique().tolist(), form.terms[:, TABLE].unique().tolist()
    if len(leaves) != 1 or len(tables) != 2 or NO_TABLE in tables:
        return None
    x = forms.nodes[leaves[0]]
    x_val = fake_value(x)
    if tuple(x_val.shape[:-1]) != form.lead or x_val.shape[-1] != math.prod(form.trailing):
        return None
    form = _folded(form, x_val.shape[-1])
    if form is None or form.trailing[0] % 2:
        return None
    width = form.trailing[0]
    table_widths = {_table_value(forms.nodes[t]).shape[-1] for t in tables}
    if len(table_widths) != 1:
        return None
    full = table_widths.pop() == width
    for cos, sin in (tables, tables[::-1]):
        # Each position's terms in the expected order: the cos term first.
        terms = form.terms.clone()
        swap = terms[0, TABLE] != cos
        terms[0, :, swap], terms[1, :, swap] = form.terms[1, :, swap], form.terms[0, :, swap]
        for interleaved_in, interleaved_out in itertools.product((False, True), repeat=2):
            if torch.equal(terms, _expected_terms(width, interleaved_in, interleaved_out, full, leaves[0], cos, sin)):
                return x, form.lead + (width,), forms.nodes[cos], forms.nodes[sin], interleaved_in, interleaved_out
    raise NoMatch(f"{node} combines {x} with two tables, but not as a rotation of pairs")


def _table_value(table):
    """A table's fake value; for a part of a complex table, a fake tensor like that part."""
    if not isinstance(table, tuple):
        return fake_value(table)
    val = fake_value(table[0])
    with val.fake_mode:
        return torch.empty(val.shape, dtype=val.dtype.to_real(), device=val.device)


def _table_node(graph: torch.fx.Graph, table) -> torch.fx.Node:
    """The node holding ``table``: itself, or a part of a complex table taken out of its real view."""
    if not isinstance(table, tuple):
        return table
    node, part = table
    return insert_call(graph, aten.select.int, (insert_call(graph, aten.view_as_real.default, (node,)), -1, part))


def _check_supported(node, x, x_shape, cos, sin) -> None:
    vals = [fake_value(x).view(x_shape), _table_value(cos), _table_value(sin), fake_value(node)]
    if any(v.dtype not in FLOAT_DTYPES for v in vals):
        raise NoMatch(f"rotation {node} in {', '.join(str(v.dtype) for v in vals)}: the op takes 16/32-bit floats")
    x_val = vals[0]
    if not kernel_takes(x_val.shape):
        raise NoMatch(f"rotation {node} of shape {tuple(x_val.shape)}: the kernel takes at most three leading dims "
                      "and D/2 a power of two")
    try:
        check_rope_args(*vals[:3], vals[3].dtype)
    except ValueError as e:
        raise NoMatch(f"rotation {node}: {e}") from None


@register_pass(NAME, stage="joint")
def replace_rope(graph: torch.fx.Graph) -> int:
    """Replace each forward rotation of pairs by two tables with one ``cstack.rope`` call."""
    tangents = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    backward = reachable(tangents, lambda n: n.users)
    forms, gone, replaced = Forms({n: i for i, n in enumerate(graph.nodes)}), set(), 0
    for node in reversed(list(graph.nodes)):
        if node in gone or node.op != "call_function" or node.target not in FINAL_OPS or node in backward:
            continue
        try:
            with fx.unset_fake_temporarily():  # the forms are real integer arrays
                found = _rotation(forms, node)
            if found is None:
                continue
            _check_supported(node, *found[:4])
        except NoMatch as e:
            note(NAME, f"left {node} alone: {e}")
            continue
        x, x_shape, cos, sin, interleaved_in, interleaved_out = found
        with graph.inserting_before(node):
            if tuple(fake_value(x).shape) != x_shape:  # heads split off by a view: the op reads that view
                x = insert_call(graph, aten.view.default, (x, list(x_shape)))
            cos, sin = _table_node(graph, cos), _table_node(graph, sin)
            new = insert_call(graph, torch.ops.cstack.rope.default,
                              (x, cos, sin, interleaved_in, interleaved_out, False, fake_value(node).dtype))
        node.replace_all_uses_with(new)
        gone |= erase_dead(graph, [node])
        replaced += 1
    return replaced
