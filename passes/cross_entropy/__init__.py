"""Joint pass: LM head + cross-entropy → ``cstack::linear_cross_entropy_fwd``.

A user's ``logits = x @ Wᵀ`` ([T, V]: 20 GB at the full config), a log-softmax,
a pick of each row's target and a reduction: the backward builds the [T, V]
logits gradient again and feeds it to two matmuls. In the joint graph this pass
replaces the whole chain, forward and backward together:

    loss, gh, gw, gb = linear_cross_entropy_fwd(hidden, weight, targets', ignore, "sum", bias)
    d hidden = gh · g,   d weight = gw · g,   d bias = gb · g    (g: d output / d loss, built here)

so no [T, V] tensor is left in either graph. The loss is recognised by what it
computes, on the decomposed aten graph (every spelling below ends up there):

1. The rows. ``CE_row = −pick(log_softmax(L))`` or ``logsumexp(L) − pick(L)``, the
   vocabulary at any dim ``vd`` of ``L`` (``logits.transpose(1, 2)``: vd 1), where
   - log_softmax is ``_log_softmax``, ``s − log Σ exp s`` or ``s − logsumexp s`` with
     ``s = L`` or ``L − c``, c a row max (amax, max.values, logsumexp's own): any
     row constant cancels, so which one does not matter; a ``neg`` flips the sign;
   - pick is ``gather`` along vd by the targets unsqueezed at vd, advanced indexing
     ``[arange(T), y]`` (2-D), or ``Σ_vd one_hot(y) · x`` (vocabulary last);
   - a row may then be masked: ``where(cond, r, 0)`` or ``r · m`` with m provably
     0/1 valued (a bool, a cast bool, ones with zeroed slices...) and not derived
     from the logits; masks become ``targets' = where(all masks, targets, IGNORE)``.
     Where the only masks are ``targets != k`` (F.cross_entropy's ignore_index,
     ``mask = (y != pad)``), the op's ignore_index is k and targets stay as they are.
2. The reduction: ``sum`` or ``mean`` of every row, then a chain of scalar ops to
   the graph's loss output: neg, times or divided by anything not computed from the
   logits (F.cross_entropy's count of kept targets, ``mask.sum()``, 3.7), plus or
   minus such a term, casts. The op always sums; the user's own scalar chain stays
   in the forward, and the pass differentiates it (one multiply per op) for g.
3. ``L`` must be a reshape (views, optional upcast) of a matmul ``mm(A, B)`` (``bmm``
   with batch 1 from einsum), possibly plus a bias (``addmm(b, A, B)``, or the matmul's
   output reshaped, vocabulary last, plus b: V elements of a graph input, a parameter),
   possibly with whole rows sliced away first
   (``logits[:, :-1]``: the same slice is taken of the hidden, and its gradient is
   scattered back). The projection's backward matmuls ``mm(G, Bᵀ)`` and
   ``mm(Aᵀ, G)`` are found by their operands, the bias's gradient as the sum of G
   over its rows (a bias with no such sum is frozen, if G then dies). Views are
   compared by replaying them on (possibly symbolic) fake tensors, so any spelling
   of "the same elements" matches, at a symbolic sequence length too.
4. The rewrite is made only if the projection's output then dies: any other use of
   the logits (an extra loss term, returned logits) leaves the graph alone, with a
   note, as does a softmax over a weight projection that nothing above matched
   (label smoothing, focal loss, z-loss, float weights per token).

The op computes in fp32 with an fp32 log-sum-exp: more accurate than a
hand-written bf16 log-softmax, by design. Its loss comes back in the matmul's
dtype, so a loss the user took in fp32 over bf16 logits (``.float()`` first) is
rounded to bf16 (gradients are not affected).

The modules, by role: ``loss`` (steps 1–2), ``head`` (3), ``candidates`` (4, and the notes),
``rewrite`` (the replacement), ``common`` (op sets and view bookkeeping they share).
"""
import torch

from passes.cross_entropy.candidates import _find, _note_unmatched_softmaxes
from passes.cross_entropy.common import PASS, aten
from passes.cross_entropy.rewrite import _rewrite
from passes.registry import register_pass
from torch_internals import inductor


@register_pass(PASS, stage="joint")
def fuse_linear_cross_entropy(graph: torch.fx.Graph) -> int:
    """Replace LM-head matmul + cross-entropy (forward and backward) by the fused chunked op."""
    if not any(n.op == "call_function" and n.target is aten.exp.default for n in graph.nodes):
        return 0
    inductor.remove_noop_ops(graph)
    inductor.early_patterns.apply(graph)
    found, taken = _find(graph)
    _note_unmatched_softmaxes(graph, taken)
    if not found:
        return 0
    for c in found:
        _rewrite(graph, c)
    inductor.stable_topological_sort(graph)
    graph.eliminate_dead_code()
    return len(found)
