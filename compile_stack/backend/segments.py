"""A captured graph split at its repeated blocks, equal pieces compiled once.

The backend's side of compiling repeated blocks once (``capture/blocks.py``
finds them and routes their calls): a captured graph is split into segments
at its block-call nodes (``call_block``), or, when it has none, where Dynamo
says each node came from (the nodes of ``model.layers.3`` form one segment).
Segments that are the same graph with the same input metadata share one
compiled function (``SharedCompile``); the pieces between the blocks (the
embedding; the final norm, LM head and loss together, so the fused
cross-entropy pass still sees them) are compiled at their first call with the
real tensors they get. AOTAutograd makes each differentiable, so
``backward()`` runs each piece's compiled backward in turn. The last call
sites of a shared graph may take a richer plan where memory is left over
(``memory_plan/share.py``): those calls go to a second compile of the same
forward.
"""
import re
import types
import weakref
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.fx.passes.split_module import split_module

from compile_stack.memory_plan.share import CallSites
from torch_internals import fx

# A module path element that indexes a container: "G['model'].layers.3" or "L['self'].layers[3]".
_INDEXED = re.compile(r"^(?P<container>.+?)(?:\.(?P<dot>\d+)|\[(?P<bracket>\d+)\])$")

# compile(gm, example_inputs, sites, richer=False) -> callable; ``sites``: the segments sharing the
# graph (plan_share.CallSites); ``richer``: compiled for those of them its richer plan is for.
CompileFn = Callable[..., Callable]


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


def segment_ids(gm: torch.fx.GraphModule, label: Callable[[torch.fx.Node], object]) -> dict[torch.fx.Node, int]:
    """Consecutive runs of nodes with one ``label`` become numbered segments."""
    ids, current, last = {}, -1, object()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        this = label(node)
        if this != last:
            current, last = current + 1, this
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
    """One segment's graph, compiled at its first call for each distinct input layout; the
    ``position``-th of the segments sharing it."""

    def __init__(self, shared: "SharedCompile", position: int):
        super().__init__()
        self.shared = shared
        self.position = position

    def forward(self, *args):
        return self.shared(self.position, *args)


class SharedCompile:
    """The compiled functions of one segment graph, shared by every segment equal to it.

    Each is compiled through ``torch.compile`` of the segment's forward rather than by handing
    the graph to ``compile_fn`` directly: Dynamo's tracing context (its shape environment) is
    what Inductor's and AOTAutograd's caches need, so a warm start loads the segment instead of
    compiling it again; retracing a segment's few nodes costs little. The forward is compiled
    as a function of the graph module (``_segment_forward``), not as the module itself: torch
    2.11's Dynamo never traced a graph module compiled as a module when it was called from the
    captured graph's run, so each segment ran eagerly (the 8B step's loss did not fit).
    """

    def __init__(self, gm: torch.fx.GraphModule, compile_fn: CompileFn, uses: int):
        fx.force_recompile(gm)  # a lazy module's code changes at its first call, failing Dynamo's guards
        self.gm = gm
        self.compile_fn = compile_fn
        self.sites = CallSites(uses)
        self.compiled: dict[tuple, Callable] = {}

    def __call__(self, position: int, *args):
        richer = self.sites.takes_richer(position)
        # By the metadata of every tensor, tuples included: a block returning (hidden, weights) hands
        # the next segment one tuple, which keyed by its tensors' identity compiled again every step.
        leaves, spec = torch.utils._pytree.tree_flatten(args)
        key = (richer, torch.is_grad_enabled(), str(spec),
               *((t.shape, t.stride(), t.dtype, t.device, t.requires_grad) if isinstance(t, torch.Tensor) else t
                 for t in leaves))
        fn = self.compiled.get(key)
        if fn is None:
            def backend(gm, example_inputs):
                return self.compile_fn(gm, example_inputs, self.sites, richer=richer)

            fn = self.compiled[key] = torch.compile(own_code(_segment_forward), backend=backend, dynamic=False)
        return fn(self.gm, *args)


def _segment_forward(gm: torch.fx.GraphModule, *args):
    return type(gm).forward(gm, *args)


def own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own: Dynamo keeps its compiled entries per code object, so
    each segment's entries (and the recompile limit) are then its own rather than shared by all."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def is_block_call(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is call_block


def outline(gm: torch.fx.GraphModule, compile_fn: CompileFn,
            block_compile_fn: CompileFn | None = None) -> torch.fx.GraphModule | None:
    """``gm`` split into segments at its block calls (or, with none, its repeated blocks), each
    compiled at its first call, equal segments sharing one compile; block calls stay as they are.
    Segments cut out as blocks compile with ``block_compile_fn`` if given. None when ``gm`` has
    neither."""
    calls = [n for n in gm.graph.nodes if is_block_call(n)]
    block_ids = set()
    if calls:
        ids = segment_ids(gm, lambda node: node if is_block_call(node) else None)
    else:
        blocks = repeated_blocks(gm)
        if not blocks:
            return None
        ids = segment_ids(gm, blocks.get)
        block_ids = {f"submod_{ids[n]}" for n in blocks}
    split = split_module(gm, None, lambda node: ids[node], keep_original_order=True)
    groups = defaultdict(list)
    for name, sub in split.named_children():
        if name.startswith("submod_") and not any(is_block_call(n) for n in sub.graph.nodes):
            key = structure(sub)
            groups[key if key is not None else name].append((name, sub))
    for members in groups.values():
        fn = block_compile_fn if block_compile_fn is not None and members[0][0] in block_ids else compile_fn
        shared = SharedCompile(members[0][1], fn, len(members))
        for position, (name, _) in enumerate(members):
            setattr(split, name, Segment(shared, position))
    return split


# Live block routers (``capture.blocks.BlockCalls``) by key, a constant in the graphs that call
# them; weak, so that freeing the compiled step frees its blocks (their parameters and gradients).
_ROUTERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def register_router(router) -> int:
    """Make ``router`` reachable from ``call_block`` nodes (while it lives); its key.

    A router has ``blocks``, ``fake_forward(block, args, kwargs)`` (the call on Dynamo's fake
    tensors) and ``compiled_for(index)`` (the compiled forward block ``index`` runs)."""
    key = id(router)
    _ROUTERS[key] = router
    return key


@torch.compiler.allow_in_graph
def call_block(key: int, index: int, args: tuple, kwargs: dict, layout: str):
    """Block ``index`` of the router ``key`` applied to ``args``/``kwargs``. The block's parameters
    are no inputs of the node (the compiled block reads them); ``layout``, a string of their
    metadata, is a constant of it, on which Dynamo guards."""
    router = _ROUTERS[key]
    block = router.blocks[index]
    if fx.detect_fake_mode(fx.tree_leaves((args, kwargs))) is not None:  # Dynamo tracing
        return router.fake_forward(block, args, kwargs)
    return router.compiled_for(index)(block, *args, **kwargs)
