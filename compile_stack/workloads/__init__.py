"""Example user code the harness and tests run: the reference model, loss and AdamW written the
plain way (``reference.py``), its presets (``config.py``), a plain-style Muon (``muon.py``). Not
library: nothing in ``capture``, ``backend``, ``memory_plan`` or ``distributed`` imports it."""
