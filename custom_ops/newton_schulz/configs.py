"""Tiles of the two Newton–Schulz kernels: the symmetric product (``Syrk``) and the
polynomial update (``Gemm``).

Fixed on purpose, like the attention tiles: autotuning would cost compile time inside a
training step. The default (``TILES``) won ``benchmarks/bench_newton_schulz.py --sweep`` on an
H200 (five steps at 4096×4096 / 4096×11008): SYRK 128×128 tiles, 8 warps, 3 stages (two programs
an SM) 2.23 / 5.09 ms; 4 stages 2.36 / 5.22; 4 warps 2.25 / 5.03; split 2 2.57 / 5.51 (its 272
tiles at 4096 rows fill 2.06 waves of 132 SMs, against 528 tiles in 4); the GEMM's 128×256×64
with 3 stages beat 4 stages, 256×128 and 128×128 by 1–5%.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Syrk:
    """Square output subtiles of ``block`` (the tile grid must mirror onto itself), ``split`` of them
    side by side per program ([block, split·block] tiles: wider tiles reuse each loaded row tile
    more), the reduction step, warps, stages."""

    block: int
    split: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Gemm:
    """Output tile, reduction step, row panels per group (L2 reuse of the X column panels), warps, stages."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Tiles:
    syrk: Syrk
    gemm: Gemm

    @property
    def row_unit(self) -> int:
        """Rows of each matrix are padded to a multiple of this: whole tiles of both kernels, so a
        tile never straddles two matrices of a batch (the batch is flattened into rows)."""
        return max(self.syrk.split * self.syrk.block, self.gemm.block_m)

    @property
    def col_unit(self) -> int:
        """Columns of X one tile spans (the SYRK's reduction step, the GEMM's output tile)."""
        return max(self.syrk.block_k, self.gemm.block_n)


TILES = Tiles(Syrk(128, 1, 64, 8, 3), Gemm(128, 256, 64, 8, 8, 3))
