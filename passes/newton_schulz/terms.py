"""Values as the Newton–Schulz pass reads them: a node seen through the ops that do not change
its values (views to the same shape, copies), transposes of its last two dims and products
with Python numbers; and a linear combination of such operands and of their matrix products.

Every spelling of ``b * A + c * A @ A``, ``torch.addmm(A, A, A, beta=b, alpha=c)``,
``a * X + B @ X``... lowers to aten ops that this reading maps to the same terms."""
import dataclasses
import numbers
from collections import defaultdict

import torch
from torch.fx import Node

from passes.graph_edit import CAST_OPS, RESHAPE_OPS, fake_value

aten = torch.ops.aten

# Ops whose output holds their first input's values: always, or when the shape (and dtype) is the same.
_COPIES = {aten.alias.default, aten.clone.default, aten.detach.default, aten.lift_fresh_copy.default}
_RESHAPES = RESHAPE_OPS | {aten.expand.default, aten._reshape_alias.default}
_MULS = {aten.mul.Tensor, aten.mul.Scalar}
_DIVS = {aten.div.Tensor, aten.div.Scalar}
ADDS = {aten.add.Tensor: 1.0, aten.sub.Tensor: -1.0}
MATMULS = {aten.mm.default, aten.bmm.default}
BIASED_MATMULS = {aten.addmm.default, aten.baddbmm.default}
# Nodes an expansion opens at most. One iteration's takes about a dozen; the bound keeps the cost of
# expanding every sum of a large graph (residual streams, gradient sums) linear in its size.
_MOST_OPENED = 64


@dataclasses.dataclass(frozen=True)
class Operand:
    """The values of ``node``, or of its transpose (last two dims)."""

    node: Node
    transposed: bool = False

    def __repr__(self):
        return self.node.name + ("ᵀ" if self.transposed else "")


@dataclasses.dataclass(frozen=True)
class Product:
    """The matrix product ``left @ right`` (batched: per matrix)."""

    left: Operand
    right: Operand


def _number(x) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, bool)


def _tensor(node) -> torch.Tensor | None:
    val = fake_value(node)
    return val if isinstance(val, torch.Tensor) else None


def _swaps_last_two(node: Node) -> bool:
    """A transpose of the last two dims of the node's input, nothing else moved."""
    val = _tensor(node.args[0])
    if val is None or val.dim() < 2:
        return False
    n = val.dim()
    if node.target is aten.t.default:
        return n == 2
    if node.target is aten.transpose.int:
        return sorted(d % n for d in node.args[1:3]) == [n - 2, n - 1]
    if node.target is aten.permute.default:
        return [d % n for d in node.args[1]] == [*range(n - 2), n - 1, n - 2]
    return False


def _peel(node: Node) -> tuple[Node, float, bool] | None:
    """(input, factor, transposes) if ``node`` is its one tensor input times a number, maybe
    transposed; None for any other node."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
        return None
    target, source = node.target, node.args[0]
    out, val = _tensor(node), _tensor(source)
    if out is None or val is None:
        return None
    if target in _COPIES or (target in _RESHAPES and out.shape == val.shape) \
            or (target in CAST_OPS and out.dtype == val.dtype):
        return source, 1.0, False
    if target is aten.neg.default:
        return source, -1.0, False
    if target in _MULS and len(node.args) == 2 and _number(node.args[1]):
        return source, float(node.args[1]), False
    if target in _DIVS and len(node.args) == 2 and not node.kwargs and _number(node.args[1]) and node.args[1] != 0:
        return source, 1.0 / node.args[1], False
    if target in (aten.t.default, aten.transpose.int, aten.permute.default) and _swaps_last_two(node):
        return source, 1.0, True
    return None


def resolve(node: Node, path: list[Node] | None = None, scaled: bool = True) -> tuple[Operand, float]:
    """``node``'s values as factor · operand: through copies, same-shape views, transposes and (with
    ``scaled``) products with numbers. The nodes passed through are appended to ``path``."""
    factor, transposed = 1.0, False
    while (step := _peel(node)) is not None and (scaled or step[1] == 1.0):
        if path is not None:
            path.append(node)
        node, f, flip = step
        factor *= f
        transposed ^= flip
    return Operand(node, transposed), factor


class Expansion:
    """``node``'s values as Σ coefficient · term, a term an ``Operand`` or a ``Product``.

    Sums, differences, products with numbers and matmuls (``addmm``'s bias too)
    are opened; an operand whose node is in ``stop`` (values the caller names:
    the X and A of an iteration) or is anything else stays a term, as does
    everything once ``_MOST_OPENED`` nodes are passed. The top node is opened
    even when it is in ``stop``. ``nodes`` are those the expansion passed
    through.
    """

    def __init__(self, node: Node, stop: set[Node]):
        self.terms: dict[Operand | Product, float] = defaultdict(float)
        self.nodes: list[Node] = []
        self.stop = stop
        self._add(node, 1.0, top=True)

    def _add(self, node: Node, coefficient: float, top: bool = False) -> None:
        operand, factor = resolve(node, self.nodes)
        coefficient *= factor
        core = operand.node
        if operand.transposed or (core in self.stop and not top) or core.op != "call_function" \
                or len(self.nodes) >= _MOST_OPENED:
            self.terms[operand] += coefficient
            return
        target, args = core.target, core.args
        alpha, beta = core.kwargs.get("alpha", 1), core.kwargs.get("beta", 1)
        if not (_number(alpha) and _number(beta)):  # a traced scalar: no constant coefficient
            self.terms[operand] += coefficient
        elif target in ADDS and len(args) == 2 and all(isinstance(a, Node) and _tensor(a) is not None
                                                        for a in args):
            self.nodes.append(core)
            self._add(args[0], coefficient)
            self._add(args[1], ADDS[target] * alpha * coefficient)
        elif target in MATMULS:
            self.nodes.append(core)
            self._product(args[0], args[1], coefficient)
        elif target in BIASED_MATMULS:
            self.nodes.append(core)
            if beta != 0:
                self._add(args[0], beta * coefficient)
            self._product(args[1], args[2], alpha * coefficient)
        else:
            self.terms[operand] += coefficient

    def _product(self, left: Node, right: Node, coefficient: float) -> None:
        (a, fa), (b, fb) = resolve(left, self.nodes), resolve(right, self.nodes)
        self.terms[Product(a, b)] += fa * fb * coefficient

    def only(self, kind: type) -> list:
        """The terms of one kind (``Operand`` or ``Product``), with a nonzero coefficient."""
        return [t for t, c in self.terms.items() if isinstance(t, kind) and c != 0]
