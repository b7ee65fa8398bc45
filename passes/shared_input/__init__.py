"""Matmuls that share an input become one matmul by the concatenated weights.

``q, k, v = x Wqᵀ, x Wkᵀ, x Wvᵀ`` and SwiGLU's ``x W1ᵀ, x W3ᵀ`` read the same
``x``: one GEMM by ``[Wq; Wk; Wv]`` does the same products with fewer tails
and one launch, and its split outputs feed the rest unchanged. Autograd of the
concatenated form gives the backward in one GEMM each as well: ``dx = [dq dk
dv] [Wq; Wk; Wv]`` (one K = 3d reduction instead of three products and their
sum) and ``d[Wq; Wk; Wv] = [dq dk dv]ᵀ x``, whose row blocks are the weights'
gradients. Same sums, with one rounding of ``dx`` where there were several.

On an H200 at the 8B step's shapes (T = 65,536 rows) the grouped GEMMs ran
1.5% (W1/W3) and 1.9% (Q/K/V) faster forward and backward. The price is the
weights' copy into one buffer, made in the forward and again in the backward
(the partitioner is told to recompute it: saving it would hold every layer's
copy): 8 bytes per weight element against 6·T FLOPs per element of GEMM work,
about 300/T of the GEMMs' time at their rate (~700 TFLOP/s against ~3 TB/s).
Below ``MIN_ROWS`` rows that eats the gain, and the products are left alone.

Rewritten (``pre_grad``, the torch-level graph, so that autograd derives the
backward): two or more products of one ``x`` node by distinct 2-D graph-input
weights (parameters or buffers) in any spelling ``forms.weight_product``
reads, in the same grad and autocast region, same layout, dtype and device, all
with a bias or none. Left alone, with a note where it is a near miss: fewer
rows than ``MIN_ROWS``, a mutation between the products, outputs whose later
use needs them dense (a ``view`` a slice of the joint output cannot give).
"""
import operator
from collections import defaultdict

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree
from torch.fx.node import map_arg
from torch.utils.checkpoint import CheckpointPolicy

from passes import graph_edit
from passes.registry import note, register_pass
from passes.shared_input.forms import WeightProduct, example, weight_product

NAME = "shared_input"
RECOMPUTE = "shared_input_recompute"
# Rows (the product of the activation's leading dims) from which one GEMM by concatenated
# weights pays for their copy (see above: the copy costs ~300/T of the GEMMs, the gain 1.5-1.9%).
MIN_ROWS = 32768
aten = torch.ops.aten
_CASTS = (torch.ops.prims.convert_element_type.default, aten._to_copy.default)
_SPLITS = (aten.split_with_sizes.default, aten.split.Tensor)
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
# Calls that change the grad or autocast mode: products on either side of one are not grouped.
_MODE_CHANGES = {torch._C._set_grad_enabled, torch.amp.autocast_mode._enter_autocast,
                 torch.amp.autocast_mode._exit_autocast}


@register_pass(NAME, stage="pre_grad")
def concatenate_shared_input_matmuls(graph: torch.fx.Graph) -> int:
    """Rewrite each group of products sharing an input into one product and a split; returns the groups."""
    position, region, groups = {}, 0, defaultdict(list)
    for i, node in enumerate(graph.nodes):
        position[node] = i
        if node.op == "call_function" and node.target in _MODE_CHANGES:
            region += 1
        product = weight_product(node)
        if product is not None:
            w = example(product.weight)
            groups[(product.x, region, product.transposed, product.bias is None, w.dtype, w.device)].append(product)
    chosen = [members for members in map(_distinct_weights, groups.values())
              if len(members) >= 2 and _worth_it(members) and _unmutated_between(graph, members, position)]
    return sum(_rewrite(graph, members, position) for members in chosen)


def _distinct_weights(members: list[WeightProduct]) -> list[WeightProduct]:
    seen, kept = set(), []
    for m in members:
        if m.weight not in seen:
            seen.add(m.weight)
            kept.append(m)
    return kept


def _worth_it(members: list[WeightProduct]) -> bool:
    shape = example(members[0].x).shape
    rows = 1
    for size in shape[:-1]:
        if not isinstance(size, int):
            note(NAME, f"left {[m.node.name for m in members]} alone: rows not static ({tuple(shape)})")
            return False
        rows *= size
    if rows < MIN_ROWS:
        note(NAME, f"left {[m.node.name for m in members]} alone: {rows} rows, fewer than {MIN_ROWS} "
                   "(the weights' copy would cost more than one GEMM saves)")
        return False
    return True


def _unmutated_between(graph: torch.fx.Graph, members: list[WeightProduct], position: dict) -> bool:
    """No in-place op between the first and last product (it could change ``x`` or a weight)."""
    first, last = min(position[m.node] for m in members), max(position[m.node] for m in members)
    for node in graph.nodes:
        if first < position[node] < last and _mutates(node):
            note(NAME, f"left {[m.node.name for m in members]} alone: {node.name} mutates a tensor between them")
            return False
    return True


def _mutates(node: torch.fx.Node) -> bool:
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    in_place = name.endswith("_") and not name.endswith("__")
    return in_place or node.target in (operator.setitem, operator.iadd, operator.isub, operator.imul,
                                       operator.itruediv) or "out" in node.kwargs


def _rewrite(graph: torch.fx.Graph, members: list[WeightProduct], position: dict) -> int:
    first = min(members, key=lambda m: position[m.node])
    lead = members[0]
    sizes = [m.out_features for m in members]
    with graph.inserting_before(first.node):
        weight = _call(graph, torch.cat, ([m.weight for m in members], 0 if lead.transposed else 1))
        if lead.transposed:
            bias = None if lead.bias is None else _call(graph, torch.cat, ([m.bias for m in members], 0))
            joint = _call(graph, torch._C._nn.linear, (lead.x, weight, bias))
        else:
            joint = _call(graph, torch.matmul, (lead.x, weight))
        parts = _call(graph, torch.split, (joint, sizes), {"dim": -1})
        outputs = [_call(graph, operator.getitem, (parts, i)) for i in range(len(members))]
    for m, out in zip(members, outputs):
        m.node.replace_all_uses_with(out)
    if not _propagates(graph, outputs):
        for m, out in zip(members, outputs):
            out.replace_all_uses_with(m.node)
        for n in reversed([weight, bias, joint, parts, *outputs]):
            if n is not None:
                graph.erase_node(n)
        note(NAME, f"left {[m.node.name for m in members]} alone: a later use needs the outputs dense")
        return 0
    for m in members:
        graph.erase_node(m.node)
    return 1


def _call(graph: torch.fx.Graph, target, args, kwargs=None) -> torch.fx.Node:
    """A call node with the example value its arguments' example values give."""
    node = graph.call_function(target, args, kwargs or {})
    fake_args, fake_kwargs = map_arg((args, kwargs or {}), example)
    with _fake_mode(fake_args):
        node.meta["example_value"] = target(*fake_args, **fake_kwargs)
    return node


def _fake_mode(values):
    """The fake mode Dynamo traced ``values`` in (the tensors' own, not the context's)."""
    return next(v.fake_mode for v in pytree.tree_leaves(values) if isinstance(v, FakeTensor))


def _propagates(graph: torch.fx.Graph, starts: list[torch.fx.Node]) -> bool:
    """Whether every node downstream of ``starts`` still traces with their new (strided) values;
    updates the example values that only changed strides."""
    values = {n: example(n) for n in starts}
    mode = _fake_mode(list(values.values()))
    reached = set(starts)
    for node in graph.nodes:
        if node in reached or node.op == "output" or not any(i in reached for i in node.all_input_nodes):
            continue
        if node.op not in ("call_function", "call_method"):
            return False
        reached.add(node)
        args, kwargs = map_arg((node.args, node.kwargs), lambda n: values.get(n, example(n)))
        try:
            with mode:
                fn = getattr(args[0], node.target) if node.op == "call_method" else node.target
                values[node] = fn(*args[1:], **kwargs) if node.op == "call_method" else fn(*args, **kwargs)
        except Exception:
            return False
    for node, value in values.items():
        old = example(node)
        if isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) \
                and (old.shape, old.dtype) == (value.shape, value.dtype):
            node.meta["example_value"] = value
    return True


@register_pass(RECOMPUTE, stage="joint")
def recompute_concatenations_and_splits(graph: torch.fx.Graph) -> int:
    """Mark for recomputation in the backward what the rewrite adds and the partitioner would
    otherwise save; returns how many concatenations and splits were marked.

    - A concatenation of graph inputs (and a cast of it): saving ``[W1; W3]`` would keep a copy
      of the weights per layer, while recomputing it costs one copy from inputs the backward
      holds anyway (the partitioner counts it materialized in the backward, read by a matmul).
    - The parts of a split the backward reads (SwiGLU's two halves), and the views between the
      split and the tensor split: saving a part keeps the whole tensor alive, uncounted, and a
      view cannot move to host memory (offload.py); the partitioner saves the dense tensor
      instead and the views are free to redo. Parts the backward reads only through other
      values (Q/K/V through RoPE and attention's copy of V) stay the partitioner's choice: the
      whole of ``[q k v]`` would be one value, too big to place as the separate ones can be.
    """
    tangents = [n for n in graph.find_nodes(op="placeholder") if n.name.startswith("tangents")]
    backward = graph_edit.reachable(tangents, lambda n: n.users)
    marked, roots = [], 0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.cat.default and len(node.args[0]) >= 2 \
                and all(i.op == "placeholder" for i in node.args[0]):
            marked += [node, *(u for u in node.users if u.target in _CASTS)]
            roots += 1
        elif node.target in _SPLITS and any(u in backward for part in node.users for u in part.users):
            marked += [node, *node.users]
            roots += 1
            source = node.args[0]
            while source.op == "call_function" and source.target in _VIEWS:
                marked.append(source)
                source = source.args[0]
    for node in marked:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return roots
