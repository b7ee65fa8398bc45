"""Matching: the update chains with AdamW's roles (param, grad, two moments), found from data flow
alone, and made only of ops the probes can prove (step 1 of the package docstring)."""
import math
import operator

import torch
from torch.fx import Graph, Node

from passes.adamw.common import (NAME, _base_name, _Chain, _constant, _Flow, _is_data, _is_foreach, _is_fresh,
                                 aten)
from passes.graph_edit import fake_value
from passes.registry import note
from passes.rejection import NoMatch
from torch_internals import fx

# Elementwise aten/prims ops a chain may use, by name; their foreach forms
# (``_foreach_`` prefix) too. The comparisons and ``where`` are how torch's reference
# decomposition of ``lerp`` picks its formula from the weight (torch 2.11's Inductor uses it).
_ELEMENTWISE = {"add", "sub", "rsub", "mul", "div", "true_divide", "sqrt", "rsqrt", "neg", "reciprocal", "pow",
                "addcdiv", "addcmul", "lerp", "copy", "clone", "convert_element_type", "_to_copy",
                "scalar_tensor", "full", "fma", "abs", "ge", "gt", "le", "lt", "where",
                "_local_scalar_dense", "cos", "sin", "exp", "log", "minimum", "maximum", "clamp",
                "alias", "detach", "lift_fresh_copy"}  # aliases: a `.data` or `.detach()` read, the same values
# Comparisons, min/max and the transcendental functions may read constants and scalar inputs only:
# a branch on the data (clipping, say) could agree with AdamW at every probe and still differ elsewhere.
_DATA_FREE = {"ge", "gt", "le", "lt", "minimum", "maximum", "clamp", "cos", "sin", "exp", "log"}
# Python-level scalar arithmetic on SymInts/SymFloats (an lr schedule computed inside the step, say).
_SCALAR_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
                     operator.pow, operator.neg, math.sqrt, math.cos, math.sin, math.exp, math.log,
                     torch.sym_float, torch.sym_min, torch.sym_max, fx.sym_sqrt}
_SCALAR_FUNCTIONS |= {getattr(torch, f"_sym_{f}") for f in ("cos", "sin", "exp", "log") if hasattr(torch, f"_sym_{f}")}


def _allowed(node: Node) -> bool:
    if node.op == "get_attr":  # a constant the step made (torch.tensor(0.0)): a 0-d tensor
        val = _constant(node)
        return isinstance(val, torch.Tensor) and val.dim() == 0
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], Node) and _is_foreach(node.args[0])
    if node.target in _SCALAR_FUNCTIONS:
        return True
    return _base_name(node) in _ELEMENTWISE


def _find_chains(graph: Graph, flow: _Flow) -> list[_Chain]:
    """Chains with AdamW's roles: p' reads {p, m, v, g}; m' reads {m, g}; v' reads {v, g}; one shape."""
    copies, new = {}, {}
    for node in graph.nodes:
        if node.target is aten.copy_.default and node.args[0].op == "placeholder":
            dst = node.args[0]
            if dst in copies:
                note(NAME, f"left {dst.name} alone: written back twice")
                copies[dst] = None
                continue
            copies[dst], new[dst] = node, node.args[1]
    mutated = {x for x, c in copies.items() if c is not None and _is_data(x) and isinstance(new[x], Node)}
    # Returned moments: a value the graph returns that reads exactly two tensors, each an unmutated
    # input or a fresh zero tensor, is a candidate new value of either; the moment is the one of the
    # two that only this returned value reads (the gradient is read by both moments).
    candidates: dict[Node, set[Node]] = {}
    for out in graph.find_nodes(op="output")[0].all_input_nodes:
        data = flow.reach(out)[0]
        if len(data) == 2 and all(_is_fresh(x) or (_is_data(x) and x not in mutated) for x in data):
            for x in data:
                candidates.setdefault(x, set()).add(out)
    for x, outs in candidates.items():
        if len(outs) == 1:
            new[x] = next(iter(outs))
            mutated.add(x)
    reads = {x: flow.reach(new[x]) for x in mutated}
    chains, taken, other_updates = [], set(), []
    for p in [n for n in graph.nodes if n in mutated and n.op == "placeholder"]:
        data, scalars, _ = reads[p]
        if p not in data or len(data) < 3:
            continue
        others = data - {p}
        moments = [x for x in others if x in mutated and len(reads[x][0]) == 2 and x in reads[x][0]]
        grads = {next(iter(reads[x][0] - {x})) for x in moments}
        g = next(iter(grads)) if len(grads) == 1 else None
        if len(others) != 3 or len(moments) != 2 or g is None or g in mutated or g not in others:
            if len({_shape_key(x) for x in data}) == 1:  # else no elementwise update (a clip's norm)
                other_updates.append(f"{p.name} reads {sorted(n.name for n in data)}")
            continue
        m, v = moments  # which is which: _prove tells them apart
        if taken & {p, g, m, v}:
            note(NAME, f"left {p.name} alone: shares inputs with another update")
            continue
        shapes = {_shape_key(x) for x in (p, g, m, v)}
        if len(shapes) != 1:
            note(NAME, f"left {p.name} alone: param, grad and moments differ in shape")
            continue
        taken |= {p, g, m, v}
        chains.append(_Chain(p, g, m, v, new, copies, flow))
    if other_updates:  # one note for all (a Muon's matrices are hundreds of them)
        more = f" and {len(other_updates) - 1} more" if len(other_updates) > 1 else ""
        note(NAME, f"left {len(other_updates)} updates alone: they read other inputs than AdamW's (param, grad, "
                   f"exp_avg, exp_avg_sq): {other_updates[0]}{more}")
    return chains


def _shape_key(x) -> tuple[str, ...]:
    """A node's (or fake tensor's) sizes, comparable and hashable when some are symbols: an
    optimizer stepping FSDP2's sharded parameters sees its gradients' local sizes as SymInts
    (of constant value), its parameters' as ints."""
    val = x if isinstance(x, torch.Tensor) else fake_value(x)
    return tuple(str(d) for d in val.shape)


def _check_elementwise(chain: _Chain, flow: _Flow) -> None:
    """NoMatch unless every value of the chain is a whitelisted elementwise op, data-dependent ones
    shaped like the param: the probes prove the update only for such ops."""
    shape = _shape_key(chain.p)
    for node, index in chain.values:
        if not _allowed(node):
            raise NoMatch(f"{node.name} ({node.target}) is not an elementwise update op")
        reads_data = bool(flow.reach(node, index)[0])
        if reads_data and _base_name(node) in _DATA_FREE:
            raise NoMatch(f"{node.name} compares data")
        val = fake_value(node, index)
        if reads_data and not (isinstance(val, torch.Tensor) and _shape_key(val) == shape):
            raise NoMatch(f"{node.name} is not shaped like the parameter")
