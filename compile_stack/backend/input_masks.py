"""Mask-shaped graph inputs rebuilt in the graph, so the attention pass can read them.

A causal mask often reaches a compiled graph as an input: nanoGPT registers
``tril(ones(T, T))`` as a buffer and slices it ``[:S, :S]``; other models
build the mask once, outside the repeated blocks, and pass it in. Its values
are not in the graph, so the attention pass could not prove it causal. At
compile time the backend has the real input, though: where it is one
diagonal split of its last two dims (``t[..., i, j] = a`` where
``j - i <= d``, else ``b``, the same for every leading index) the graph
builds that tensor itself from ``ones``/``tril``/``where`` instead of reading
the input, which the attention pass evaluates as it does any mask built in
the graph.

That is exact only while the input still holds those values, so the compiled
graph is guarded: a call whose mask input is another tensor, or the same one
modified since it was checked (its version counter moved), checks the values
again (once per tensor and version); if they changed, that call runs the
graph as captured, uncompiled, with a warning, and gives eager's result.

Only bool and floating inputs that need no gradient are candidates (token
ids and data batches change every call); an input the graph modifies is left
alone.
"""
import dataclasses
import operator
import warnings
import weakref

import torch
from torch_internals import fx

# Rows of a mask compared at once when checking it (bounds the temporary to 4096 × columns).
CHECK_ROWS = 4096


@dataclasses.dataclass(frozen=True)
class DiagonalSplit:
    """``a`` where ``j - i <= diagonal`` (query i, key j), else ``b``; one value where ``diagonal`` is None."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    diagonal: int | None
    a: bool | float
    b: bool | float


def diagonal_split(t: torch.Tensor) -> DiagonalSplit | None:
    """``t`` as one diagonal split of its last two dims, the same for every leading index; None if
    it is not one (checked exactly, a block of rows at a time)."""
    if t.dim() < 2 or min(t.shape[-2:]) < 2 or t.numel() == 0:
        return None
    m = t.reshape(-1, *t.shape[-2:])
    rows, cols = m.shape[-2:]
    py = bool if t.dtype == torch.bool else float
    # The bottom-left entry is on the `a` side of any split that has one; the last row (or, if it
    # is all `a`, the first) says where the split lies. The check below confirms it.
    a = py(m[0, -1, 0].item())
    count = int((m[0, -1] == a).sum().item())
    if count < cols:
        diagonal = count - rows
    else:
        count = int((m[0, 0] == a).sum().item())
        diagonal = count - 1 if count < cols else None
    if diagonal is None and t.dtype != torch.bool:
        return None  # a float tensor of one value is as likely data as a mask
    b = a if diagonal is None else py(m[0, 0, -1].item())
    d = cols if diagonal is None else diagonal
    for start in range(0, rows, CHECK_ROWS):
        i = torch.arange(start, min(rows, start + CHECK_ROWS), device=t.device)[:, None]
        j = torch.arange(cols, device=t.device)[None, :]
        expected = torch.where(j - i <= d, torch.tensor(a, dtype=t.dtype, device=t.device),
                               torch.tensor(b, dtype=t.dtype, device=t.device))
        if not torch.equal(m[:, start:start + CHECK_ROWS], expected.expand(m.shape[0], -1, -1)):
            return None
    return DiagonalSplit(tuple(t.shape), t.dtype, t.device, diagonal, a, b)


def _is_candidate(node: torch.fx.Node, value) -> bool:
    """A real bool/floating input of two or more dims that needs no gradient and that the graph
    reads but does not modify (an in-place method or op, or an item assignment)."""
    def modifies(user):
        name = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", "")
        return user.target is operator.setitem or (name.endswith("_") and not name.startswith("__"))

    return (isinstance(value, torch.Tensor) and not fx.is_fake(value) and not isinstance(value, torch.nn.Parameter)
            and not value.requires_grad and (value.dtype == torch.bool or value.dtype.is_floating_point)
            and value.dim() >= 2 and bool(node.users) and not any(modifies(u) for u in node.users))


def _build(graph: torch.fx.Graph, split: DiagonalSplit, mode=None) -> torch.fx.Node:
    """Nodes computing ``split``'s tensor: ``full(b).masked_fill(tril(ones, d), a)`` in its dtype
    (exact for any value it holds), leading dims broadcast by ``expand``. Each node's
    ``example_value`` is its value in the fake ``mode`` (Dynamo's), as Dynamo's own nodes have:
    AOTAutograd's cache takes a method call only on a node that has one, and bypassed every
    graph with a rebuilt mask without it (a transformers block's warm start compiled it again)."""
    def add(kind: str, target, args: tuple, kwargs: dict | None = None) -> torch.fx.Node:
        node = getattr(graph, kind)(target, args, kwargs or {})
        if mode is not None:
            values = torch.fx.node.map_arg((args, kwargs or {}), lambda n: n.meta["example_value"])
            with mode:
                fn = target if kind == "call_function" else getattr(torch.Tensor, target)
                node.meta["example_value"] = fn(*values[0], **values[1])
        return node

    rows, cols = split.shape[-2:]
    value = add("call_function", torch.full, ((rows, cols), split.b), {"dtype": split.dtype, "device": split.device})
    if split.diagonal is not None:
        keep = add("call_function", torch.ones, (rows, cols), {"dtype": torch.bool, "device": split.device})
        keep = add("call_function", torch.tril, (keep, split.diagonal))
        value = add("call_method", "masked_fill", (value, keep, split.a))
    return add("call_method", "expand", (value, *split.shape))


def find(gm: torch.fx.GraphModule, example_inputs: list) -> dict[int, DiagonalSplit]:
    """The positions of ``gm``'s inputs that are diagonal splits, with their values."""
    found = {}
    for index, (node, value) in enumerate(zip(gm.graph.find_nodes(op="placeholder"), example_inputs)):
        split = diagonal_split(value) if _is_candidate(node, value) else None
        if split is not None:
            found[index] = split
    return found


def rebuild(gm: torch.fx.GraphModule, found: dict[int, DiagonalSplit]) -> None:
    """Rewrite ``gm`` in place so each input in ``found`` is built in the graph instead of read."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    with gm.graph.inserting_before(next(n for n in gm.graph.nodes if n.op != "placeholder")):
        for index, split in found.items():
            node = placeholders[index]
            mode = fx.detect_fake_mode([node.meta.get("example_value")])
            node.replace_all_uses_with(_build(gm.graph, split, mode))
    gm.graph.lint()
    gm.recompile()


class MaskGuard:
    """Runs ``compiled`` while the rebuilt inputs hold the values it assumes; else ``eager``."""

    def __init__(self, compiled, eager, assumed: dict[int, DiagonalSplit], name: str):
        self.compiled, self.eager, self.assumed, self.name = compiled, eager, assumed, name
        self.checked: dict[int, tuple] = {}  # position -> (weakref to the tensor, its version) last seen to hold
        self.warned = False

    def _holds(self, index: int, t) -> bool:
        seen = self.checked.get(index)
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            return True
        if not isinstance(t, torch.Tensor) or diagonal_split(t) != self.assumed[index]:
            return False
        self.checked[index] = (weakref.ref(t), t._version)
        return True

    def __call__(self, *args):
        # Called as the compiled function is: with the inputs, or with one list of them (boxed).
        boxed = len(args) == 1 and isinstance(args[0], list)
        inputs = args[0] if boxed else args
        if all(self._holds(i, inputs[i]) for i in self.assumed):
            return self.compiled(*args)
        if not self.warned:
            warnings.warn(f"{self.name}: a mask input no longer holds the values it was compiled for; "
                          "running that call uncompiled", stacklevel=2)
            self.warned = True
        out = self.eager(*inputs)
        if boxed:
            inputs.clear()  # the boxed convention: the callee frees its inputs
        return out
