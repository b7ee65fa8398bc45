"""Matching: Newton–Schulz iterations found by data flow, linked into chains.

An iteration reads an iterate X and computes ``A = X Xᵀ``, ``B = b·A + c·A A``
and ``X' = a·X + B X``. It is found from its Gram matrix: a matmul whose two
operands are one value and its transpose (``X @ X.mT``, ``torch.mm(X, X.T)``...)
names a candidate A and its X. A node X' whose expansion (``terms``) is a
multiple of X plus a product ``B @ X``, where B expands to a multiple of A plus
a product ``A @ A``, is the next iterate. Scales anywhere on the way (``c * A
@ A`` is ``(c·A) @ A``, an ``alpha``, a scaled Gram matrix) fold into the
coefficients (a, b, c) of ``X' = a·X + b·(X Xᵀ) X + c·(X Xᵀ)² X``.

An iteration whose X is the X' of another follows it: a chain is such a
sequence, and its *runs* are its stretches of equal coefficients.
"""
import dataclasses
import math
from collections.abc import Iterator

from torch.fx import Graph, Node

from passes.newton_schulz.terms import ADDS, BIASED_MATMULS, MATMULS, Expansion, Operand, Product, resolve
from passes.rejection import NoMatch

# Coefficients agree when equal to this relative tolerance (scales folded in differ by a rounding).
_RTOL = 1e-6


@dataclasses.dataclass(eq=False)
class Iteration:
    """One step ``X' = a·X + B X``, ``B = b·A + c·A A``, ``A = X Xᵀ``."""

    x: Operand  # the iterate it reads
    out: Node  # the node holding the next iterate
    coefficients: tuple[float, float, float]  # (a, b, c)
    gram: Node  # A
    b: Node  # B
    nodes: set[Node]  # every node it passed through, ``out`` included

    def same_coefficients(self, other: "Iteration | tuple") -> bool:
        theirs = other.coefficients if isinstance(other, Iteration) else other
        return all(math.isclose(x, y, rel_tol=_RTOL) for x, y in zip(self.coefficients, theirs))


def _grams(graph: Graph) -> dict[Node, tuple[Operand, float, list[Node]]]:
    """Matmuls of a value by its own transpose: node -> (X, scale, nodes passed through)."""
    grams = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target in MATMULS:
            path = []
            (left, fl), (right, fr) = resolve(node.args[0], path), resolve(node.args[1], path)
            if left.node is right.node and left.transposed != right.transposed:
                grams[node] = (left, fl * fr, path)
    return grams


def _match(node: Node, grams: dict, stop: set[Node]) -> Iteration | None:
    """The iteration whose X' is ``node``, if it is one."""
    new = Expansion(node, stop)
    operands, products = new.only(Operand), new.only(Product)
    if len(operands) != 1 or len(products) != 1:
        return None
    x = operands[0]
    if products[0].right != x or products[0].left.transposed:
        return None
    b = Expansion(products[0].left.node, stop)
    grams_read, squares = b.only(Operand), b.only(Product)
    if len(grams_read) != 1 or len(squares) != 1:
        return None
    gram = grams_read[0]
    if gram.transposed or gram.node not in grams or squares[0] != Product(gram, gram):
        return None
    gram_x, scale, path = grams[gram.node]
    if gram_x != x:
        return None
    k = new.terms[products[0]]
    coefficients = (new.terms[x], k * b.terms[gram] * scale, k * b.terms[squares[0]] * scale**2)
    return Iteration(x, node, coefficients, gram.node, products[0].left.node,
                     {*new.nodes, *b.nodes, gram.node, *path})


def find_iterations(graph: Graph) -> list[Iteration]:
    """Every Newton–Schulz iteration of the graph, in graph order."""
    grams = _grams(graph)
    if not grams:
        return []
    # A and X stay whole in the expansions: an X' is opened only as the top of its own.
    stop = set(grams) | {x.node for x, _, _ in grams.values()}
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and (node.target in ADDS or node.target in BIASED_MATMULS):
            iteration = _match(node, grams, stop)
            if iteration is not None:
                found.append(iteration)
    return found


def chains(iterations: list[Iteration]) -> Iterator[list[Iteration]]:
    """The maximal sequences of iterations, each reading the X' of the one before. An X' that
    several iterations read ends its chain; each of them starts one."""
    by_out = {it.out: it for it in iterations}
    before = {it: by_out.get(it.x.node) if not it.x.transposed else None for it in iterations}
    follows: dict[Iteration, list[Iteration]] = {}
    for it, prev in before.items():
        if prev is not None:
            follows.setdefault(prev, []).append(it)
    for head in iterations:
        if before[head] is not None and len(follows[before[head]]) == 1:
            continue
        chain = [head]
        while len(follows.get(chain[-1], ())) == 1:
            chain.append(follows[chain[-1]][0])
        yield chain


def check_isolated(chain: list[Iteration]) -> None:
    """NoMatch unless nothing outside the chain reads a value it computes (an A, a B, an X in
    the middle, or any step to them), the last X' aside. Views of its first X are not its own."""
    nodes = set().union(*(it.nodes for it in chain))
    first = chain[0].x.node
    for node in nodes - {chain[-1].out}:
        if resolve(node, scaled=False)[0].node is first:
            continue
        outside = [user for user in node.users if user not in nodes]
        if outside:
            raise NoMatch(f"{node.name} is also read by {outside[0].name}")


def runs(chain: list[Iteration]) -> list[list[Iteration]]:
    """The chain cut where its coefficients change."""
    cut = [[chain[0]]]
    for it in chain[1:]:
        if it.same_coefficients(cut[-1][-1]):
            cut[-1].append(it)
        else:
            cut.append([it])
    return cut
