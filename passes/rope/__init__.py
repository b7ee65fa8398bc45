"""Joint pass: rotary position embeddings (RoPE) as people write them → ``cstack.rope``.

Runs on AOTAutograd's joint graph, aten level, and replaces the forward rotation only: RoPE is
linear in its input, so the backward autograd derived (the rotation back, which Inductor already
fuses with the gradients' layout copies at the memory's rate) reads nothing of the forward's
intermediates, and is left as it is. The forward is where Inductor's code is slow (each pair
member read by its own strided, masked load: about half the memory's rate on the H200); the op
reads each vector once, contiguously.

The match is by value, not by spelling: ``forms.py`` describes each candidate node as a sum of
products of its leaves (``form_of``), and the pass accepts it when that sum is, at every output
position, exactly a rotation of pairs of one tensor x by two tables:

    out[p] = a·C[t] − b·S[t],   out[q] = b·C[t'] + a·S[t']

for the pair (a, b) = (x[2i], x[2i+1]) or (x[i], x[i + D/2]) landing at (p, q) = (2i, 2i+1) or
(i, i + D/2), where a table D/2 wide is read at the pair's index (t = t' = i) and one D wide at
the output position (t = p, t' = q). So the reference model's pairs-then-halves, HF's
``q * cos + rotate_half(q) * sin``, the written-out NeoX halves and the interleaved ``stack``
+ ``flatten`` form are all matched, with either operand order, sub or add of a neg, casts up to
fp32 on the way and one cast at the end; the tables are whatever the graph computes (buffers
sliced to the sequence, gathered by positions, or cos/sin of a product). A rotation the op has no
kernel for (D/2 not a power of two, more than three leading dims, a 64-bit dtype), or two tables
combined some other way, is left alone with a note.
"""
import itertools

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

import custom_ops.rope  # noqa: F401 (registers the op)
from custom_ops.checks import FLOAT_DTYPES
from custom_ops.rope import check_rope_args, kernel_takes
from passes.graph_edit import erase_dead, fake_value, insert_call, reachable
from passes.registry import note, register_pass
from passes.rejection import NoMatch
from passes.rope.forms import CONVERT_OPS, COPY_OPS, INDEX, LEAF, NO_TABLE, SIGN, TABLE, TABLE_INDEX, VIEW_OPS, Forms

aten = torch.ops.aten
NAME = "rope"
# Ops a rotation can end in.
FINAL_OPS = {aten.cat.default, aten.add.Tensor, aten.sub.Tensor, *VIEW_OPS, *COPY_OPS, *CONVERT_OPS}


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


def _rotation(forms: Forms, node: torch.fx.Node):
    """(x, cos, sin, interleaved_in, interleaved_out) if ``node`` is a rotation; None if it is not
    one; NoMatch if it is one the op cannot take. A final cast is the op's result dtype."""
    form = forms.of(node.args[0] if node.target in CONVERT_OPS else node)
    if form is None or len(form.trailing) != 1 or form.terms.shape[0] != 2 or form.trailing[0] % 2:
        return None
    leaves, tables = form.terms[:, LEAF].unique().tolist(), form.terms[:, TABLE].unique().tolist()
    if len(leaves) != 1 or len(tables) != 2 or NO_TABLE in tables:
        return None
    width = form.trailing[0]
    x = forms.nodes[leaves[0]]
    table_widths = {fake_value(forms.nodes[t]).shape[-1] for t in tables}
    if tuple(fake_value(x).shape) != form.lead + (width,) or len(table_widths) != 1:
        return None
    full = table_widths.pop() == width
    for cos, sin in (tables, tables[::-1]):
        # Each position's terms in the expected order: the cos term first.
        terms = form.terms.clone()
        swap = terms[0, TABLE] != cos
        terms[0, :, swap], terms[1, :, swap] = form.terms[1, :, swap], form.terms[0, :, swap]
        for interleaved_in, interleaved_out in itertools.product((False, True), repeat=2):
            if torch.equal(terms, _expected_terms(width, interleaved_in, interleaved_out, full, leaves[0], cos, sin)):
                return x, forms.nodes[cos], forms.nodes[sin], interleaved_in, interleaved_out
    raise NoMatch(f"{node} combines {x} with two tables, but not as a rotation of pairs")


def _check_supported(node, x, cos, sin) -> None:
    vals = [fake_value(n) for n in (x, cos, sin, node)]
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
    forms, gone, replaced = Forms(), set(), 0
    for node in reversed(list(graph.nodes)):
        if node in gone or node.op != "call_function" or node.target not in FINAL_OPS or node in backward:
            continue
        try:
            with unset_fake_temporarily():  # the forms are real integer arrays
                found = _rotation(forms, node)
            if found is None:
                continue
            _check_supported(node, *found[:3])
        except NoMatch as e:
            note(NAME, f"left {node} alone: {e}")
            continue
        x, cos, sin, interleaved_in, interleaved_out = found
        with graph.inserting_before(node):
            new = insert_call(graph, torch.ops.cstack.rope.default,
                              (x, cos, sin, interleaved_in, interleaved_out, False, fake_value(node).dtype))
        node.replace_all_uses_with(new)
        gone |= erase_dead(graph, [node])
        replaced += 1
    return replaced
