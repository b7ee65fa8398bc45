"""Joint pass: the compiled AdamW update becomes one ``cstack::fused_adamw_`` call.

A compiled ``optimizer.step`` reaches the joint stage as a functionalized
inference graph: per parameter a chain of elementwise aten ops (plain, or
``_foreach_*`` ops over lists) computes new values of the parameter ``p`` and
its moments ``m`` and ``v`` from them and the gradient ``g``, and an epilogue
``copy_`` writes them back into those graph inputs. This pass replaces every
such chain, with the epilogue, by one call of our fused op over lists, which
updates the inputs in place. It knows no particular optimizer's code; it
finds and proves the update:

1. Roles, from data flow alone: ``m`` and ``v`` are mutated inputs whose new
   value reads only themselves and one unmutated input ``g``; ``p`` is a
   mutated input whose new value reads exactly ``p``, ``m``, ``v`` and that
   same ``g``; all four of one shape. Foreach ops are followed element by
   element. A moment's new value may instead be *returned* by the graph
   (Dynamo stores it into the optimizer's state): from a zero tensor the
   graph creates (state made lazily, on the first step), or from an unmutated
   input (``state['m'] = b1 * m + ...``, stored back out of place); of the two
   tensors such a value reads, the moment is the one no other returned value
   reads. The fused call then updates the zero tensor, or a clone of the
   input (which keeps its value, as in eager), in place and the graph returns
   that. A chain may also read scalar inputs (SymInts, SymFloats, 0-d
   tensors: the step, torch.optim's 0-d step tensor, an lr a scheduler
   changes, a tensor lr), constants and 0-d constant tensors, through
   whitelisted elementwise ops and Python scalar arithmetic only. A scalar
   input that an exponent of a power reads is a *step* input; any other is a
   *hyperparameter* input.
2. Semantics, by identity testing: the chain is evaluated in float64 on
   probe values (special points that read off β₁, β₂ (in [0, 1)), the decay
   1 − lr·wd, the update's scale A and its eps term E (>= 0); then random and tiny values) at
   several values of its scalar inputs (step inputs at several steps,
   hyperparameter inputs scaled independently), and must equal the AdamW
   update with the extracted coefficients to 1e-9 — in the reference form
   (eps outside the bias correction) or torch.optim's (eps scaled by
   √(1 − β₂ᵗ)). β₁, β₂, eps and the weight decay must be the same at every
   probe; lr may change. The step t is the exponent of the graph's β₁ᵗ/β₂ᵗ
   powers and becomes the op's ``step`` tensor. An lr that is the same at
   every probe is a constant of the call; one that changes (a scalar input,
   or computed in the step from the step count: warmup, cosine) must be, at
   every probe, a constant multiple k of one scalar value the graph computes
   (the input itself, a cast of it, lr·wd...): that value times k becomes the
   op's ``lr`` tensor. A chain with no step input (the reference optimizer's
   first compile, t baked in) is rewritten with step 1 and the lr/weight
   decay that give the same update. Anything else is left alone with a
   ``note``.

Chains with equal coefficients and the same lr source form one call (torch.optim param
groups with different lr/wd give one call each); the pass returns the number of fused
calls inserted, normally 1 per optimizer graph. torch.optim keeps one step
tensor per parameter; the call takes the first and, where a group has
several, an in-graph ``_assert_async`` checks at run time that they are equal
(they differ only for a parameter that missed updates: then the step fails
loudly rather than update it with the wrong bias correction).

The modules, by role: ``roles`` (step 1), ``proof`` (step 2), ``rewrite`` (the fused call),
``common`` (op names, data flow and the update chain they share).
"""
from torch.fx import Graph

from passes.adamw.common import NAME, _accepted, _Chain, _Flow, _op_name, _returned
from passes.adamw.proof import _prove
from passes.adamw.rewrite import _check_isolated, _fuse
from passes.adamw.roles import _check_elementwise, _find_chains
from passes.graph_edit import erase_dead, fake_value
from passes.registry import note, register_pass
from torch_internals import fx

__all__ = ["NAME", "fuse_adamw", "_op_name"]  # _op_name: the tests name ops as the pass does


@register_pass(NAME, stage="joint")
def fuse_adamw(graph: Graph) -> int:
    """Replace AdamW per-parameter update chains (reference, torch.optim single/foreach) by fused calls."""
    flow = _Flow()
    chains = _accepted(_find_chains(graph, flow), _check_elementwise, flow)
    if not chains:
        return 0
    order = {node: i for i, node in enumerate(graph.nodes)}
    with fx.unset_fake_temporarily():  # the probes are real float64 tensors, even inside a compile
        chains = _prove(chains, graph, flow, order)
    if not chains:
        return 0
    insert_at = min((c.copies[x] for c in chains for x in (c.p, c.m, c.v) if x in c.copies),
                    key=order.__getitem__)
    chains = _accepted(chains, _check_isolated, flow, order, insert_at)
    groups: dict[tuple, list[_Chain]] = {}
    for chain in chains:
        groups.setdefault((chain.coefficients, chain.lr, chain.step is None), []).append(chain)

    placeholders = [fake_value(n) for n in graph.nodes if n.op == "placeholder"]
    fake_mode = fx.detect_fake_mode(placeholders)
    fused = []
    for group in groups.values():
        before = set(graph.nodes)
        try:
            with graph.inserting_before(insert_at):
                _fuse(graph, group, fake_mode)
        except ValueError as e:  # the op's checks, run on the fake values, refused the arguments
            for node in reversed([n for n in graph.nodes if n not in before]):
                graph.erase_node(node)
            note(NAME, f"left {len(group)} AdamW updates alone: the fused op refuses them ({e})")
            continue
        fused.append(group)
    output = graph.find_nodes(op="output")[0]
    for chain in (c for group in fused for c in group):
        for x in (chain.p, chain.m, chain.v):
            if _returned(chain, x):  # the graph returns the tensor the call updated
                output.replace_input_with(chain.new[x], chain.buffers[x])
            else:
                graph.erase_node(chain.copies[x])
    erase_dead(graph, set().union(*(c.nodes for group in fused for c in group)))
    return len(fused)
