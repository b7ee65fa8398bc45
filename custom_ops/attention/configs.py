"""Launch configs of every attention kernel, and the constants the kernels share.

The Triton kernels take their tiles from the (head dim, dtype) table (``pick_config``); the
Gluon Hopper kernels have one shape each (``HOPPER_FWD``; ``HOPPER_BWD`` per head dim). The Triton
delta kernel also writes the Gluon backward's row stats, in tiles of that backward's query
tile: ``HOPPER_BWD_ROWS`` is the one constant both read.
"""
import os
from dataclasses import dataclass

import torch
import triton.language as tl

HEAD_DIMS = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Tiles:
    """One kernel's launch shape: a query tile, a key tile, warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class AttnConfig:
    """Tiles of the forward kernel and of the two backward kernels (dK/dV and dQ)."""

    fwd: Tiles
    dkdv: Tiles
    dq: Tiles


# Triton kernels, keyed by (head dim, dtype): one table for every CUDA GPU, chosen on Hopper
# (sm_90); tests/gpu_compile.py checks that the 16-bit rows fit a block's shared memory on
# sm_90 and on sm_100 (B200). Fixed on purpose: autotuning would cost compile time the
# whole-step budget does not have. The D=64 and D=128 16-bit rows are the winners of
# `benchmarks/bench_attention.py --sweep` on an H200 (docs/decisions.md); the other rows are
# untimed guesses.
_SM90_16BIT = {
    16: AttnConfig(Tiles(128, 64, 4, 3), Tiles(32, 128, 4, 3), Tiles(128, 64, 4, 3)),
    32: AttnConfig(Tiles(128, 64, 4, 3), Tiles(32, 128, 4, 3), Tiles(128, 64, 4, 3)),
    64: AttnConfig(Tiles(128, 64, 8, 3), Tiles(32, 128, 4, 3), Tiles(128, 64, 8, 4)),
    128: AttnConfig(Tiles(256, 64, 8, 3), Tiles(64, 128, 8, 3), Tiles(128, 64, 8, 3)),
    256: AttnConfig(Tiles(64, 64, 4, 2), Tiles(32, 64, 4, 2), Tiles(64, 32, 4, 2)),
}
_SM90_FP32 = {
    16: AttnConfig(Tiles(64, 32, 4, 2), Tiles(32, 64, 4, 2), Tiles(64, 32, 4, 2)),
    32: AttnConfig(Tiles(64, 32, 4, 2), Tiles(32, 64, 4, 2), Tiles(64, 32, 4, 2)),
    64: AttnConfig(Tiles(64, 32, 4, 2), Tiles(32, 64, 4, 2), Tiles(64, 32, 4, 2)),
    128: AttnConfig(Tiles(64, 32, 4, 2), Tiles(32, 64, 4, 1), Tiles(64, 32, 4, 1)),
    256: AttnConfig(Tiles(32, 32, 4, 1), Tiles(16, 32, 4, 1), Tiles(32, 16, 4, 1)),
}
CONFIGS = {
    **{(d, dt): cfg for dt in (torch.bfloat16, torch.float16) for d, cfg in _SM90_16BIT.items()},
    **{(d, torch.float32): cfg for d, cfg in _SM90_FP32.items()},
}
# Under the interpreter: small tiles, with unequal query/key tiles so tests cover that.
INTERPRETER_CONFIG = AttnConfig(Tiles(32, 16, 4, 1), Tiles(16, 32, 4, 1), Tiles(32, 16, 4, 1))
DELTA_BLOCK_M = 64  # rows per program of the delta kernel when it writes delta alone


def pick_config(head_dim: int, dtype: torch.dtype) -> AttnConfig:
    """The tile table entry for this head dim and dtype (tiny tiles under the interpreter)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return INTERPRETER_CONFIG
    return CONFIGS[(head_dim, dtype)]


# The Gluon forward: 128 queries per program in two compute warp groups of 64 (num_warps: per
# compute warp group), 128-key K/V tiles in a 3-deep ring.
HOPPER_FWD = Tiles(block_m=128, block_n=128, num_warps=4, num_stages=3)
HOPPER_FWD_COMPUTE_REGS = 232  # registers per thread set for the worker compute warp group (the load warp: 24)

# The Gluon backward's query tile. Its row stats (each tile's lse·log2(e), then its delta) come
# from one buffer that the Triton delta kernel writes in tiles of exactly these rows (``_delta``
# given lse), so the two kernels must agree on it.
HOPPER_BWD_ROWS = 64
# The Gluon backward per head dim it takes (on sm_90, 16-bit; others run the Triton kernels): these
# query rows by 128 keys, 8 warps; the depth of its Q/dO ring as measured on the H200
# (docs/decisions.md): D=128 2 (3 ran 10% slower), D=64 5 (3.32 ms against 3.63 at 2).
HOPPER_BWD = {d: Tiles(block_m=HOPPER_BWD_ROWS, block_n=128, num_warps=8, num_stages=stages)
              for d, stages in ((64, 5), (128, 2))}
# Whether the backward runs its causal diagonal tiles (the two whose keys reach past some of their
# queries) in a loop of their own before an unmasked loop over the rest, per head dim. At D=128
# that leaves ptxas no spills (80 B with the mask tested in the loop) and ran 0.9-1.6% faster on
# the H200; at D=64 (no spills either way) 4% slower (docs/decisions.md, 67fd7d2).
HOPPER_BWD_PEEL_DIAGONAL = {64: False, 128: True}
# Whether the backward writes dK and dV through K's and V's shared-memory tiles and TMA stores,
# per head dim, instead of straight from registers: at D=128 1.58 ms (1.9%) faster on the H200, at
# D=64 0.74 ms (22%) slower (paired runs, docs/decisions.md, 76e270a).
HOPPER_BWD_TMA_EPILOGUE = {64: False, 128: True}
HOPPER_HEAD_DIMS = tuple(HOPPER_BWD)
DQ_FRAGMENT_ROW = 256  # the fp32 dQ buffer seen as rows of 256 for its TMA descriptor (the box's widest)

LOG2E = 1.4426950408889634  # host copy, folded into qk_scale
_LOG2E = tl.constexpr(LOG2E)  # kernel copies
_LN2 = tl.constexpr(0.6931471805599453)
