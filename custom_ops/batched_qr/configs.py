"""The batched QR's launch configs, and the table of where it beats torch, measured on the H200.

Launch configs (``QRConfig``; the tests pass smaller ones so that the interpreter reaches every
path on small matrices): which matrices are one register tile, the panel width nb, when a panel
is too tall for registers and streams, the apply kernel's tiles, and ``tl.dot``'s precision.

``prefer_ours`` reads ``SPEED_TABLE``: ``benchmarks/bench_qr.py`` measured ours and torch on
square fp32 matrices (its printed table and JSON hold every figure). A shape's class is
its larger side s = max(m, n) rounded up to the next measured size, and the batch B; ours
is preferred when the measured row for that class and op says so at a batch no larger than B
(ours gains with the batch: torch loops over the matrices, our grid covers them all at once).
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
    precision: str = "tf32x3"      # tl.dot's input_precision: "tf32x3" or "ieee" (bench_qr.py measured both)


DEFAULT = QRConfig()


def tile_warps(elements: int) -> int:
    """Warps of a register tile: about 16 fp32 elements a thread, 1 to 16 warps. (Triton lays a
    tile of 32 columns one column a lane, so every vector over rows costs a register per row a
    thread holds: 32 rows a thread spilled.)"""
    return max(1, min(16, elements // 512))


# device name -> op -> rows (largest side s up to, least batch B at which ours was faster); a
# class whose row says None was measured slower at every batch tried. Filled from
# benchmarks/bench_qr.py's run on the H200 (the report and the benchmark's JSON have the figures).
SPEED_TABLE: dict[str, dict[str, tuple[tuple[int, int | None], ...]]] = {}


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
    side = max(shape[-2:])
    batch = 1
    for d in shape[:-2]:
        batch *= d
    for largest_side, least_batch in rows:
        if side <= largest_side:
            return least_batch is not None and batch >= least_batch
    return False
