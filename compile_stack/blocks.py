"""Repeated blocks compiled once, for any model.

Dynamo captures the user's forward whole, every block inlined. Compiling
that graph as it is makes Inductor's work grow with depth. Instead the
backend cuts the captured graph where Dynamo says each node came from: every
node records the module stack it was traced in, so the nodes of
``model.layers.3`` (an element of an ``nn.ModuleList``/``nn.Sequential``
whose elements share a class) form one segment, and everything else (the
embedding, the glue between blocks, the final norm, LM head and loss) forms
the segments between. Segments that are the same graph with the same input
metadata (every block of one class, as normally written) share ONE compiled
function: compiled once at its first call, called with each block's own
parameters. The head and the loss stay in one segment, so the fused
cross-entropy pass still sees them together, and attention is matched inside
the block's graph.

Nothing about the model is spelled out: no forward is rewritten and a model
with no repeated blocks is compiled whole. Each segment is compiled lazily,
at its first call, with the real tensors it gets (per distinct input shapes),
and AOTAutograd makes each one differentiable, so ``backward()`` runs each
segment's compiled backward in turn.
"""
import re
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.fx.passes.split_module import split_module

# A module path element that indexes a container: "G['model'].layers.3" or "L['self'].layers[3]".
_INDEXED = re.compile(r"^(?P<container>.+?)(?:\.(?P<dot>\d+)|\[(?P<bracket>\d+)\])$")

# compile(gm, example_inputs, uses) -> callable; ``uses``: how many segments share the graph.
CompileFn = Callable[[torch.fx.GraphModule, list, int], Callable]


def block_of(node: torch.fx.Node) -> tuple[str, int, type] | None:
    """(container path, index, class) of the outermost indexed module ``node`` was traced in."""
    for path, cls in (node.meta.get("nn_module_stack") or {}).values():
        m = _INDEXED.match(path)
        if m:
            return m["container"], int(m["dot"] or m["bracket"]), cls
    return None


def repeated_blocks(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, tuple[str, int]]:
    """Each node traced inside a repeated block -> (container, index). A container is repeated
    when two or more of its elements appear in the graph and all of them share one class (an
    ``nn.Sequential`` of different layers is not)."""
    found = {n: block_of(n) for n in gm.graph.nodes if n.op not in ("placeholder", "output")}
    indices, classes = defaultdict(set), defaultdict(set)
    for b in found.values():
        if b is not None:
            indices[b[0]].add(b[1])
            classes[b[0]].add(b[2])
    repeated = {c for c in indices if len(indices[c]) >= 2 and len(classes[c]) == 1}
    return {n: (b[0], b[1]) for n, b in found.items() if b is not None and b[0] in repeated}


def segment_ids(gm: torch.fx.GraphModule, blocks: dict) -> dict[torch.fx.Node, int]:
    """Consecutive runs of nodes with one block (or none) become numbered segments."""
    ids, current, label = {}, -1, object()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        this = blocks.get(node)
        if this != label:
            current, label = current + 1, this
        ids[node] = current
    return ids


def structure(gm: torch.fx.GraphModule):
    """A hashable description of ``gm``'s graph and its inputs' metadata, or None if the graph
    reads module attributes (constants that may differ between segments)."""
    index = {}
    out = []

    def arg(a):
        return torch.fx.node.map_arg(a, lambda n: ("node", index[n]))

    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        if node.op == "get_attr":
            return None
        if node.op == "placeholder":
            v = node.meta.get("example_value", node.meta.get("val"))
            meta = repr((v.shape, v.dtype, v.stride(), v.requires_grad, v.device)) \
                if isinstance(v, torch.Tensor) else repr(v)
            out.append(("placeholder", meta))
            continue
        target = node.target if isinstance(node.target, str) else \
            f"{getattr(node.target, '__module__', '')}.{getattr(node.target, '__qualname__', repr(node.target))}"
        out.append((node.op, target, repr(arg(node.args)), repr(arg(node.kwargs))))
    return tuple(out)


class Segment(torch.nn.Module):
    """One segment's graph, compiled at its first call for each distinct input layout."""

    def __init__(self, shared: "SharedCompile"):
        super().__init__()
        self.shared = shared

    def forward(self, *args):
        return self.shared(*args)


class SharedCompile:
    """The compiled functions of one segment graph, shared by every segment equal to it."""

    def __init__(self, gm: torch.fx.GraphModule, compile_fn: CompileFn, uses: int):
        self.gm = gm
        self.compile_fn = compile_fn
        self.uses = uses
        self.compiled: dict[tuple, Callable] = {}

    def __call__(self, *args):
        key = (torch.is_grad_enabled(), *((t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
                                          if isinstance(t, torch.Tensor) else t for t in args))
        fn = self.compiled.get(key)
        if fn is None:
            fn = self.compiled[key] = self.compile_fn(self.gm, list(args), self.uses)
        return fn(*args)


def outline(gm: torch.fx.GraphModule, compile_fn: CompileFn) -> torch.fx.GraphModule | None:
    """``gm`` cut into segments at its repeated blocks, equal segments sharing one compile;
    None when ``gm`` has no repeated blocks."""
    blocks = repeated_blocks(gm)
    if not blocks:
        return None
    ids = segment_ids(gm, blocks)
    split = split_module(gm, None, lambda node: ids[node], keep_original_order=True)
    segments = [(name, sub) for name, sub in split.named_children() if name.startswith("submod_")]
    groups = defaultdict(list)
    for name, sub in segments:
        key = structure(sub)
        groups[key if key is not None else name].append((name, sub))
    for members in groups.values():
        shared = SharedCompile(members[0][1], compile_fn, len(members))
        for name, _ in members:
            setattr(split, name, Segment(shared))
    return split


def block_list(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks by its structure: the largest ``nn.ModuleList``/``nn.Sequential``
    whose elements (two or more) share one class; [] if it has none."""
    best = []
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            children = list(module.children())
            if len(children) >= 2 and len({type(c) for c in children}) == 1 and len(children) > len(best):
                best = children
    return best
