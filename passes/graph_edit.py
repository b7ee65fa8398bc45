"""FX graph editing the passes share: inserting a call with the fake value later
stages read, and finding what a set of nodes reaches."""
from collections.abc import Callable, Iterable

import torch
from torch._guards import detect_fake_mode
from torch.fx.node import map_arg


def insert_call(graph: torch.fx.Graph, target, args, kwargs=None, fake_mode=None) -> torch.fx.Node:
    """A call node at the graph's insert point, with ``meta['val']`` computed from its arguments'
    fake values (the partitioner and Inductor read it), under ``fake_mode`` or the arguments' own.
    Without a fake mode, as in a graph traced without fake values, the node gets no value."""
    node = graph.call_function(target, tuple(args), kwargs or {})
    fake_args, fake_kwargs = map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    fake_mode = fake_mode or detect_fake_mode((fake_args, fake_kwargs))
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node


def reachable(starts: Iterable[torch.fx.Node], neighbours: Callable[[torch.fx.Node], Iterable[torch.fx.Node]],
              stop=frozenset()) -> set[torch.fx.Node]:
    """``starts`` and every node reached from them through ``neighbours``, not going past ``stop`` nodes."""
    seen, work = set(), list(starts)
    while work:
        node = work.pop()
        if node in seen:
            continue
        seen.add(node)
        if node not in stop:
            work.extend(neighbours(node))
    return seen
