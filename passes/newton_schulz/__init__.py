"""Joint pass: a hand-written Newton–Schulz loop becomes one ``cstack::newton_schulz`` call.

Muon orthogonalises each update matrix by k iterations of

    A = X Xᵀ;  B = b·A + c·A A;  X ← a·X + B X

written out in plain torch (a Python loop Dynamo unrolls). A compiled
``optimizer.step`` reaches the joint stage as an aten inference graph, where
every spelling of one iteration (``X @ X.mT``, ``X.T``, ``transpose(-2, -1)``,
``torch.mm``/``matmul``/``bmm``; ``b * A + c * A @ A``, ``c * (A @ A)``,
``torch.addmm(A, A, A, beta=b, alpha=c)``/``baddbmm``; ``a * X + B @ X``,
``torch.addmm(X, B, X, beta=a)``; 2-D X or a batch of them) is a few ``mm``/
``bmm``, ``addmm``/``baddbmm``, ``mul``, ``add`` and view nodes. The pass finds
them by data flow and reads (a, b, c) off the graph's constants (``chains``;
``terms`` is how it reads a value). A chain of k iterations with Muon's quintic
coefficients ``MUON_COEFFICIENTS`` in each becomes

    X_k = cstack::newton_schulz(X_0, k, a, b, c)

which computes the same iterations in one call. What the user does around the
loop (the cast to bf16, the normalisation, the transposes) stays as written.

Left alone, with a note: a chain with other coefficients (the op is measured
and tested for Muon's), one not in bf16 (fp32, fp16: the op is bf16), X of
another rank than 2 or 3, and a chain one of whose values (an A, a B, an X in
the middle, a step to them) something outside the chain also reads — the
chain could only be rewritten in part there, and is not. Where the
coefficients change within a chain, each stretch of equal ones is a chain of
its own.

The op runs on CUDA and CPU tensors, so the rewrite is made on both.
"""
import torch
from torch.fx import Graph

from custom_ops.newton_schulz import MUON_COEFFICIENTS
from passes.graph_edit import erase_dead, fake_value, insert_call
from passes.newton_schulz.chains import Iteration, chains, check_isolated, find_iterations, runs
from passes.registry import note, register_pass
from passes.rejection import NoMatch

NAME = "newton_schulz"
aten = torch.ops.aten


def _describe(run: list[Iteration]) -> str:
    return f"the Newton–Schulz chain of {len(run)} iteration{'s' * (len(run) > 1)} on {run[0].x}"


def _check_run(run: list[Iteration]) -> None:
    """NoMatch unless the op computes exactly this run: Muon's coefficients, bf16, 2-D or 3-D."""
    if not run[0].same_coefficients(MUON_COEFFICIENTS):
        got = ", ".join(f"{c:.6g}" for c in run[0].coefficients)
        raise NoMatch(f"its coefficients ({got}) are not Muon's {MUON_COEFFICIENTS}")
    x = fake_value(run[0].x.node)
    if x.dim() not in (2, 3):
        raise NoMatch(f"X has rank {x.dim()}, not 2 or 3")
    for node in (run[0].x.node, *(n for it in run for n in (it.gram, it.b, it.out))):
        dtype = fake_value(node).dtype
        if dtype != torch.bfloat16:
            raise NoMatch(f"{node.name} is {dtype}, not bfloat16")


def _rewrite(graph: Graph, run: list[Iteration]) -> None:
    """The run's last X' computed by one call on its first X."""
    last = run[-1].out
    with graph.inserting_before(last):
        x = run[0].x.node
        if run[0].x.transposed:
            n = fake_value(x).dim()
            x = insert_call(graph, aten.permute.default, (x, [*range(n - 2), n - 1, n - 2]))
        call = insert_call(graph, torch.ops.cstack.newton_schulz.default, (x, len(run), *MUON_COEFFICIENTS))
    last.replace_all_uses_with(call)
    erase_dead(graph, [node for it in run for node in it.nodes])


@register_pass(NAME, stage="joint")
def fuse_newton_schulz(graph: Graph) -> int:
    """Replace each chain of Muon Newton–Schulz iterations by one ``newton_schulz`` call."""
    replaced = 0
    for chain in chains(find_iterations(graph)):
        try:
            check_isolated(chain)
        except NoMatch as why:
            note(NAME, f"left {_describe(chain)} alone: {why}")
            continue
        accepted = []
        for run in runs(chain):
            try:
                _check_run(run)
            except NoMatch as why:
                note(NAME, f"left {_describe(run)} alone: {why}")
            else:
                accepted.append(run)
        for run in reversed(accepted):  # a later run's first X is an earlier one's last X', still there
            _rewrite(graph, run)
        replaced += len(accepted)
    return replaced
