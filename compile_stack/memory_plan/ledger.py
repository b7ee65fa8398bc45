"""What a step's graphs may save for their backward, on one device: the ledger of its sizes.

The memory left for a graph's saved activations:

- the device's usable memory (``sizes.USABLE_FRACTION`` of it);
- minus what is allocated when the graph is compiled (parameters, buffers,
  any state that exists), and the state the step will create: an optimizer
  that has no state yet for a parameter is taken to create two moments of
  its size (Adam's; more than SGD needs, so the plan errs safe);
- minus what the step's other graphs save (their plans, as reserved);
- minus one graph's working set in its backward: the largest budget-1.0 set
  of any graph (one block's backward holds that while it recomputes) and a
  fixed allowance for kernels' scratch (the fused loss's logits chunk).

Gradients are not subtracted: they appear as the backward frees saved
activations, and the larger of the two is what is alive at once.
"""
import weakref
from collections.abc import Callable

import torch

from compile_stack.memory_plan import sizes
from custom_ops.linear_cross_entropy import CHUNK_BYTES as CE_CHUNK_BYTES

# Kernels' scratch beside the saved activations: the fused loss's logits chunk and its head gradient.
SCRATCH_BYTES = 2 * CE_CHUNK_BYTES


class MemoryLedger:
    """What a step's graphs may save for their backward, on one device.

    ``capacity`` is the device's usable bytes; ``kept()`` what lives across
    steps: what is allocated and the state the step will still create (an
    optimizer's lazily created moments). A compiled step calls
    ``at_step_start()`` as it starts: graphs compiled later in it (a piece
    after the blocks) and the shares settled after it count what was kept
    then, not the blocks' saved activations, which the blocks' reservation
    already counts, and the moments once, whether they exist yet or not.
    """

    def __init__(self, capacity: float, allocated: Callable[[], int], future_state: Callable[[], int],
                 host_capacity: int = 0, device: torch.device | None = None):
        self.capacity = capacity
        self.device = device  # where the saved activations live (offload moves those of it)
        self.host_capacity = host_capacity  # host bytes saved activations may take (0: offload off)
        self.host_reserved: dict[str, int] = {}
        self._allocated = allocated
        self.resident: int | None = None  # kept() at the step's start, once known
        self.future_state = future_state
        self.reserved: dict[str, int] = {}  # graph key -> bytes its saved activations take (all uses)
        self.workings: dict[str, int] = {}  # graph key -> its working set
        self.working = 0  # the largest working set of any graph planned so far

    @classmethod
    def for_device(cls, device: torch.device, optimizers: list, host_bytes: int = 0,
                   accumulating: list | None = None) -> "MemoryLedger":
        """The ledger of a step on ``device``; saved activations may also take ``host_bytes`` of the
        host's memory (0: offload off, ``host.py`` chooses it). A step that accumulates gradients over micro-batches has
        the gradients of the parameters ``accumulating`` alive through every forward after its
        first, so they count as state to come. It holds the optimizers and parameters weakly:
        Dynamo's caches keep our backends, and through them this ledger, alive after the step
        is gone."""
        refs = [weakref.ref(opt) for opt in optimizers]
        params = [weakref.ref(p) for p in accumulating or ()]

        def future_state() -> int:
            return (lazy_optimizer_state_bytes([opt for ref in refs if (opt := ref()) is not None])
                    + gradients_to_come_bytes([p for ref in params if (p := ref()) is not None]))

        return cls(sizes.USABLE_FRACTION * sizes.device_bytes(device), lambda: torch.cuda.memory_allocated(device),
                   future_state, host_bytes, device)

    def at_step_start(self) -> None:
        self.resident = self._allocated() + self.future_state()

    def kept(self) -> int:
        return self._allocated() + self.future_state() if self.resident is None else self.resident

    def available(self, key: str, working: int) -> int:
        """Bytes the graph ``key`` may save, given its working set ``working``."""
        others = sum(b for k, b in self.reserved.items() if k != key)
        return int(self.capacity - self.kept() - others
                   - max(self.working, working) - SCRATCH_BYTES)

    def host_available(self, key: str) -> int:
        """Host bytes the graph ``key`` may move its saved activations to."""
        return self.host_capacity - sum(b for k, b in self.host_reserved.items() if k != key)

    def reserve(self, key: str, saved: int, working: int, host: int = 0) -> None:
        self.reserved[key] = saved
        self.host_reserved[key] = host
        self.workings[key] = working
        self.working = max(self.working, working)


def lazy_optimizer_state_bytes(optimizers: list) -> int:
    """Two moments per parameter (its local shard, if sharded) for each optimizer that has no
    state for it yet."""
    total = 0
    for opt in optimizers:
        state = getattr(opt, "state", {})
        for group in getattr(opt, "param_groups", ()):
            total += sum(2 * sizes.tensor_bytes(getattr(p, "_local_tensor", p)) for p in group["params"]
                         if not state.get(p))
    return total


def gradients_to_come_bytes(params: list) -> int:
    """The gradients (their local shards, if sharded) of the parameters that train and have none yet."""
    return sum(sizes.tensor_bytes(getattr(p, "_local_tensor", p)) for p in params
               if p.requires_grad and p.grad is None)
