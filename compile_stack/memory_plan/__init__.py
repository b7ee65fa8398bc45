"""The memory plan: what each graph saves for its backward, recomputes, or keeps in host memory.

``MemoryPlan`` (``plan.py``) is the one object a step's backends ask; below it
the ledger of the device's memory (``ledger.py``), the budgeted partitioner
(``partitioner.py``), shared-block plans (``share.py``), activation offload
(``offload.py``), what a warm start recalls (``records.py``, ``host_pinning.py``),
sizes and the pre-allocation estimate (``sizes.py``, ``estimate.py``). May
import ``caches`` and below (passes, custom_ops); never ``backend`` or ``capture``.
"""
from compile_stack.memory_plan.plan import MemoryPlan

__all__ = ["MemoryPlan"]
