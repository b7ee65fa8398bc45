"""Batched fp32 QR on the GPU: cstack::batched_qr / batched_geqrf against torch.linalg.qr / torch.geqrf.

For every shape (batch × m × n) and matrix kind: the median ms of ours (qr, geqrf) and torch's
(CUDA events around each call, a warm-up call first, repeated within a time budget), and the
accuracy of each QR: the worst matrix's ‖A − QR‖_F/‖A‖_F and ‖QᵀQ − I‖_F (float64 maths), and
whether R is exactly upper triangular. Then the geometric mean of the ms over the shapes, per
kind, and a batch sweep on dense Gaussian matrices (the least batch at which ours wins, per
size: configs.SPEED_TABLE is filled from it). Writes $OUT/bench_qr.json when OUT is set and
appends the headline (geometric mean, dense Gaussian) to benchmarks/results.jsonl ($OUT/results.jsonl
when OUT is set, to be appended by hand: the device machine's checkout is not kept). About 2.5 min
on an H200, a third of it torch.linalg.qr on 640 matrices of 512².

    PYTHONPATH=. python benchmarks/bench_qr.py            # all shapes and kinds, the sweep
    PYTHONPATH=. python benchmarks/bench_qr.py --quick    # Gaussian only, no sweep, no result appended
"""
import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.results import append_result  # noqa: E402
from custom_ops.batched_qr import batched_geqrf, batched_qr  # noqa: E402

SHAPES = [(20, 32), (40, 176), (40, 352), (640, 512), (60, 1024), (8, 2048), (2, 4096)]  # (batch, n), square
KINDS = ("gaussian", "rank_deficient", "clustered", "row_scaled", "collinear")
SWEEP_BATCHES = (1, 4, 16)


def make(kind: str, batch: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """A batch of n × n fp32 matrices of one kind, built on the GPU in float64."""
    dev = "cuda"

    def gauss(*shape):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float64)

    if kind == "gaussian":
        a = gauss(batch, n, n)
    elif kind == "rank_deficient":  # rank n/2
        a = gauss(batch, n, max(1, n // 2)) @ gauss(batch, max(1, n // 2), n)
    elif kind == "clustered":  # symmetric, eigenvalues in 3 tight clusters at 1, 1e-2, 1e-4 (Shampoo-like)
        q, _ = torch.linalg.qr(gauss(batch, n, n))
        centres = torch.tensor([1.0, 1e-2, 1e-4], device=dev, dtype=torch.float64)
        s = centres[torch.arange(n, device=dev) % 3] * (1 + 1e-3 * gauss(batch, n))
        a = (q * s[:, None, :]) @ q.mT
    elif kind == "row_scaled":  # rows scaled by 10^U(-4, 4)
        a = 10.0 ** (8 * torch.rand(batch, n, 1, generator=gen, device=dev, dtype=torch.float64) - 4) \
            * gauss(batch, n, n)
    elif kind == "collinear":  # every column one base column plus 1e-4 noise
        a = gauss(batch, n, 1) + 1e-4 * gauss(batch, n, n)
    else:
        raise ValueError(f"kind: unknown {kind!r}")
    return a.float().contiguous()


def time_ms(fn, budget_s: float = 0.3, max_reps: int = 25):
    """(median ms of fn, its last result): a warm-up call, then repeats that fit the budget, at
    least 3 (2 when one call takes over 0.2 s: torch on 640 matrices of 512² takes about a second)."""
    fn()
    torch.cuda.synchronize()
    times = []
    start = time.perf_counter()
    while len(times) < max_reps:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
        least = 2 if times[0] > 200 else 3
        if len(times) >= least and time.perf_counter() - start >= budget_s:
            break
    times.sort()
    return times[len(times) // 2], out


def accuracy(A: torch.Tensor, Q: torch.Tensor, R: torch.Tensor) -> dict:
    """Worst matrix of the batch: ‖A − QR‖/‖A‖, ‖QᵀQ − I‖ (Frobenius, float64), R upper triangular."""
    a, q, r = A.double(), Q.double(), R.double()
    residual = torch.linalg.matrix_norm(a - q @ r) / torch.linalg.matrix_norm(a).clamp_min(1e-300)
    eye = torch.eye(q.shape[-1], dtype=torch.float64, device=q.device)
    orth = torch.linalg.matrix_norm(q.mT @ q - eye)
    return {"residual": residual.max().item(), "orthogonality": orth.max().item(),
            "r_upper": bool((R.tril(-1) == 0).all().item())}


def geqrf_diff(ours, theirs) -> float:
    """max |a − a_torch| / max |a_torch| over the batch (same signs expected for full rank)."""
    return ((ours[0] - theirs[0]).abs().max() / theirs[0].abs().max()).item()


def measure(kind: str, batch: int, n: int, gen: torch.Generator, with_accuracy: bool = True) -> dict:
    A = make(kind, batch, n, gen)
    row = {"kind": kind, "batch": batch, "n": n}
    outputs = {}
    for name, fn in (("ours_qr", batched_qr), ("ours_geqrf", batched_geqrf), ("torch_qr", torch.linalg.qr),
                     ("torch_geqrf", torch.geqrf)):
        row[f"{name}_ms"], outputs[name] = time_ms(functools.partial(fn, A))
    if with_accuracy:
        row["ours"] = accuracy(A, *outputs["ours_qr"])
        row["torch"] = accuracy(A, *outputs["torch_qr"])
        row["geqrf_rel_diff"] = geqrf_diff(outputs["ours_geqrf"], outputs["torch_geqrf"])
    del A, outputs
    torch.cuda.empty_cache()
    return row


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def print_table(rows) -> None:
    print(f"{'kind':15s} {'B×n':>10s} {'ours qr':>9s} {'ours gq':>9s} {'torch qr':>9s} {'torch gq':>9s} "
          f"{'qr x':>6s} {'res ours':>9s} {'res torch':>9s} {'orth ours':>9s} {'orth torch':>10s} {'triu':>4s} "
          f"{'geqrf d':>8s}")
    for r in rows:
        o, t = r["ours"], r["torch"]
        print(f"{r['kind']:15s} {r['batch']:>4d}×{r['n']:<5d} {r['ours_qr_ms']:9.3f} {r['ours_geqrf_ms']:9.3f} "
              f"{r['torch_qr_ms']:9.3f} {r['torch_geqrf_ms']:9.3f} {r['torch_qr_ms'] / r['ours_qr_ms']:6.2f} "
              f"{o['residual']:9.2e} {t['residual']:9.2e} {o['orthogonality']:9.2e} {t['orthogonality']:10.2e} "
              f"{'yes' if o['r_upper'] else 'NO':>4s} {r['geqrf_rel_diff']:8.1e}")


def sweep(gen: torch.Generator) -> list[dict]:
    """Dense Gaussian at batches below each competition batch: where ours starts to win."""
    out = []
    for batch, n in SHAPES:
        for b in SWEEP_BATCHES:
            if b < batch:
                out.append(measure("gaussian", b, n, gen, with_accuracy=False))
    return out


def least_batches(rows) -> dict:
    """Per n and op, the least measured batch from which on ours was faster at every larger measured batch."""
    result = {}
    for n in sorted({r["n"] for r in rows}):
        for op in ("qr", "geqrf"):
            by_batch = sorted((r["batch"], r[f"ours_{op}_ms"] < r[f"torch_{op}_ms"]) for r in rows if r["n"] == n)
            least = None
            for batch, wins in reversed(by_batch):
                if not wins:
                    break
                least = batch
            result.setdefault(str(n), {})[op] = least
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="dense Gaussian only, no sweep, no result appended")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    device = torch.cuda.get_device_name()
    print(f"{device}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    kinds = ("gaussian",) if args.quick else KINDS
    rows = []
    for batch, n in SHAPES:
        for kind in kinds:
            rows.append(measure(kind, batch, n, gen))
            r = rows[-1]
            print(f"  {kind} {batch}x{n}: ours {r['ours_qr_ms']:.3f} ms, torch {r['torch_qr_ms']:.3f} ms", flush=True)
    print_table(rows)
    summary = {}
    for kind in kinds:
        sel = [r for r in rows if r["kind"] == kind]
        summary[kind] = {key: geomean(r[key] for r in sel) for key in
                         ("ours_qr_ms", "ours_geqrf_ms", "torch_qr_ms", "torch_geqrf_ms")}
        s = summary[kind]
        s["worst_accuracy_ratio_vs_torch"] = max(max(r["ours"][key] / max(r["torch"][key], 1e-30) for key in
                                                     ("residual", "orthogonality")) for r in sel)
        print(f"geomean {kind:15s} ours qr {s['ours_qr_ms']:.3f} ms, geqrf {s['ours_geqrf_ms']:.3f} ms | torch qr "
              f"{s['torch_qr_ms']:.3f} ms, geqrf {s['torch_geqrf_ms']:.3f} ms | qr speed-up "
              f"{s['torch_qr_ms'] / s['ours_qr_ms']:.2f}x, worst accuracy ratio ours/torch "
              f"{s['worst_accuracy_ratio_vs_torch']:.2f}")
    sweep_rows = [] if args.quick else sweep(gen)
    for r in sweep_rows:
        print(f"sweep {r['batch']:>4d}×{r['n']:<5d} ours qr {r['ours_qr_ms']:9.3f} geqrf {r['ours_geqrf_ms']:9.3f} | "
              f"torch qr {r['torch_qr_ms']:9.3f} geqrf {r['torch_geqrf_ms']:9.3f}")
    gauss = [r for r in rows if r["kind"] == "gaussian"]
    least = least_batches(gauss + sweep_rows)
    print("least batch at which ours wins (by n):", json.dumps(least))
    figures = {"device": device, "torch": torch.__version__, "triton": triton.__version__, "rows": rows,
               "geomean": summary, "sweep": sweep_rows, "least_batch": least}
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "bench_qr.json"), "w") as f:
            json.dump(figures, f, indent=2)
    if not args.quick:  # under $OUT when set: the device machine's copy of the repository is not kept
        s = summary["gaussian"]
        append_result(f"batched fp32 QR, geomean of 7 shapes (20×32² … 2×4096²), dense Gaussian, {device}",
                      f"{s['ours_qr_ms']:.2f} ms", f"torch.linalg.qr {s['torch_qr_ms']:.2f} ms",
                      extra={"figures": {"geomean": summary, "least_batch": least}},
                      path=Path(out_dir) / "results.jsonl" if out_dir else None)


if __name__ == "__main__":
    main()
