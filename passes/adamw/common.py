"""What every part of the AdamW pass reads: op names, the kinds of graph input, the data flow
of a value (foreach elements followed one by one), one parameter's update chain, and how a
rejected chain is reported."""
import operator

import torch
from torch.fx import Node
from torch.fx.node import map_arg

from passes.graph_edit import fake_value
from passes.registry import note
from passes.rejection import NoMatch
from torch_internals import fx

aten = torch.ops.aten
NAME = "adamw"


def _op_name(target) -> str | None:
    """``add`` for aten.add.Tensor, ``_foreach_add`` for aten._foreach_add.Scalar; None if not aten/prims."""
    if isinstance(target, fx.OpOverload) and target.namespace in ("aten", "prims"):
        return target.overloadpacket.__name__
    return None


def _base_name(node: Node) -> str | None:
    """``add`` for aten.add.Tensor and aten._foreach_add.List alike; None if not aten/prims."""
    name = _op_name(node.target)
    return name.removeprefix("_foreach_") if name is not None else None


def _constant(node: Node):
    """The tensor a ``get_attr`` node reads from the graph's module (None if there is none)."""
    module = node.graph.owning_module
    try:
        return getattr(module, node.target) if module is not None else None
    except AttributeError:
        return None


def _is_foreach(node: Node) -> bool:
    name = _op_name(node.target) if node.op == "call_function" else None
    return name is not None and name.startswith("_foreach_")


def _is_data(node: Node) -> bool:
    """A tensor input of rank >= 1 (parameter, gradient, moment); rank-0 inputs and numbers are scalars."""
    val = fake_value(node)
    return node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() >= 1


def _returned(chain, x: Node) -> bool:
    """Whether the chain's new value of ``x`` is returned by the graph rather than copied back into ``x``."""
    return x not in chain.copies


def _is_fresh(node: Node) -> bool:
    """A zero tensor of rank >= 1 the graph creates (``full(shape, 0)``): a moment made on the first step."""
    val = fake_value(node)
    return (node.op == "call_function" and node.target in (aten.full.default, aten.zeros.default)
            and (node.target is aten.zeros.default or node.args[1] == 0)
            and isinstance(val, torch.Tensor) and val.dim() >= 1)


class _Flow:
    """Data flow per value: a value is (node, None), or (foreach node, i) for element i of its result."""

    def __init__(self):
        self.memo: dict[tuple[Node, int | None], tuple[frozenset, frozenset, frozenset]] = {}

    def inputs(self, node: Node, index: int | None) -> list[tuple[Node, int | None]]:
        if node.target is operator.getitem and isinstance(node.args[0], Node) and _is_foreach(node.args[0]):
            return [(node.args[0], node.args[1])]
        refs = []
        for arg in (*node.args, *node.kwargs.values()):
            if index is not None and isinstance(arg, (list, tuple)):
                arg = arg[index]
            map_arg(arg, lambda n: refs.append((n, None)))
        return refs

    def reach(self, node: Node, index: int | None = None):
        """(data inputs, scalar inputs, values passed through) of a value, following foreach elements."""
        key = (node, index)
        if key not in self.memo:
            if _is_fresh(node):
                self.memo[key] = (frozenset([node]), frozenset(), frozenset())
            elif node.op == "placeholder":
                data, scalars = (frozenset([node]), frozenset()) if _is_data(node) else (frozenset(), frozenset([node]))
                self.memo[key] = (data, scalars, frozenset())
            else:
                data, scalars, values = set(), set(), {key}
                for ref in self.inputs(node, index):
                    d, s, v = self.reach(*ref)
                    data |= d
                    scalars |= s
                    values |= v
                self.memo[key] = (frozenset(data), frozenset(scalars), frozenset(values))
        return self.memo[key]


class _Chain:
    """One parameter's update: its inputs, values, epilogue copies and (once proven) coefficients."""

    def __init__(self, p, g, m, v, new, copies, flow: _Flow):
        self.p, self.g, self.m, self.v = p, g, m, v
        self.new = new  # input -> node holding its new value
        self.copies = copies  # input -> its epilogue copy_
        self.values = set()
        self.scalars = set()
        for x in (p, m, v):
            _, scalars, values = flow.reach(new[x])
            self.values |= values
            self.scalars |= scalars
        self.nodes = {node for node, _ in self.values}
        self.step: Node | None = None  # node holding t, None when t is baked in
        self.coefficients: tuple | None = None  # (β₁, β₂, weight_decay, eps, torch_semantics)
        self.lr: tuple | None = None  # (lr,) when constant, else (node, index, k): lr = k·value

    def __repr__(self):
        return f"update of {self.p.name}"


def _accepted(chains: list[_Chain], check, *args) -> list[_Chain]:
    """The chains ``check(chain, *args)`` lets through; the NoMatch it raises for another becomes its note."""
    kept = []
    for chain in chains:
        try:
            check(chain, *args)
        except NoMatch as why:
            note(NAME, f"left {chain} alone: {why}")
        else:
            kept.append(chain)
    return kept
