"""Every private torch API the project uses, behind one wall.

torch keeps no promise for names that start with an underscore (``torch._dynamo``,
``torch._inductor``, ``torch._functorch``, ``torch._subclasses``, ``torch.utils._pytree``,
``torch._C``). The rest of the project imports them only from here, so a torch upgrade that
moves one breaks this package and ``tests/test_torch_internals.py``, which checks each name on
every torch in ``CHECKED_ON``, rather than a pass or a backend somewhere (``tests/test_layout.py``
keeps it so).

- ``dynamo``: Dynamo's frame evaluation, resume frames, tracer and automatic-dynamic hook.
- ``aot``: AOTAutograd's backend factory, partitioner and config.
- ``inductor``: Inductor's compile entry, config, graph passes, caches and code output.
- ``fx``: fake tensors, pytree, FX graph-module internals, op overloads and the C bindings.
- ``fsdp``: FSDP2 state's pre- and post-forward, run around compiled pieces.

This package imports only torch.
"""
# torch versions (major.minor) on which every name here was checked by tests/test_torch_internals.py.
CHECKED_ON = ("2.11", "2.13")
