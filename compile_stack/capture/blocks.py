"""Repeated blocks compiled once, for any model.

Compiled whole, a model is one graph with every block inlined, and both
Dynamo's and Inductor's work grow with depth. We find the repeated blocks
(an ``nn.ModuleList``/``nn.Sequential`` whose elements share one class) and
compile one block's graph for all of them, without spelling out any model's
forward. Two ways, both automatic:

1. **Block calls** (``BlockCalls``), when the step reaches the model by name
   (its closure or globals): while the compiled step runs, each block's
   class is one whose ``forward`` routes to ``backend.segments.call_block``
   (``routed_class``), which Dynamo puts
   into the captured graph as ONE node (``allow_in_graph``; Dynamo runs the
   block on fake tensors for the output's metadata, once for all identical
   blocks: ``block_fakes.py``) instead of tracing it. At run time that node
   calls the block's forward compiled by ``torch.compile`` with our backend:
   one graph for every block (Dynamo keys it on the code; the block's
   parameters are graph inputs and guards keep it right for any block that
   differs). The call's node takes no parameter: wrapping each as an input of
   the step's graph cost Dynamo ~1 ms a tensor, 300 tensors at 34 blocks, in
   each of the forward's two traces. One string of every block tensor's
   metadata (``tensor_layout``), a constant of the node, is what Dynamo guards
   instead, so a cast or a frozen block traces the step again.
2. **Graph cut** (the fallback, e.g. a model passed in as an argument,
   blocks with hooks, or a call passing an object no graph node can take,
   such as a transformers ``Cache``): Dynamo captures the forward whole, and
   the backend cuts the graph where Dynamo says each node came from
   (``backend/segments.py``); equal blocks (the same graph, whatever their
   ``layer_idx``) share one compile, blocks of another kind (sliding-window
   layers among full ones) get their own.

Either way the backend splits the captured graph into segments at the
blocks and compiles the pieces between them; a model with no repeated blocks
is compiled whole.
"""
import contextlib
import hashlib
from collections.abc import Callable

import torch
from torch.nn.utils.stateless import _reparametrize_module

from compile_stack.backend.segments import call_block, own_code, register_router
from compile_stack.capture import fsdp_modules
from compile_stack.capture.block_fakes import FakeOutput, call_key, fake_tensors, storage_of


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


def _class_forward(block: torch.nn.Module, *args, **kwargs):
    """The block's own forward (its class is the routed one meanwhile, ``routed_class``)."""
    return type(block)._routed_from.forward(block, *args, **kwargs)


def _routed_forward(block: torch.nn.Module, *args, **kwargs):
    """A routed block's forward: its ``call_block`` node, or, for arguments no node can take, the
    block's own forward traced where called (the captured graph is cut at it)."""
    key, index, layout = block._routed_call
    if not _passable(args) or not _passable(kwargs.values()):
        return _class_forward(block, *args, **kwargs)
    return call_block(key, index, args, kwargs, layout)


def routed_class(cls: type) -> type:
    """``cls`` with ``_routed_forward`` as its forward: a class, not an instance's ``forward``, so
    Dynamo calls it as a module's forward directly instead of tracing ``nn.Module.__call__``
    (~60 bytecodes a call, its hooks checks) around it."""
    return type(cls.__name__, (cls,), {"forward": _routed_forward, "_routed_from": cls,
                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__})


# What a graph node's arguments may hold (Dynamo turns these into the node's inputs).
_PASSABLE = (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool, type(None), bool, int, float, complex, str,
             torch.dtype, torch.device, torch.layout, torch.memory_format)


def _passable(values) -> bool:
    """Whether each of ``values`` can be an argument of a ``call_block`` node. A transformers
    ``Cache`` (``use_cache=True``, the default even in training) cannot: the block updates it in
    place, so such a call is traced where it is made, and Dynamo keeps only what a live object
    needs. Loops, not ``all()`` of generators: Dynamo traces this at every block call, where
    the generators cost it ~170 bytecodes a call (~20 now), 11,600 of a 34-block step's 18,700."""
    for value in values:
        if isinstance(value, _PASSABLE):
            continue
        if isinstance(value, dict):
            for name in value:
                if not isinstance(name, str):
                    return False
            value = value.values()
        elif not isinstance(value, (tuple, list)):
            return False
        if not _passable(value):
            return False
    return True


def tensor_layout(blocks: list[torch.nn.Module]) -> str:
    """The name, shape, stride, dtype, device and requires_grad of every parameter and buffer of
    ``blocks``, and which of them share storage, as a short digest."""
    storages: dict = {}
    described = [(name, tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad,
                  storages.setdefault(storage_of(t), len(storages)))
                 for block in blocks for name, t in BlockCalls._named_tensors(block)]
    return hashlib.sha256(repr(described).encode()).hexdigest()[:32]


def _plain(module: torch.nn.Module) -> bool:
    """No hooks on the module or inside it (a routed forward would skip nothing, but hooks such
    as FSDP2's must run around the block's own call)."""
    return not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                   or type(m).__call__ is not torch.nn.Module.__call__ for m in module.modules())


class BlockCalls:
    """The repeated blocks of ``model``, each call one node of the captured graph while routed."""

    def __init__(self, blocks: list[torch.nn.Module], backend):
        """``backend`` (a ``PassBackend``) compiles the block's forward; its call sites are the
        blocks, the last ``backend.sites.richer`` of which take a richer plan (memory_plan/share.py)."""
        self.blocks = blocks
        self.backend = backend
        # Static shapes, as the segments': Dynamo's automatic-dynamic history is keyed by code
        # location, so another model's blocks (other sizes, the same ``_class_forward``) would
        # otherwise compile with symbolic sizes, which the RoPE pass leaves as written.
        self.compiled = torch.compile(own_code(_class_forward), backend=backend, dynamic=False)
        self.compiled_richer = torch.compile(own_code(_class_forward), backend=backend.richer, dynamic=False)
        self.key = register_router(self)
        self.block_class = type(blocks[0])
        self.routed_class = routed_class(self.block_class)
        # Sharded by FSDP2: the hooks run around each compiled forward (fsdp_modules.py), and the
        # parameters are no inputs of the call (sharded until the block's pre-forward gathers them).
        self.sharded = fsdp_modules.state_of(blocks[0]) is not None
        self.fake_outputs: dict[tuple, FakeOutput | None] = {}  # by block_fakes.call_key

    def fake_forward(self, block: torch.nn.Module, args: tuple, kwargs: dict):
        """``block`` run on Dynamo's fake tensors, or, for a call whose key an earlier one had, a new
        output of that one's metadata (block_fakes.py)."""
        # Keyed by the real tensors' metadata where they are the block's own (fakes cost ~0.5 ms a
        # tensor to make), by the unsharded fakes where FSDP2 shards them.
        replaced = fsdp_modules.unsharded_fakes(block, args) if self.sharded else None
        key = call_key(block, args, kwargs, tuple(replaced.values()) if self.sharded else
                       tuple(t for _, t in self._named_tensors(block)))
        known = self.fake_outputs.get(key) if key is not None else None
        if known is not None:
            return known.make((args, kwargs))
        replaced = replaced or fake_tensors(block, args)
        with _reparametrize_module(block, replaced):
            output = _class_forward(block, *args, **kwargs)
        if key is not None and key not in self.fake_outputs:
            self.fake_outputs[key] = FakeOutput.of(output, (args, kwargs, tuple(replaced.values())))
        return output

    def compiled_for(self, index: int) -> Callable:
        compiled = self.compiled_richer if self.backend.sites.takes_richer(index) else self.compiled
        return fsdp_modules.with_hooks(compiled, index == len(self.blocks) - 1) if self.sharded else compiled

    @staticmethod
    def _named_tensors(block):
        return [*block.named_parameters(), *block.named_buffers()]

    @classmethod
    def of(cls, model: torch.nn.Module, make_backend: Callable[[int], object]) -> "BlockCalls | None":
        """``model``'s blocks, or None where they cannot be routed (none; hooks; differing tensors);
        ``make_backend(number of blocks)`` makes the blocks' backend."""
        blocks = block_list(model)
        if not blocks or not all(_plain(b) or fsdp_modules.only_fsdp_hooks(b) for b in blocks):
            return None
        names = [[n for n, _ in cls._named_tensors(b)] for b in blocks]
        if any(n != names[0] for n in names):
            return None
        return cls(blocks, make_backend(len(blocks)))

    @contextlib.contextmanager
    def routed(self):
        """While active, each block's class is its routed twin, whose forward is a ``call_block`` node.

        The blocks' layout is taken here, outside Dynamo (~1 ms at 300 tensors): traced, walking a
        block's ``named_parameters()`` generators cost ~4 s per trace of a 34-block step."""
        layout = tensor_layout(self.blocks)
        for index, block in enumerate(self.blocks):
            block._routed_call = (self.key, index, layout)
            block.__class__ = self.routed_class
        try:
            with fsdp_modules.hooks_hidden(self.blocks if self.sharded else []):
                yield
        finally:
            for block in self.blocks:
                block.__class__ = self.block_class
                del block._routed_call
