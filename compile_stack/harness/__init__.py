"""run_step.py's harness: what measures, checks and compares the step, not what builds it.

The library (``compile_step``, the backend, repeated blocks, FSDP2, the memory
plan) never imports this package; the harness uses the library as a user does.
One phase of a run a module: ``options`` (the command line, checked before any
work), ``plan`` (device, config, budget, fit), ``user_code``, ``build``,
``check``, ``measure``, ``profiling``, ``compare`` (with ``stock``), ``report``.
"""
