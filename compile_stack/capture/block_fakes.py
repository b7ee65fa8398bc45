"""A block's fake output, reused for every block that would give the same one.

While Dynamo traces the step, each block call is one graph node, but Dynamo
still runs the block's forward on fake tensors to learn its output's metadata:
34 blocks, twice per step (Dynamo traces the forward's frame again after its
graph break at ``loss.backward()``), 2.6 s of a 34-block step's warm start on
the CPU. Blocks of one class whose plain attributes, parameters and inputs
have the same metadata return outputs of the same metadata, so the first
block's run answers for the others, in this trace and the next.

Only what can be compared is reused: static shapes; a block whose attributes
are numbers, strings, dtypes, tensors (by metadata), dataclasses of those (a
config), modules held in a container (by the same rule) or functions (by
identity); an output of fresh tensors (no view,
nothing sharing storage with an input). Anything else runs the block as
before. Module-level state a block reads is in no key, as Dynamo guards none
of it for a block call either.
"""
import dataclasses
import types

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch_internals import fx

# What every nn.Module keeps in its __dict__ (parameters, buffers, children, hooks, flags).
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) | {"_routed_call"}  # which call, while routed (blocks.py)
_PLAIN = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.layout)
_BY_IDENTITY = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)


class _Unkeyable(Exception):
    """A value whose effect on the output's metadata cannot be told from a key."""


def _tensor_key(t: torch.Tensor) -> tuple:
    shape, stride = tuple(t.shape), tuple(t.stride())
    if not all(type(s) is int for s in (*shape, *stride)):
        raise _Unkeyable  # symbolic sizes: the output's sizes are expressions of them
    return ("tensor", shape, stride, t.storage_offset(), t.dtype, t.device, t.requires_grad, t.layout)


def _value_key(v):
    if isinstance(v, torch.Tensor):
        return _tensor_key(v)
    if isinstance(v, _PLAIN):
        return (type(v), v)
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(_value_key(x) for x in v))
    if isinstance(v, dict):
        return (dict, tuple((_value_key(k), _value_key(x)) for k, x in v.items()))
    if isinstance(v, _BY_IDENTITY):
        return ("identity", id(v))
    if dataclasses.is_dataclass(v):  # a config object many blocks hold: by its fields' values
        return (type(v), tuple((f.name, _value_key(getattr(v, f.name))) for f in dataclasses.fields(v)))
    if isinstance(v, torch.nn.Module):  # one held in a plain container (transformers' kernel wrappers)
        return ("module", _modules_key(v), tuple((n, _tensor_key(t)) for n, t in (*v.named_parameters(),
                                                                                  *v.named_buffers())))
    raise _Unkeyable


def _modules_key(module: torch.nn.Module) -> tuple:
    """Each module in ``module`` by its class, mode and plain attributes (its tensors apart)."""
    return tuple((name, type(m), m.training,
                  tuple(sorted((k, _value_key(v)) for k, v in vars(m).items() if k not in _MODULE_INTERNALS)))
                 for name, m in module.named_modules())


def storage_of(t: torch.Tensor) -> StorageWeakRef:
    """The storage ``t`` views, as a key (an FSDP2 shard: its local storage)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return StorageWeakRef(local.untyped_storage())


def _storages(leaves) -> list:
    return [storage_of(t) for t in leaves if isinstance(t, torch.Tensor)]


def _aliasing(leaves) -> tuple:
    """Which tensor leaves share storage (by the first leaf with it), so the pattern is in the key."""
    first = {}
    return tuple(first.setdefault(s, i) for i, s in enumerate(_storages(leaves)))


def call_key(block: torch.nn.Module, args: tuple, kwargs: dict, tensors: tuple):
    """What decides the metadata of ``block``'s output for these inputs, or None if not comparable."""
    leaves, spec = fx.tree_flatten((args, kwargs, tensors))
    try:
        modules = _modules_key(block)
        inputs = tuple(_value_key(x) for x in leaves)
    except (_Unkeyable, TypeError):  # TypeError: attribute names that do not sort
        return None
    autocast = tuple(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))
    return type(block), modules, str(spec), inputs, _aliasing(leaves), torch.is_grad_enabled(), autocast


def fake_tensors(block: torch.nn.Module, args) -> dict[str, torch.Tensor]:
    """Fake tensors of ``block``'s parameters and buffers, by name, in the fake mode of ``args``
    (Dynamo's): the block's call takes none of them as inputs, so Dynamo made no fakes of them."""
    mode = fx.detect_fake_mode(fx.tree_leaves(args))
    return {name: mode.from_tensor(t, static_shapes=True)
            for name, t in (*block.named_parameters(), *block.named_buffers())}


class _Made(torch.autograd.Function):
    """A new tensor of the given metadata, made a result of ``anchor`` (so it has a grad_fn, as the
    block's own output does); only ever made of fake tensors, never differentiated."""

    @staticmethod
    def forward(ctx, anchor, shape, stride, dtype, device):
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a block's reused fake output is metadata for Dynamo, not differentiable")


@dataclasses.dataclass(frozen=True)
class _TensorMeta:
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


class FakeOutput:
    """The metadata of a block's output, to make another of the same."""

    def __init__(self, spec, leaves: list):
        self.spec = spec
        self.leaves = leaves  # tensors as _TensorMeta, other values as they are

    @classmethod
    def of(cls, output, inputs: tuple) -> "FakeOutput | None":
        """None when ``output`` is not fresh tensors (a view, storage shared with ``inputs`` or within
        itself), requires grad without an input that does, or holds values that cannot be compared."""
        leaves, spec = fx.tree_flatten(output)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        inputs = [t for t in fx.tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
        outs = _storages(tensors)
        if (any(t._is_view() or t.storage_offset() != 0 for t in tensors) or len(set(outs)) != len(outs)
                or set(outs) & set(_storages(inputs))
                or (any(t.requires_grad for t in tensors) and not any(t.requires_grad for t in inputs))):
            return None
        try:
            for x in leaves:
                _value_key(x)
        except _Unkeyable:
            return None
        return cls(spec, [_TensorMeta(tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad)
                          if isinstance(x, torch.Tensor) else x for x in leaves])

    def make(self, inputs: tuple):
        """A new output of this metadata, in the fake mode of ``inputs`` (whose call had the same key;
        Dynamo's, where they hold no fake tensor)."""
        flat = fx.tree_flatten(inputs)[0]
        anchor = next((t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad), None)
        out = []
        with fx.detect_fake_mode(flat):
            if anchor is None:  # the output requires grad through the block's parameters alone
                anchor = torch.empty(0, requires_grad=True)
            for x in self.leaves:
                if not isinstance(x, _TensorMeta):
                    out.append(x)
                elif x.requires_grad:
                    out.append(_Made.apply(anchor, x.shape, x.stride, x.dtype, x.device))
                else:
                    out.append(torch.empty_strided(x.shape, x.stride, dtype=x.dtype, device=x.device))
        return fx.tree_unflatten(out, self.spec)
