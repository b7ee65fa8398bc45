"""The RoPE kernel's launch config.

Fixed on purpose: the rotation is bound by memory bandwidth. On the H200, q and k of the 8B step
([2, 32, 32768, 128] bf16 each) took 580 µs at 32 rows and 4 warps a program (3.7 TB/s) against
584–650 µs at 16–64 rows and 2–8 warps, and 619–1,093 µs at 128 rows (docs/decisions.md).
"""

# Rows (vectors of the rotated last dim) and warps per program.
BLOCK_ROWS = 32
NUM_WARPS = 4
