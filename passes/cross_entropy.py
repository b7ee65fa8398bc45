"""Joint pass: LM head + cross-entropy → ``cstack::linear_cross_entropy_fwd``.

The reference computes ``logits = x @ Wᵀ`` ([T, V]: 20 GB at the full config),
a hand-written log-softmax, a gather and a mean; its backward builds the
[T, V] logits gradient again and feeds it to two matmuls. In the joint graph
this pass replaces the whole chain, forward and backward together:

    loss, gh, gw = linear_cross_entropy_fwd(hidden, weight, targets, ...)
    d hidden = gh · g,   d weight = gw · g          (g: the loss's upstream gradient)

so no [T, V] tensor is left in either graph. It works in three steps:

1. The cross-entropy on 2-D logits is recognized with Inductor's pattern
   matcher: each idiom we accept (hand-written max/amax/logsumexp forms and
   F.cross_entropy / log_softmax + nll_loss, mean or sum) is traced forward and
   backward (``joint_fwd_bwd``) into a pattern whose outputs are the loss and
   the logits' gradient, and whose placeholders bind ``logits``, ``targets`` and
   the loss's upstream gradient ``tangents_1``. The real graph is first
   normalized the way those traces are (no-op views, aliases, view pairs):
   Inductor runs the same normalizations right after this pass anyway.
2. ``logits`` must be a reshape (views, optional fp32 upcast) of a matmul
   ``mm(A, B)`` (``bmm`` with batch 1 from einsum), whose two backward matmuls
   ``mm(G, Bᵀ)`` and ``mm(Aᵀ, G)`` consume a reshape of the matched logits
   gradient. Views are compared by replaying them on meta tensors, so any
   spelling of "the same elements" matches.
3. The rewrite is made only if the logits and their gradient then die: any
   other use of them (an extra loss term, returning logits) leaves the graph
   alone, with a note, as does a softmax over a weight projection that no
   pattern matched (label smoothing, z-loss...).

The op computes in fp32 with an fp32 log-sum-exp: more accurate than a
hand-written bf16 log-softmax, by design. Its loss comes back in the matmul's
dtype, so a loss the user took in fp32 over bf16 logits (``.float()`` first) is
rounded to bf16 (gradients are not affected). Hand-written forms have no
ignore_index; they get ``NO_IGNORE`` (int64 min), which no valid target equals.
"""
import functools
import operator

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch._inductor.fx_passes.joint_graph import early_patterns
from torch._inductor.fx_passes.post_grad import remove_noop_ops
from torch._inductor.pattern_matcher import gen_pattern, joint_fwd_bwd, stable_topological_sort

import custom_ops.linear_cross_entropy  # noqa: F401  (registers torch.ops.cstack.linear_cross_entropy_fwd)
from passes.graph_edit import fake_value, insert_call, reachable, save_for_backward
from passes.registry import note, register_pass

aten = torch.ops.aten
prims = torch.ops.prims
PASS = "cross_entropy"
NO_IGNORE = torch.iinfo(torch.int64).min

# Ops that reinterpret their input's elements without copying them.
_VIEW_OPS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.unsqueeze.default,
    aten.alias.default,
}
_MATMULS = {aten.mm.default, aten.bmm.default}
# Ops of the matched loss whose dim argument (args[1]) must be the vocabulary (last) dim.
_DIM_OPS = {
    aten.amax.default,
    aten.max.dim,
    aten.sum.dim_IntList,
    aten.logsumexp.default,
    aten.gather.default,
    aten.scatter.value,
    aten.scatter.src,
    aten.scatter_add.default,
}
# Ops that open a softmax: one of them over a weight projection is worth a note if unmatched.
_SOFTMAX_STARTS = {aten.amax.default, aten.max.dim, aten.logsumexp.default, aten._log_softmax.default}


# --- the cross-entropy idioms (logits [T, V], targets [T]) -------------------


def _hand_max(logits):
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    return shifted - torch.log(torch.exp(shifted).sum(dim=-1, keepdim=True))


def _hand_amax(logits):
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    return shifted - torch.log(torch.exp(shifted).sum(dim=-1, keepdim=True))


def _hand_logsumexp(logits):
    return logits - torch.logsumexp(logits, dim=-1, keepdim=True)


def _hand(log_probs_fn, reduction):
    def loss(logits, targets):
        picked = log_probs_fn(logits).gather(1, targets.unsqueeze(1))
        return -(picked.mean() if reduction == "mean" else picked.sum())

    return loss


def _library(reduction):
    # F.cross_entropy and log_softmax + nll_loss trace to the same graph; the
    # ignore_index value is an int the pattern ignores and we read off the match.
    def loss(logits, targets):
        return F.cross_entropy(logits, targets, reduction=reduction)

    return loss


# (search function, reduction, whether it has an ignore_index)
_IDIOMS = [
    (_library("mean"), "mean", True),
    (_library("sum"), "sum", True),
    *[(_hand(fn, r), r, False) for fn in (_hand_max, _hand_amax, _hand_logsumexp) for r in ("mean", "sum")],
]


@functools.cache
def _patterns():
    """Trace every idiom forward+backward in fp32 and bf16 (casts differ); drop duplicates.

    Runs on first use, inside a compile: traced on fake tensors of our own fake mode.
    """
    patterns = []
    with unset_fake_temporarily(), torch._guards.tracing(None), FakeTensorMode():
        for fn, reduction, has_ignore in _IDIOMS:
            for dtype in (torch.float32, torch.bfloat16):
                logits = torch.empty(8, 24, dtype=dtype, requires_grad=True)
                targets = torch.empty(8, dtype=torch.int64)
                pattern = gen_pattern(fn, [logits, targets], joint_fwd_bwd)
                if not any(pattern.pattern_eq(p) for p, _, _ in patterns):
                    patterns.append((pattern, reduction, has_ignore))
    return patterns


# --- view bookkeeping ----------------------------------------------------------


def _through_views(node, allow_convert, stop=None):
    """Walk up from ``node`` through views (and dtype casts if allowed), not past ``stop``.

    Returns (base, the ops from base to node).
    """
    chain = []
    while node is not stop and node.op == "call_function" and (
        node.target in _VIEW_OPS or (allow_convert and node.target is prims.convert_element_type.default)
    ):
        chain.append(node)
        node = node.args[0]
    return node, chain[::-1]


def _layout(node, allow_convert=False, stop=None):
    """(base, (shape, strides, offset)): which elements of ``base`` (row-major) ``node`` reads.

    Replays the view chain on a contiguous meta tensor shaped like the base; None if
    shapes are symbolic or the chain does not replay.
    """
    base, chain = _through_views(node, allow_convert, stop)
    val = fake_value(base)
    if not isinstance(val, torch.Tensor) or not all(isinstance(s, int) for s in val.shape):
        return base, None
    t = torch.empty(val.shape, device="meta")
    try:
        for n in chain:
            if n.target is not prims.convert_element_type.default:
                t = n.target(t, *n.args[1:], **n.kwargs)
    except (RuntimeError, TypeError):
        return base, None
    return base, (tuple(t.shape), tuple(t.stride()), t.storage_offset())


def _matrix(layout):
    """A matmul operand's layout as a matrix: drop bmm's batch dim, which must be 1 (else None)."""
    if layout is None:
        return None
    shape, strides, offset = layout
    if len(shape) == 3 and shape[0] == 1:
        shape, strides = shape[1:], strides[1:]
    return (shape, strides, offset) if len(shape) == 2 else None


def _transposed(layout):
    shape, strides, offset = layout
    return shape[::-1], strides[::-1], offset


def _is_reshape_of(node, base, rows, cols, allow_convert):
    """Whether ``node`` is ``base`` (a [rows, cols] tensor, row-major) reshaped, possibly cast."""
    found, layout = _layout(node, allow_convert, stop=base)
    if found is not base or layout is None:
        return False
    return _matrix(layout) == ((rows, cols), (cols, 1), 0)


# --- matching -------------------------------------------------------------------


def _dims_ok(match_nodes):
    """Reductions, gathers and scatters of the loss act on the vocabulary dim of 2-D tensors."""
    for n in match_nodes:
        if n.target in _DIM_OPS:
            source = fake_value(n.args[0])
            dims = n.args[1] if isinstance(n.args[1], (list, tuple)) else [n.args[1]]
            if source is None or source.dim() != 2 or [d % 2 for d in dims] != [1]:  # dim 1 or -1
                return False
    return True


def _ignore_index(match_nodes, targets, has_ignore):
    """The ignore_index of the match: one value in every `targets != k`; None if inconsistent."""
    if not has_ignore:
        return NO_IGNORE
    values = {
        n.args[1]
        for n in match_nodes
        if n.target is aten.ne.Scalar and _through_views(n.args[0], False)[0] is _through_views(targets, False)[0]
    }
    return values.pop() if len(values) == 1 and isinstance(next(iter(values)), int) else None


def _projection(logits):
    """The matmul whose output ``logits`` reshapes (views, upcast only); None otherwise."""
    val = fake_value(logits)
    if not isinstance(val, torch.Tensor) or val.dim() != 2:
        return None
    base, chain = _through_views(logits, allow_convert=True)
    if base.op != "call_function" or base.target not in _MATMULS:
        return None
    for n in chain:
        if n.target is prims.convert_element_type.default and n.args[1].itemsize < fake_value(base).dtype.itemsize:
            return None
    T, V = val.shape
    return base if _is_reshape_of(logits, base, T, V, allow_convert=True) else None


# Backward matmul of projection A @ B by operand roles → (gradient it holds, transposed?).
# Autograd writes each gradient either way round, depending on the operands' strides.
_GRAD_ROLES = {
    ("G", "Bt"): ("hidden", False),  # dA = G Bᵀ
    ("B", "Gt"): ("hidden", True),  # dAᵀ = B Gᵀ
    ("At", "G"): ("weight", True),  # dB = Aᵀ G = dWᵀ
    ("Gt", "A"): ("weight", False),  # dBᵀ = Gᵀ A = dW
}


def _backward_matmuls(projection, grad_logits):
    """The projection's backward matmuls: {"hidden"|"weight": (node, transposed)}; None if unclear.

    ``projection`` is mm(A, B) (or bmm with batch 1); G is the logits gradient reshaped to
    [T, V]. Operands are identified by the elements they read, whatever views lead to them.
    One of the two is absent when A or B needs no gradient.
    """
    (a_base, a_layout), (b_base, b_layout) = _layout(projection.args[0]), _layout(projection.args[1])
    a_matrix, b_matrix = _matrix(a_layout), _matrix(b_layout)
    if a_matrix is None or b_matrix is None:
        return None
    T, V = a_matrix[0][0], b_matrix[0][1]
    g_matrix = ((T, V), (V, 1), 0)
    known = {"G": (grad_logits, g_matrix), "A": (a_base, a_matrix), "B": (b_base, b_matrix)}

    def role(operand):
        for name, (base, matrix) in known.items():
            found, layout = _layout(operand, allow_convert=name == "G", stop=base)
            if found is base and _matrix(layout) in (matrix, _transposed(matrix)):
                return name if _matrix(layout) == matrix else name + "t"
        return None

    # Every matmul reached from grad_logits through views and casts.
    views = reachable([grad_logits], lambda n: [u for u in n.users if u.target in _VIEW_OPS
                                                 or u.target is prims.convert_element_type.default])
    matmuls = list(dict.fromkeys(u for v in views for u in v.users if u.target is projection.target))
    grads = {}
    for mm in matmuls:
        which = _GRAD_ROLES.get(tuple(role(x) for x in mm.args))
        if which is None or which[0] in grads:
            return None
        grads[which[0]] = (mm, which[1])
    return grads if grads else None


def _only_rewritten_uses(graph, replaced, new_inputs, dying):
    """Whether, once ``replaced`` nodes stop reading their inputs, every ``dying`` node is dead."""
    live = reachable([graph.output_node(), *new_inputs], lambda n: n.all_input_nodes, stop=replaced)
    return not (live & set(dying))


def _find(graph):
    """Candidate rewrites: one dict per cross-entropy over a projection that can be replaced."""
    found, taken = [], set()
    # Last node first: a mean's division is met before the sum it divides, which the
    # "sum" idiom would match too (correctly, but with the division left outside).
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node in taken:
            continue
        for pattern, reduction, has_ignore in _patterns():
            if node.target not in pattern.fns:
                continue
            m = pattern.match(node)
            if not m:
                continue
            logits, targets, tangent = m.kwargs["logits"], m.kwargs["targets"], m.kwargs["tangents_1"]
            loss, grad_logits = (m.ctx.pattern_to_node[p] for p in pattern.outputs[:2])
            projection = _projection(logits)
            if projection is None or projection in taken:
                continue
            ignore_index = _ignore_index(m.nodes, targets, has_ignore)
            why = _reject(m, projection, logits, targets, tangent, ignore_index)
            mms = None if why else _backward_matmuls(projection, grad_logits)
            if why is None and mms is None:
                why = "the projection's backward does not take the loss's logits gradient alone (other uses?)"
            if why is None:
                a, b = projection.args
                replaced = {loss, *(node for node, _ in mms.values())}
                if not _only_rewritten_uses(graph, replaced, (a, b, targets, tangent), (projection, grad_logits)):
                    why = "the logits or their gradient have other uses"
            if why:
                note(PASS, f"left {projection} alone: cross-entropy matched but {why}")
                taken.add(projection)
                break
            found.append(dict(projection=projection, loss=loss, targets=targets, tangent=tangent,
                              grads=mms, reduction=reduction, ignore_index=ignore_index))
            taken.update(m.nodes)
            taken.add(projection)
            break
    return found, taken


def _reject(m, projection, logits, targets, tangent, ignore_index):
    """Why a matched loss cannot become the op (None if it can)."""
    T = fake_value(logits).shape[0]
    t, g = fake_value(targets), fake_value(tangent)
    if t is None or t.dtype != torch.int64 or tuple(t.shape) != (T,):
        return "targets are not an int64 [T] tensor"
    if g is None or g.dim() != 0:
        return "its upstream gradient is not a scalar"
    if not _dims_ok(m.nodes):
        return "it reduces over a dim other than the vocabulary"
    if ignore_index is None:
        return "its ignore_index is not one constant"
    a, b = (fake_value(x) for x in projection.args)
    if a.dtype != b.dtype or a.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the projection's dtype {a.dtype} is not supported"
    return None


def _note_unmatched_softmaxes(graph, taken):
    """Note softmaxes over a weight projection's output (a matmul with a parameter) left in place."""
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _SOFTMAX_STARTS:
            continue
        base, _ = _through_views(node.args[0], allow_convert=True)
        if base.target not in _MATMULS or base in taken:
            continue
        weight, _ = _through_views(base.args[1], allow_convert=True)
        if weight.op == "placeholder":
            note(PASS, f"left {base} alone: a softmax ({node}) over its output matched no cross-entropy form")
            taken.add(base)


# --- rewriting --------------------------------------------------------------------


def _rewrite(graph, c):
    def emit(target, *args):
        return insert_call(graph, target, args)

    a, b = c["projection"].args
    with graph.inserting_before(c["loss"]):
        hidden = a if fake_value(a).dim() == 2 else emit(aten.squeeze.dim, a, 0)
        b2 = b if fake_value(b).dim() == 2 else emit(aten.squeeze.dim, b, 0)
        weight = emit(aten.permute.default, b2, [1, 0])
        out = emit(torch.ops.cstack.linear_cross_entropy_fwd.default, hidden, weight, c["targets"],
                   c["ignore_index"], c["reduction"])
        loss, grad_hidden, grad_weight = (emit(operator.getitem, out, i) for i in range(3))
        save_for_backward(out, loss, grad_hidden, grad_weight)
        if fake_value(loss).dtype != fake_value(c["loss"]).dtype:
            loss = emit(prims.convert_element_type.default, loss, fake_value(c["loss"]).dtype)
    c["loss"].replace_all_uses_with(loss)
    for which, (node, transposed) in c["grads"].items():
        grad = grad_hidden if which == "hidden" else grad_weight
        with graph.inserting_before(node):
            new = emit(aten.mul.Tensor, grad, c["tangent"])
            if transposed:
                new = emit(aten.permute.default, new, [1, 0])
            if fake_value(node).dim() == 3:
                new = emit(aten.unsqueeze.default, new, 0)
        node.replace_all_uses_with(new)


@register_pass(PASS, stage="joint")
def fuse_linear_cross_entropy(graph: torch.fx.Graph) -> int:
    """Replace LM-head matmul + cross-entropy (forward and backward) by the fused chunked op."""
    if not any(n.op == "call_function" and n.target is aten.exp.default for n in graph.nodes):
        return 0
    remove_noop_ops(graph)
    early_patterns.apply(graph)
    found, taken = _find(graph)
    _note_unmatched_softmaxes(graph, taken)
    if not found:
        return 0
    for c in found:
        _rewrite(graph, c)
    stable_topological_sort(graph)
    graph.eliminate_dead_code()
    return len(found)
