"""An optimizer over FSDP2's sharded parameters, stepped on their local shards.

Dynamo cannot trace a hand-written update's ``p.data -= …`` on a DTensor
(``set_`` fails under fake tensors), and a DTensor update reaches the AdamW
pass as something other than the one-process update. So while the compiled
update runs, every DTensor the optimizer holds (its parameters, in lists, in
``param_groups`` and as keys of ``state``; its moments) is swapped for a plain
tensor aliasing its local shard (``swap_in``), each parameter's alias given the local
gradient shard: the update is the one-process update of this rank's shard,
fused as in one process, and in-place changes land in FSDP2's storage.
Afterwards everything is swapped back (``swap_out``), and state the step created (a lazily
made moment under a parameter's key) is wrapped as a DTensor sharded like its
parameter: ``state_dict()`` / ``load_state_dict()`` see the user's parameters
and DTensors, as without us (torch.distributed.checkpoint saves them).
"""
import torch
from torch.distributed.tensor import DTensor

_DEPTH = 4  # optimizer attribute -> list of groups -> group -> its list of params


class LocalShards:
    """Swaps ``optimizer``'s DTensors for local aliases (``swap_in``) and back (``swap_out``)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.aliases: dict[int, tuple[DTensor, torch.Tensor]] = {}  # id(DTensor) -> (it, its local alias)
        self.origins: dict[int, DTensor] = {}  # id(alias) -> its DTensor

    def _alias(self, t: DTensor) -> torch.Tensor:
        known = self.aliases.get(id(t))
        local = t.to_local()
        if known is None or known[0] is not t or known[1].data_ptr() != local.data_ptr():
            alias = local.detach()
            self.aliases[id(t)] = (t, alias)
            self.origins[id(alias)] = t
            return alias
        return known[1]

    def _walk(self, obj, fn, key_fn, depth=0):
        """Replace, in place, the tensors in lists and dict values and the tensor keys of dicts."""
        if depth > _DEPTH:
            return
        if isinstance(obj, list):
            for i, x in enumerate(obj):
                if isinstance(x, torch.Tensor):
                    obj[i] = fn(x)
                else:
                    self._walk(x, fn, key_fn, depth + 1)
        elif isinstance(obj, dict):
            items = list(obj.items())
            if any(isinstance(k, torch.Tensor) for k, _ in items):
                obj.clear()
                obj.update((key_fn(k) if isinstance(k, torch.Tensor) else k, v) for k, v in items)
            for k, v in obj.items():
                if isinstance(v, torch.Tensor):
                    obj[k] = fn(v)
                elif isinstance(v, (list, dict)):
                    self._walk(v, fn, key_fn, depth + 1)

    def _roots(self):
        return [v for v in vars(self.optimizer).values() if isinstance(v, (list, dict))]

    def holds_dtensors(self) -> bool:
        found = []
        for root in self._roots():
            self._walk(root, lambda t: found.append(t) or t, lambda k: found.append(k) or k)
        return any(isinstance(t, DTensor) for t in found)

    @torch.compiler.disable
    def swap_in(self) -> list[DTensor]:
        """The optimizer holds local aliases from now, each parameter's with its local gradient; returns
        the parameters (to hand to ``swap_out``)."""
        params = []

        def key(k):
            if isinstance(k, DTensor):
                params.append(k)
                return self._alias(k)
            return k

        def value(t):
            if not isinstance(t, DTensor):
                return t
            if isinstance(t, torch.nn.Parameter):
                params.append(t)
            return self._alias(t)

        with torch.no_grad():
            for root in self._roots():
                self._walk(root, value, key)
            for p in params:
                self._alias(p).grad = None if p.grad is None else p.grad.to_local().detach()
        return params

    @torch.compiler.disable
    def swap_out(self, params: list[DTensor]) -> None:
        """The optimizer holds its DTensors again; new state of a parameter's local shape wrapped as one."""

        def back(t):
            return self.origins.get(id(t), t)

        with torch.no_grad():
            for root in self._roots():
                self._walk(root, back, back)
            for p in params:
                self._alias(p).grad = None
            self._wrap_new_state()

    def _wrap_new_state(self) -> None:
        """State made in the step under a parameter's key, of its local shape: a DTensor like the parameter."""
        state = getattr(self.optimizer, "state", None)
        if not isinstance(state, dict):
            return
        for p, entry in state.items():
            if not isinstance(p, DTensor) or not isinstance(entry, dict):
                continue
            local = self._alias(p)
            for name, t in entry.items():
                if (isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.dim() > 0
                        and t.shape == local.shape):
                    wrapped = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                                                 shape=p.shape, stride=p.stride())
                    self.aliases[id(wrapped)] = (wrapped, t)
                    self.origins[id(t)] = wrapped
                    entry[name] = wrapped
