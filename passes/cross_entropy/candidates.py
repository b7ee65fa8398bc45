"""Finding the rewrites: each loss recognised over an LM head whose whole [T, V] chain can go, and
notes on the ones that cannot (step 4 of the package docstring)."""
import torch

from passes.cross_entropy.common import PASS, _HEAD_TO_LOGITS, _MATMULS, _call, _rank, _same, _through_views, aten
from passes.cross_entropy.head import _backward_matmuls, _bias_gradient, _head, _projection
from passes.cross_entropy.loss import _ignore_index, _recognise, _scalar_chain
from passes.graph_edit import fake_value, reachable
from passes.registry import note
from passes.rejection import NoMatch

# Ops that open a softmax: one of them over a weight projection is worth a note if unmatched.
_SOFTMAX_STARTS = {aten.amax.default, aten.max.dim, aten.logsumexp.default, aten._log_softmax.default}


def _reductions(graph, backward):
    for node in graph.nodes:
        if node in backward or not _call(node, aten.sum.default, aten.mean.default, aten.sum.dim_IntList):
            continue
        val, source = fake_value(node), fake_value(node.args[0])
        if isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point() \
                and isinstance(source, torch.Tensor) and source.dim() >= 1:
            yield node


def _find(graph):
    """Candidate rewrites: one dict per cross-entropy over a projection that can be replaced."""
    tangents = tangents_of(graph)
    if not tangents:
        return [], set()
    backward = reachable(tangents, lambda n: n.users)
    backward_mms = [n for n in graph.nodes if n in backward and n.target in _MATMULS]
    found, taken = [], set()
    for reduce in _reductions(graph, backward):
        loss = _recognise(reduce, frozenset())
        if loss is None:
            continue
        proj = _projection(loss)
        if proj is None:
            _note_logits_from_another_graph(loss)
            continue
        if proj[0] in taken:
            continue
        projection, row_ops, bias = proj
        taken.add(projection)
        try:
            found.append(_candidate(graph, loss, projection, row_ops, bias, backward, backward_mms, tangents[0]))
        except NoMatch as why:
            note(PASS, f"left {projection} alone: cross-entropy matched but {why}")
    return found, taken


def _candidate(graph, loss, projection, row_ops, bias, backward, backward_mms, tangent):
    """The rewrite of ``loss`` over ``projection``; NoMatch if the [T, V] chain cannot all go.

    A bias with no gradient found is frozen if G then dies; if G lives on, its gradient was missed."""
    _check_supported(loss, projection, bias)
    mms = _backward_matmuls(projection, backward_mms)
    if mms is None:
        raise NoMatch("its backward matmuls are not found (or not fed by one logits gradient)")
    chain = _scalar_chain(loss.reduce, backward, frozenset(), graph)
    if chain is None:
        raise NoMatch("the loss reaches the output through something other than scalar scaling")
    grads, g_base = mms
    bias_grad = None if bias is None else _bias_gradient(projection, g_base, backward)
    if bias_grad is not None:
        grads["bias"] = (bias_grad, False)
    replaced = {loss.reduce, *(n for n, _ in grads.values())}
    inputs = [*projection.args, *([bias] if bias is not None else []), loss.targets, tangent,
              *(m for m, _ in loss.masks), *(a for u, _ in chain for a in u.args if isinstance(a, torch.fx.Node))]
    live = reachable([graph.output_node(), *inputs], lambda n: n.all_input_nodes, stop=replaced)
    if bias is not None and bias_grad is None and g_base in live:
        raise NoMatch("its bias's gradient (a sum of the logits gradient over the rows) is not found")
    if projection in live or g_base in live:
        raise NoMatch("the logits or their gradient have other uses")
    return dict(loss=loss, projection=projection, row_ops=row_ops, bias=bias, grads=grads, chain=chain,
                tangent=tangent, ignore_index=_ignore_index(loss))


def _check_supported(loss, projection, bias):
    """NoMatch if the op cannot compute this recognised loss over this projection."""
    if len(tangents_of(projection.graph)) != 1 or _rank(tangents_of(projection.graph)[0]) != 0:
        if _logits_returned(projection):
            raise NoMatch("the logits leave the graph too (the step keeps them past backward(): in a returned "
                          "object, or for a metric), and the fused loss does not produce them")
        raise NoMatch("the graph has other differentiable outputs than one scalar loss")
    a, b = (fake_value(x) for x in projection.args[-2:])
    if a.dtype != b.dtype or a.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise NoMatch(f"the projection's dtype {a.dtype} is not supported")
    if bias is not None and fake_value(bias).dtype != b.dtype:
        raise NoMatch(f"the bias's dtype {fake_value(bias).dtype} is not the weight's {b.dtype}")
    if loss.masks and any(not _same(fake_value(m).numel(), fake_value(loss.targets).numel()) for m, _ in loss.masks):
        raise NoMatch("a mask does not cover the rows one to one")


def _logits_returned(projection) -> bool:
    """Whether the graph outputs the projection's result (through views, casts, slices, copies)."""
    return any(_through_views(x, allow_convert=True, ops=_HEAD_TO_LOGITS)[0] is projection
               for x in projection.graph.output_node().all_input_nodes)


def tangents_of(graph):
    return [n for n in graph.nodes if n.op == "placeholder" and n.target.startswith("tangents")]


def _note_logits_from_another_graph(loss):
    """Note a recognised loss whose logits are an input of this graph: the LM head ran in another,
    so there is no projection to fuse with (a graph break between the model's call and the loss)."""
    base, _ = _through_views(loss.logits, allow_convert=True, ops=_HEAD_TO_LOGITS)
    if base.op == "placeholder":
        note(PASS, f"left the cross-entropy over {base} alone: its logits come from another graph (a graph break "
                   "between the LM head and the loss, such as FSDP2's hooks around a sharded model's call), so "
                   "they are made in full and the loss is not fused")


def _note_unmatched_softmaxes(graph, taken):
    """Note softmaxes over a weight projection's output (a matmul with a parameter) left in place."""
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _SOFTMAX_STARTS:
            continue
        head = _head(_through_views(node.args[0], allow_convert=True, ops=_HEAD_TO_LOGITS)[0])
        if head is None or head[0] in taken:
            continue
        matmul = head[0]
        weight, _ = _through_views(matmul.args[-1], allow_convert=True)
        if weight.op == "placeholder":
            note(PASS, f"left {matmul} alone: a softmax ({node}) over its output matched no cross-entropy form")
            taken.add(matmul)
