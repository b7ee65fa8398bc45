"""Repeated blocks compiled once, for any model.

Compiled whole, a model is one graph with every block inlined, and both
Dynamo's and Inductor's work grow with depth. We find the repeated blocks
(an ``nn.ModuleList``/``nn.Sequential`` whose elements share one class) and
compile one block's graph for all of them, without spelling out any model's
forward. Two ways, both automatic:

1. **Block calls** (``BlockCalls``), when the step reaches the model by name
   (its closure or globals): while the compiled step runs, each block's
   ``forward`` is routed to ``call_block``, which Dynamo puts into the
   captured graph as ONE node (``allow_in_graph``; Dynamo runs the block on
   fake tensors for the output's metadata, once for all identical blocks:
   ``block_fakes.py``) instead of tracing it. At run time
   that node calls the block's forward compiled by ``torch.compile`` with our
   backend: one graph for every block (Dynamo keys it on the code; the block's
   parameters are graph inputs and guards keep it right for any block that
   differs). Dynamo's tracing no longer grows with depth either.
2. **Graph cut** (the fallback, e.g. a model passed in as an argument, or
   blocks with hooks): Dynamo captures the forward whole, and the backend
   cuts the graph where Dynamo says each node came from: the nodes of
   ``model.layers.3`` form one segment, and segments that are the same graph
   with the same input metadata share one compiled function.

Either way the backend splits the captured graph into segments: the block
calls, and the pieces between them (the embedding; the final norm, LM head
and loss together, so the fused cross-entropy pass still sees them). Each
piece is compiled at its first call with the real tensors it gets (per
distinct input layout), and AOTAutograd makes each differentiable, so
``backward()`` runs each piece's compiled backward in turn. A model with no
repeated blocks is compiled whole. The last blocks (or segments) of a shared
graph may take a richer plan where memory is left over (``plan_share.py``):
those calls go to a second compile of the same forward.
"""
import contextlib
import re
import types
import weakref
from collections import defaultdict
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.passes.split_module import split_module
from torch.nn.utils.stateless import _reparametrize_module

from compile_stack.block_fakes import FakeOutput, call_key
from compile_stack.plan_share import CallSites

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
        _LazyGraphModule.force_recompile(gm)  # a lazy module's code changes at its first call, failing Dynamo's guards
        self.gm = gm
        self.compile_fn = compile_fn
        self.sites = CallSites(uses)
        self.compiled: dict[tuple, Callable] = {}

    def __call__(self, position: int, *args):
        richer = self.sites.takes_richer(position)
        key = (richer, torch.is_grad_enabled(), *((t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
                                                  if isinstance(t, torch.Tensor) else t for t in args))
        fn = self.compiled.get(key)
        if fn is None:
            def backend(gm, example_inputs):
                return self.compile_fn(gm, example_inputs, self.sites, richer=richer)

            fn = self.compiled[key] = torch.compile(_own_code(_segment_forward), backend=backend, dynamic=False)
        return fn(self.gm, *args)


def _segment_forward(gm: torch.fx.GraphModule, *args):
    return type(gm).forward(gm, *args)


def _own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own: Dynamo keeps its compiled entries per code object, so
    each segment's entries (and the recompile limit) are then its own rather than shared by all."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def is_block_call(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is call_block


def outline(gm: torch.fx.GraphModule, compile_fn: CompileFn) -> torch.fx.GraphModule | None:
    """``gm`` split into segments at its block calls (or, with none, its repeated blocks), each
    compiled at its first call, equal segments sharing one compile; block calls stay as they are.
    None when ``gm`` has neither."""
    calls = [n for n in gm.graph.nodes if is_block_call(n)]
    if calls:
        ids = segment_ids(gm, lambda node: node if is_block_call(node) else None)
    else:
        blocks = repeated_blocks(gm)
        if not blocks:
            return None
        ids = segment_ids(gm, blocks.get)
    split = split_module(gm, None, lambda node: ids[node], keep_original_order=True)
    groups = defaultdict(list)
    for name, sub in split.named_children():
        if name.startswith("submod_") and not any(is_block_call(n) for n in sub.graph.nodes):
            key = structure(sub)
            groups[key if key is not None else name].append((name, sub))
    for members in groups.values():
        shared = SharedCompile(members[0][1], compile_fn, len(members))
        for position, (name, _) in enumerate(members):
            setattr(split, name, Segment(shared, position))
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


# Live BlockCalls by key (a constant in the graphs that call them); weak, so that freeing the
# compiled step frees its blocks (their parameters and gradients).
_ROUTED: "weakref.WeakValueDictionary[int, BlockCalls]" = weakref.WeakValueDictionary()


@torch._dynamo.allow_in_graph
def call_block(key: int, index: int, args: tuple, kwargs: dict, tensors: tuple):
    """Block ``index`` of ``BlockCalls`` ``key`` applied to ``args``/``kwargs``; ``tensors`` are its
    parameters and buffers, passed so the captured graph records them as the call's inputs."""
    calls = _ROUTED[key]
    block = calls.blocks[index]
    if any(is_fake(t) for t in torch.utils._pytree.tree_leaves((args, kwargs, tensors))):  # Dynamo tracing
        return calls.fake_forward(block, args, kwargs, tensors)
    return calls.compiled_for(index)(block, *args, **kwargs)


def _class_forward(block: torch.nn.Module, *args, **kwargs):
    """The block's own forward (its ``forward`` attribute is routed to ``call_block`` meanwhile)."""
    return type(block).forward(block, *args, **kwargs)


def _plain(module: torch.nn.Module) -> bool:
    """No hooks on the module or inside it (a routed forward would skip nothing, but hooks such
    as FSDP2's must run around the block's own call)."""
    return not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                   or type(m).__call__ is not torch.nn.Module.__call__ for m in module.modules())


class BlockCalls:
    """The repeated blocks of ``model``, each call one node of the captured graph while routed."""

    def __init__(self, blocks: list[torch.nn.Module], backend):
        """``backend`` (a ``PassBackend``) compiles the block's forward; its call sites are the
        blocks, the last ``backend.sites.richer`` of which take a richer plan (plan_share.py)."""
        self.blocks = blocks
        self.backend = backend
        self.tensor_names = [name for name, _ in self._named_tensors(blocks[0])]
        # Static shapes, as the segments': Dynamo's automatic-dynamic history is keyed by code
        # location, so another model's blocks (other sizes, the same ``_class_forward``) would
        # otherwise compile with symbolic sizes, which the RoPE pass leaves as written.
        self.compiled = torch.compile(_own_code(_class_forward), backend=backend, dynamic=False)
        self.compiled_richer = torch.compile(_own_code(_class_forward), backend=backend.richer, dynamic=False)
        self.key = id(self)
        _ROUTED[self.key] = self
        self.forwards = [self._forward(i) for i in range(len(blocks))]
        self.tensors: list[tuple] = []  # each block's parameters and buffers while routed
        self.fake_outputs: dict[tuple, FakeOutput | None] = {}  # by block_fakes.call_key

    def fake_forward(self, block: torch.nn.Module, args: tuple, kwargs: dict, tensors: tuple):
        """``block`` run on Dynamo's fake tensors, or, for a call whose key an earlier one had, a new
        output of that one's metadata (block_fakes.py)."""
        key = call_key(block, args, kwargs, tensors)
        known = self.fake_outputs.get(key) if key is not None else None
        if known is not None:
            return known.make((args, kwargs, tensors))
        with _reparametrize_module(block, dict(zip(self.tensor_names, tensors))):
            output = _class_forward(block, *args, **kwargs)
        if key is not None and key not in self.fake_outputs:
            self.fake_outputs[key] = FakeOutput.of(output, (args, kwargs, tensors))
        return output

    def compiled_for(self, index: int) -> Callable:
        return self.compiled_richer if self.backend.sites.takes_richer(index) else self.compiled

    @staticmethod
    def _named_tensors(block):
        return [*block.named_parameters(), *block.named_buffers()]

    def _forward(self, index: int):
        key = self.key

        def forward(*args, **kwargs):
            return call_block(key, index, args, kwargs, self.tensors[index])

        return forward

    @classmethod
    def of(cls, model: torch.nn.Module, make_backend: Callable[[int], object]) -> "BlockCalls | None":
        """``model``'s blocks, or None where they cannot be routed (none; hooks; differing tensors);
        ``make_backend(number of blocks)`` makes the blocks' backend."""
        blocks = block_list(model)
        if not blocks or not all(_plain(b) for b in blocks):
            return None
        names = [[n for n, _ in cls._named_tensors(b)] for b in blocks]
        if any(n != names[0] for n in names):
            return None
        return cls(blocks, make_backend(len(blocks)))

    @contextlib.contextmanager
    def routed(self):
        """While active, each block's ``forward`` is its ``call_block`` node.

        Each block's parameters and buffers are listed here, outside Dynamo: traced, walking a
        block's ``named_parameters()`` generators cost ~4 s per trace of a 34-block step."""
        self.tensors = [tuple(t for _, t in self._named_tensors(b)) for b in self.blocks]
        for block, forward in zip(self.blocks, self.forwards):
            block.forward = forward
        try:
            yield
        finally:
            self.tensors = []
            for block in self.blocks:
                del block.forward
