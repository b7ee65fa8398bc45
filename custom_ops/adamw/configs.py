"""The AdamW kernel's launch config.

Fixed on purpose, like the attention tiles: the update is bound by memory bandwidth, and
``benchmarks/bench_adamw.py`` sweeps the alternatives (docs/decisions.md).
"""

# Elements and warps per program: 8 elements a thread (one 16-byte bf16 vector per stream)
# keep registers low enough for 2 programs an SM; 16 a thread allow only one.
BLOCK = 2048
NUM_WARPS = 8
