"""The torch.compile backend: Inductor with our passes installed (``pass_backend.py``), the
captured graph split at repeated blocks (``segments.py``), compile settings, inspection, pass
records kept true on warm caches. May import ``memory_plan``, ``caches`` and below (passes,
custom_ops); never ``capture`` or ``distributed``."""
from compile_stack.backend.pass_backend import PassBackend

__all__ = ["PassBackend"]
