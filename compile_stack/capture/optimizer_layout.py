"""An optimizer's state as paths, to compare one optimizer with another across processes.

A ``Layout`` describes every attribute, param-group and state entry of an
optimizer by its path (``.param_groups[0]['lr']``, ``.state[<.param_groups[0]['params'][3]>]['exp_avg']``):
Python values as they are, each tensor by shape, strides, dtype, device and
which entries share one tensor or storage. Two optimizers with equal layouts
(the values a graph takes as inputs left out) run the same update
(``proven_update.py``); ``resolve`` and ``assign`` read and write by path.
What cannot be followed (a model, a tensor subclass) is ``opaque``.
"""
import functools
import re
import types

import torch

_MAX_DEPTH = 6
_CODE = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.BuiltinMethodType, functools.partial)
CONTAINERS = {"list", "tuple", "dict", "defaultdict", "OrderedDict"}
_SCALARS = (bool, int, float, complex, str, type(None), torch.dtype, torch.device)

# A path into an optimizer: steps ("attr", name), ("item", key) and ("key", path of the tensor
# keying a dict entry), and ("grad",) for a tensor's gradient.
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]|\['([^'\\]*)'\]")


def source_path(source: str | None, self_source: str) -> tuple | None:
    """The path a Dynamo source such as ``L['self'].param_groups[0]['lr']`` names in the optimizer
    (``self_source``: the regular expression of the optimizer's own source); None for another."""
    if source is None or (head := re.match(self_source, source)) is None:
        return None
    path, at = [], head.end()
    while at < len(source):
        step = _STEP.match(source, at)
        if step is None:
            return None
        attr, index, key = step.groups()
        path.append(("attr", attr) if attr is not None else ("item", int(index) if index is not None else key))
        at = step.end()
    return tuple(path)


class Layout:
    """An optimizer's state as paths: each entry described (``entries``), each tensor's first path
    (``tensor_paths``, by identity), and what cannot be followed (``opaque``)."""

    def __init__(self, optimizer):
        self.entries: dict[tuple, tuple] = {}
        self.tensor_paths: dict[int, tuple] = {}
        self.opaque: list[str] = []
        self._storages: dict[tuple, tuple] = {}
        self._containers: dict[int, tuple] = {}  # id -> first path of each list, dict and object
        root = vars(optimizer)
        # Param groups first: torch.optim's state is keyed by their tensors.
        for name in sorted(root, key=lambda n: n != "param_groups"):
            self._visit((("attr", name),), root[name], 0)

    def masked(self, volatile: set[tuple]) -> dict[tuple, tuple]:
        """The entries with the values at ``volatile`` paths left out (their types kept)."""
        return {path: (entry[0], "volatile") if path in volatile else entry for path, entry in self.entries.items()}

    def _visit(self, path: tuple, value, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            self._tensor(path, value, depth)
        elif isinstance(value, _SCALARS):
            self.entries[path] = (type(value).__name__, value if not isinstance(value, (torch.dtype, torch.device))
                                  else str(value))
        elif isinstance(value, _CODE):
            return  # methods, hooks, a routed step: code, which the record's file hashes cover
        elif isinstance(value, type):
            self.entries[path] = ("class", f"{value.__module__}.{value.__qualname__}")
        elif id(value) in self._containers:  # met before (torch.optim's betas: in defaults and each group)
            self.entries[path] = ("same", self._containers[id(value)])
        elif depth >= _MAX_DEPTH:
            self._opaque(path, value)
        elif isinstance(value, (list, tuple)):
            self._containers[id(value)] = path
            self.entries[path] = (type(value).__name__, len(value))
            for i, item in enumerate(value):
                self._visit(path + (("item", i),), item, depth + 1)
        elif isinstance(value, dict):
            self._containers[id(value)] = path
            kind = type(value).__qualname__
            self.entries[path] = (kind if kind in CONTAINERS else "dict", len(value))
            for key, item in value.items():
                if isinstance(key, torch.Tensor) and id(key) in self.tensor_paths:
                    step = ("key", self.tensor_paths[id(key)])
                elif isinstance(key, (str, int)) and not isinstance(key, bool):
                    step = ("item", key)
                else:
                    self._opaque(path, key)
                    continue
                self._visit(path + (step,), item, depth + 1)
        elif hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
            self._containers[id(value)] = path
            self.entries[path] = ("object", f"{type(value).__module__}.{type(value).__qualname__}")
            for name, item in vars(value).items():
                self._visit(path + (("attr", name),), item, depth + 1)
        else:
            self._opaque(path, value)

    def _opaque(self, path: tuple, value) -> None:
        self.entries[path] = ("opaque", type(value).__qualname__)
        self.opaque.append(f"{type(value).__qualname__} at {describe(path)}")

    def _tensor(self, path: tuple, t: torch.Tensor, depth: int) -> None:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            self._opaque(path, t)  # a tensor subclass (a DTensor): its layout is not its local tensor's
            return
        first = self.tensor_paths.setdefault(id(t), path)
        storage = t.untyped_storage()
        shared = (self._storages.setdefault((str(t.device), storage.data_ptr()), path)
                  if storage.nbytes() else path)
        self.entries[path] = ("tensor", tuple(t.shape), t.stride(), str(t.dtype), str(t.device), t.requires_grad,
                              first, shared, t.storage_offset())
        if first == path and t.requires_grad:
            self._visit(path + (("grad",),), t.grad, depth + 1)


def describe(path: tuple) -> str:
    """A path as Python: ``.param_groups[0]['lr']``."""
    out = ""
    for step in path:
        out += (f".{step[1]}" if step[0] == "attr" else f"[{step[1]!r}]" if step[0] == "item"
                else f"[<{describe(step[1])}>]" if step[0] == "key" else ".grad")
    return out


class Missing(LookupError):
    """A path that does not resolve in this optimizer."""


def resolve(optimizer, path: tuple):
    obj = optimizer
    try:
        for step in path:
            if step[0] == "attr":
                obj = getattr(obj, step[1])
            elif step[0] == "item":
                obj = obj[step[1]]
            elif step[0] == "key":
                key = resolve(optimizer, step[1])
                if key not in obj:  # a defaultdict would make the entry
                    raise Missing(describe(path))
                obj = obj[key]
            else:
                obj = obj.grad
    except (AttributeError, LookupError, TypeError) as e:
        raise Missing(describe(path)) from e
    return obj


def assign(optimizer, path: tuple, value) -> None:
    parent, step = resolve(optimizer, path[:-1]), path[-1]
    if step[0] == "attr":
        setattr(parent, step[1], value)
    elif step[0] == "item":
        parent[step[1]] = value
    elif step[0] == "key":
        parent[resolve(optimizer, step[1])] = value
    else:
        raise ValueError(f"a gradient is not stored by a proven update: {describe(path)}")
