"""Gradients a captured graph sets to None are released before it runs, not after.

A step that zeroes its own gradients (``for p in model.parameters(): p.grad =
None``, or a helper doing so) is traced by Dynamo, which records such
attribute stores as side effects and applies them only once the graph
captured with them has run. So the last step's gradients stay alive through
the forward graph, beside its activations: 16 GiB at the full size, more than
the memory plan leaves free. (``zero_grad`` of a model or an optimizer in
reach runs eagerly instead, see ``capture/step.py``; this covers everything else.)

When our backend is handed a graph, Dynamo's pending side effects are those
that will be applied after it. For each graph input whose ``grad`` they set to
None, the compiled graph sets it first; so it does for such a tensor the graph
does not take (a block's parameters, which its block-call node does not take),
found by its Dynamo source. The result is the same: no graph reads
a tensor's ``.grad`` (a gradient it uses is an input of its own, which the call
still holds), and nothing runs between the graph and the stores. If the graph
raises, the gradients are already None, as in eager mode.
"""
import weakref
from collections.abc import Callable

import torch

from torch_internals import dynamo


def grads_set_to_none(gm: torch.fx.GraphModule) -> tuple[list[int], list[weakref.ref]]:
    """Positions of ``gm``'s inputs whose ``grad`` the side effects pending in the Dynamo trace that
    captured ``gm`` set to None, and (weakly) the tensors among them that are no input of ``gm``
    (a block's parameters: its block-call node takes none, ``capture/blocks.py``); empty outside a
    Dynamo trace."""
    tx = dynamo.current_tracer()
    if tx is None:
        return [], []
    placeholders = {node: i for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    positions, others = [], []
    for var, attributes in tx.output.side_effects.store_attr_mutations.items():
        value = attributes.get("grad")
        if (isinstance(var, dynamo.tensor_variable_type()) and value is not None and value.is_python_constant()
                and value.as_python_constant() is None):
            node = var.as_proxy().node
            if node in placeholders:
                positions.append(placeholders[node])
            elif isinstance(real := dynamo.real_value(tx, var), torch.Tensor):
                others.append(weakref.ref(real))
    return sorted(positions), others


def releasing_grads(compiled: Callable, positions: list[int], others: list[weakref.ref] = ()) -> Callable:
    """``compiled``, first setting the ``grad`` of its inputs at ``positions``, and of the live
    tensors among ``others``, to None."""
    if not positions and not others:
        return compiled

    def run(*args):
        for i in positions:
            args[i].grad = None
        for ref in others:
            if (t := ref()) is not None:
                t.grad = None
        return compiled(*args)

    return run
