"""The batched QR's launch configs, and the table of where it beats torch, measured on the H200.

Launch configs (``QRConfig``; the tests pass smaller ones so that the interpreter reaches every
path on small matrices): which matrices are one register tile, the panel width nb, when a panel
is too tall for registers and streams, the apply kernel's tiles, and ``tl.dot``'s precision.

``prefer_ours`` reads ``SPEED_TABLE``: ``benchmarks/bench_qr.py`` measured ours and torch on
square fp32 matrices of sides 32, 176, 352, 512, 1024, 2048 and 4096 (dense Gaussian, batches
1, 4, 16 and the competition batch; its printed table and JSON hold every figure). A shape's
class is its larger side s = max(m, n) and its batch B (the product of the leading dimensions).
For each measured side the table holds the least measured batch from which on ours was faster
at every larger measured batch (ours gains with the batch: torch loops over the matrices, our
grid covers them all at once), or None where ours lost at every batch tried. A side between two
measured sides takes the stricter of their two rows; one up to 32 takes the row of 32; one
above 4096 is never preferred. Non-square shapes are classed by their larger side: a tall,
thin matrix is cheaper for both, and no such shape was measured.
"""
import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class QRConfig:
    tile_max: int = 64 * 64        # a whole matrix is one register tile up to this many (padded) elements
    nb: int = 32                   # panel width of the blocked factorisation (>= 16: tl.dot's least)
    panel_max: int = 256 * 32      # a panel held in registers up to this many (padded) elements, else streamed
    stream_bm: int = 128           # rows a chunk of the streamed panel
    stream_warps: int = 8
    bm: int = 64                   # the apply kernel's row chunk and column tile
    bn: int = 64
    apply_warps: int = 4
    # tl.dot's input_precision: "tf32x3" or "ieee". On the H200 (a tuning run before the final
    # kernels) 40×176 took 0.85 ms with tf32x3 and 1.26 ms with ieee, orthogonality 1.4e-5 and
    # 7.4e-6 (torch 9.7e-6); plain "tf32" rounds the inputs to 10 mantissa bits.
    precision: str = "tf32x3"
    # Alternatives measured in that tuning run (the kernels as committed, bar renames), QR ms on the
    # H200: panel_max 128·32: 0.88 vs 0.55 at 40×176; stream_bm 256 on 16 warps: 141 vs 121 at
    # 2×4096; apply_warps 8: 26.5 vs 22.3 at 640×512.


DEFAULT = QRConfig()


def tile_warps(elements: int) -> int:
    """Warps of a register tile: about 16 fp32 elements a thread, 1 to 16 warps. (Triton lays a
    tile of 32 columns one column a lane, so every vector over rows costs a register per row a
    thread holds: 32 rows a thread spilled.)"""
    return max(1, min(16, elements // 512))


# device name -> op -> ((measured side, least batch at which ours won, None: never), ...), sides
# ascending. From benchmarks/bench_qr.py on the H200, 2026-12-01 (torch 2.11.0+cu130, triton 3.6.0):
# e.g. side 512: batch 1 ours 2.61 ms vs torch 1.87, batch 4 ours 2.66 vs 7.33; side 4096: batch 1
# 119.8 vs 28.4, batch 2 121.2 vs 56.8.
SPEED_TABLE: dict[str, dict[str, tuple[tuple[int, int | None], ...]]] = {
    "NVIDIA H200": {
        "qr": ((32, 1), (176, 1), (352, 4), (512, 4), (1024, 4), (2048, 4), (4096, None)),
        "geqrf": ((32, 4), (176, 4), (352, 4), (512, 4), (1024, 4), (2048, 4), (4096, None)),
    },
}


def table_prefers(rows, side: int, batch: int) -> bool:
    """What a SPEED_TABLE row list says for a matrix of larger side ``side`` in a batch of ``batch``."""
    for i, (measured, least) in enumerate(rows):
        if side <= measured:
            bounds = [least] if side == measured or i == 0 else [rows[i - 1][1], least]
            return None not in bounds and batch >= max(bounds)
    return False


def prefer_ours(shape, device, op: str = "qr", *, dtype: torch.dtype = torch.float32) -> bool:
    """Whether cstack::batched_qr (op "qr") or batched_geqrf (op "geqrf") was measured faster than
    torch.linalg.qr / torch.geqrf for a tensor of ``shape`` and ``dtype`` on ``device``. False for
    CPU devices, dtypes other than fp32 (the op refuses them), devices without a measured table,
    shapes larger than the largest measured class, and zero-size shapes."""
    if op not in ("qr", "geqrf"):
        raise ValueError(f"op: expected 'qr' or 'geqrf', got {op!r}")
    device = torch.device(device)
    shape = tuple(shape)
    if device.type != "cuda" or dtype != torch.float32 or len(shape) < 2 or 0 in shape:
        return False
    rows = SPEED_TABLE.get(torch.cuda.get_device_name(device), {}).get(op, ())
    batch = 1
    for d in shape[:-2]:
        batch *= d
    return table_prefers(rows, max(shape[-2:]), batch)
