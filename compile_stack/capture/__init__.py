"""Capture of the user's step: finding what it reaches (models, optimizers, repeated blocks) and
turning it into graphs for the backend (``step.py``: ``compile_step``), a model sharded by FSDP2
included (``fsdp_modules.py``, ``local_shards.py``). May import ``backend``,
``memory_plan``, ``caches`` and below; never ``distributed``, ``workloads`` or ``harness``."""
