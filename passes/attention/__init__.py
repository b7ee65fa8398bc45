"""Joint pass: rewrite attention as people write it into our FlashAttention op.

Runs on AOTAutograd's joint forward+backward graph (or an inference graph),
aten level, after Inductor's decompositions. Two families are recognised:

1. Written-out attention: Q·Kᵀ (``bmm``, as ``@``/``matmul``/``einsum``/
   einops lower to it, or ``baddbmm(mask, Q, Kᵀ)`` as nn.MultiheadAttention
   writes it) → optional scale → optional causal mask → softmax over keys →
   ``bmm(P, V)``, with dtype casts anywhere. The match is structural rather
   than one traced pattern per idiom: idioms × dtypes × which inputs need
   grads would be hundreds of traced joint patterns (~0.7 s each).

   - Scale: mul/div by a positive number, or by a tensor that evaluates to
     one (``torch.sqrt(torch.tensor(d))``). A scale on Q (or K) beforehand,
     learned or not, stays in the graph and the op gets 1 for it. A learned
     one-element temperature on the scores is moved onto Q (s·QKᵀ =
     (s·Q)Kᵀ): dQ = s·dQ', and the backward's sum giving its grad is
     replaced by Σ dQ'⊙Q. Only before the mask: applied after it, a
     negative value would flip the masked entries (left alone with a note).
   - Mask: ``where``/``masked_fill`` with a fill at or below −1e4 (a number
     or a constant tensor, either branch order) or an added 0/−inf bias, in
     any order with the scale. The mask is evaluated symbolically as a
     function of (query i, key j) from how the graph builds it (iota/arange
     compared however broadcast: unsqueeze, None-indexing, view, expand;
     ones/full with tril/triu; logical ops, casts, arithmetic; constant
     tensors the graph holds, read as a diagonal split of the grid) and must
     be exactly ``j <= i``. A mask from a graph input (a buffer such as
     nanoGPT's ``bias``, or one made outside a repeated block) reaches this
     pass built in the graph where its values were one diagonal split when
     compiled (``compile_stack/backend/input_masks.py`` rebuilds it and guards the
     compiled graph); any other is left alone with a note.
   - Softmax: ``_softmax``, or exp/sum/div with or without the max subtracted.
   - Layout: between the scores' ops and between P and the bmm, any chain of
     views/permutes/unsqueezes whose composition keeps the element order (an
     einsum's permute and its inverse), replayed on a meta tensor.

   The backward is not matched op by op: autograd of ``bmm(A, B)`` with
   output grad ``G`` always yields ``bmm(G, Bᵀ)`` and ``bmm(Aᵀ, G)``, so the
   grads of the three bmm operands (the "exits") and the grad of the output
   are found from the two products alone. Everything between (scores,
   softmax, its backward: every S×S tensor) must feed nothing but the output
   bmm and the exits, which is checked before anything changes, and dies
   with them. The op works on the bmm operands themselves ([B·H, S, D]), so
   grouped-query attention whose k/v heads were repeated
   (``repeat_interleave``, ``expand`` + reshape) is matched as it is. Where
   v's operand is matmul's dense copy of heads split off a projection
   (``view`` + ``transpose``), the op reads that split view in place
   instead ([B, H, S, D], q and k viewed alike).
2. ``F.scaled_dot_product_attention`` (its aten flash/efficient/cuDNN/CPU
   kernels and their backward ops) without dropout: ``is_causal``, no mask,
   or an ``attn_mask`` proven causal as above (bool: True keeps; float:
   0/−inf); with fewer k/v heads (``enable_gqa``) they are repeated for the
   op and their grads summed back over each group.

Either way the op lays out and dv out like v (``custom_ops/attention/layouts.py``): merging
heads after it (transpose, then reshape/view/flatten) and dv's way back into its projection then
need no copy, and the rewrite drops those copies from the graph (``rewrite._merge_as_view``).

Anything else that looks like a softmax over a Q·Kᵀ product (dropout on the
weights, a non-causal or unknown mask, a learned scale after the mask or per
head, unsupported head dims) is left alone with a ``note`` saying why.

The modules, by role: ``masks`` (the symbolic mask evaluation and the causal proofs), ``written_out``
(family 1's match), ``sdpa`` (family 2's), ``rewrite`` (the replacement for both), ``common`` (the
pass's name, casts and shapes they share).
"""
import torch

from passes.attention.common import NAME, _shape
from passes.attention.masks import _KEEP_CAUSAL, Piecewise, _tensor_value
from passes.attention.rewrite import _rewrite, _sdpa_rewrite
from passes.attention.sdpa import SDPA_OPS, _sdpa_plan
from passes.attention.written_out import _chain_keeps_order, _looks_like_attention, _match_softmax, _plan
from passes.graph_edit import reachable
from passes.registry import note, register_pass
from passes.rejection import NoMatch

# The tests check the mask evaluation and the layout replay directly.
__all__ = ["NAME", "replace_attention", "Piecewise", "_KEEP_CAUSAL", "_tensor_value", "_chain_keeps_order"]


@register_pass(NAME, stage="joint")
def replace_attention(graph: torch.fx.Graph) -> int:
    """Rewrite naive attention and SDPA (fwd and bwd together) into cstack.flash_attention_{fwd,bwd}."""
    tangents = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    tangent_deps = reachable(tangents, lambda n: n.users)
    replaced, gone, tried = 0, set(), set()
    order = {n: i for i, n in enumerate(graph.nodes)}  # of the original nodes, which rewrites keep
    for node in list(graph.nodes):
        if node in gone or node.op != "call_function" or node in tangent_deps:
            continue
        if node.target in SDPA_OPS:
            try:
                plan = _sdpa_plan(node)
            except NoMatch as e:
                note(NAME, f"left {node} alone: {e}")
                continue
            gone |= _sdpa_rewrite(graph, node, plan)
            replaced += 1
            continue
        softmax = _match_softmax(node)
        # The hand softmax's backward recomputes exp/sum: try each softmax input once.
        if softmax is None or softmax[0] in tried or len(_shape(softmax[0]) or ()) < 2:
            continue
        tried.add(softmax[0])
        try:
            plan = _plan(node, softmax[0], tangent_deps)
        except NoMatch as e:
            if _looks_like_attention(softmax[0]):
                note(NAME, f"left softmax {node} over a Q·Kᵀ-like product alone: {e}")
            continue
        gone |= _rewrite(graph, plan, order)
        replaced += 1
    return replaced
