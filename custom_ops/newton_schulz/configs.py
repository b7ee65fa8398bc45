"""Tiles of the two Newton–Schulz kernels: the symmetric product (``Syrk``) and the
polynomial update (``Gemm``).

Fixed on purpose, like the attention tiles: autotuning would cost compile time inside a
training step. The default (``TILES``) was measured on an H200 against the other candidates
that ``benchmarks/bench_newton_schulz.py --sweep`` times (BENCHMARKS.md).
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


TILES = Tiles(Syrk(128, 2, 64, 8, 3), Gemm(128, 256, 64, 8, 8, 3))
