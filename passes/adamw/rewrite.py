"""The replacement: one ``cstack::fused_adamw_`` call per group of proven chains, inserted where
the epilogue starts, once nothing else reads what it replaces."""
import functools
import operator

import torch
from torch.fx import Graph, Node

import custom_ops.adamw  # noqa: F401  (registers torch.ops.cstack.fused_adamw_)
from passes.adamw.common import _Chain, _Flow, _is_foreach, _is_fresh, _returned, aten
from passes.graph_edit import fake_value, insert_call
from passes.rejection import NoMatch


def _check_isolated(chain: _Chain, flow: _Flow, order, insert_at: Node) -> None:
    """NoMatch unless the chain's tensor values feed only itself and its epilogue and nothing after
    the call reads p, m or v: the call replaces all of them at one point."""
    inside = chain.nodes | {chain.copies[x] for x in (chain.p, chain.m, chain.v) if x in chain.copies}
    returned = {chain.new[x] for x in (chain.m, chain.v) if _returned(chain, x)}  # the graph returns these
    for node, index in chain.values:
        if order[node] >= order[insert_at]:
            raise NoMatch("its update is computed after the epilogue starts")
        users = {u for u in node.users if not (u.op == "output" and node in returned)}
        if index is None and not _is_foreach(node) and flow.reach(node)[0] and not users <= inside:
            raise NoMatch(f"{node.name} is also used outside the update")
    for x in (chain.p, chain.m, chain.v):
        late = [u for u in x.users if u not in inside and order[u] >= order[insert_at]]
        if late:
            raise NoMatch(f"{late[0].name} reads {x.name} after the update")


def _f32(add, step: Node, device) -> Node:
    """A scalar value (t, lr) as a 0-d float32 tensor: a tensor is cast, a SymInt/SymFloat becomes a
    tensor on ``device``."""
    val = fake_value(step)
    if isinstance(val, torch.Tensor):
        if val.dtype == torch.float32:
            return step
        return add(torch.ops.prims.convert_element_type.default, (step, torch.float32))
    return add(aten.scalar_tensor.default, (step,), {"dtype": torch.float32, "device": device})


def _fuse(graph: Graph, group: list[_Chain], fake_mode) -> Node:
    """Insert one fused call for ``group`` (at the graph's insertion point); returns the call node."""
    add = functools.partial(insert_call, graph, fake_mode=fake_mode)
    beta1, beta2, weight_decay, eps, torch_semantics = group[0].coefficients
    device = fake_value(group[0].p).device
    if len(group[0].lr) == 1:  # constant
        lr_node = add(aten.scalar_tensor.default, group[0].lr, {"dtype": torch.float32, "device": device})
    else:  # k times a scalar value of the graph
        node, index, k = group[0].lr
        if index is not None:
            node = add(operator.getitem, (node, index))
        lr_node = _f32(add, node, device)
        if k != 1.0:
            lr_node = add(aten.mul.Tensor, (lr_node, k))
    steps = list(dict.fromkeys(c.step for c in group))
    if steps == [None]:
        step = add(aten.scalar_tensor.default, (1.0,), {"dtype": torch.float32, "device": device})
    else:
        step_values = [_f32(add, s, device) for s in steps]
        step = step_values[0]
        if len(steps) > 1:
            # Past decomposition, only ops Inductor lowers: cat of [1]-views (not stack), any (not all).
            stacked = add(aten.cat.default, ([add(aten.view.default, (s, [1])) for s in step_values],))
            same = add(aten.logical_not.default, (add(aten.any.default, (add(aten.ne.Tensor, (stacked, step)),)),))
            add(aten._assert_async.msg,
                (same, "fused AdamW: parameters of one group are at different steps (one missed updates)"))
    for c in group:
        # A returned moment read from an input (its new value stored back out of place): the call
        # updates a copy, so the input keeps its value as in eager; a fresh zero tensor is its own.
        c.buffers = {x: add(aten.clone.default, (x,)) if _returned(c, x) and not _is_fresh(x) else x
                     for x in (c.p, c.m, c.v)}
    lists = [[c.buffers.get(getattr(c, r), getattr(c, r)) for c in group] for r in "pgmv"]
    call = add(torch.ops.cstack.fused_adamw_.default,
               (*lists, lr_node, step, beta1, beta2, eps, weight_decay, torch_semantics))
    call.meta["val"] = None
    return call
