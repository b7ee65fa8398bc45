"""Muon's Newton–Schulz orthogonalisation on the 8B model's hidden weights: ours vs Inductor.

Per weight shape (4096×4096: wq, wk, wv, wo; 11008×4096: w1, w3; 4096×11008: w2), two rows:
  iterations  the five iterations alone, on the normalised bf16 X exactly as Muon hands it to
              them (wide: rows <= cols; for 11008×4096 weights the transposed, column-major
              view): ``torch.ops.cstack.newton_schulz`` vs ``torch.compile`` of the plain loop;
  zeropower   the whole orthogonalisation of the weight (bf16 cast, transpose, normalise, five
              iterations, transpose back): our ``zeropower`` vs ``torch.compile`` of the plain
              Muon function.
Inductor runs its defaults (no pass of ours: nothing here registers one) with dynamic=False, so
each shape gets its own static graph (cuBLAS matmuls, fused pointwise). ms are medians of
``triton.testing.do_bench``; TFLOP/s count the full, non-symmetric flops of the five iterations
(4m²n + 2m³ each, m <= n), the same figure for both columns; "max |diff|" is the largest
elementwise deviation of ours from the compiled result (bf16 outputs of entries ~1/√n).

The whole model's update: all 34 × 7 hidden matrices orthogonalised one after another as Muon
would (every one of them in GPU memory, each call timed end to end, not multiplied out), ours
vs the compiled function; that figure goes to benchmarks/results.jsonl. ``--sweep`` first times
the tile candidates of each kernel (configs.py), with cuBLAS's rate on the same products for
scale. Writes $OUT/bench_newton_schulz.json when OUT is set. About two minutes on an H200.

    PYTHONPATH=. python benchmarks/bench_newton_schulz.py [--sweep]     # from the repository root
"""
import argparse
import json
import os

import torch
import triton

from benchmarks.results import append_result
from custom_ops.newton_schulz import MUON_COEFFICIENTS, TILES, Gemm, Syrk, Tiles, newton_schulz_triton, zeropower

LAYERS, D, D_FF, STEPS = 34, 4096, 11008, 5
# (name, weight shape, matrices of that shape per layer)
SHAPES = [("wq,wk,wv,wo", (D, D), 4), ("w1,w3", (D_FF, D), 2), ("w2", (D, D_FF), 1)]
SYRK_CANDIDATES = [Syrk(128, 1, 64, 8, 4), Syrk(128, 1, 64, 8, 3), Syrk(128, 2, 64, 8, 3), Syrk(128, 1, 128, 8, 3),
                   Syrk(128, 1, 64, 4, 4)]
GEMM_CANDIDATES = [Gemm(128, 256, 64, 8, 8, 3), Gemm(128, 256, 64, 8, 8, 4), Gemm(256, 128, 64, 8, 8, 3),
                   Gemm(128, 128, 64, 8, 8, 4), Gemm(128, 256, 64, 16, 8, 3)]


def plain_iterations(X):
    """The five iterations as Muon writes them (the code the graph pass replaces by our op)."""
    a, b, c = MUON_COEFFICIENTS
    for _ in range(STEPS):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X


def plain_zeropower(G):
    """Muon's whole orthogonalisation in plain torch."""
    X = G.bfloat16()
    transposed = X.size(-2) > X.size(-1)
    X = X.mT if transposed else X
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    X = plain_iterations(X)
    return X.mT if transposed else X


def flops(shape) -> float:
    m, n = sorted(shape)
    return STEPS * (4.0 * m * m * n + 2.0 * m**3)


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=100, rep=500, return_mode="median")


def wide_normalised(G):
    X = G.mT if G.size(-2) > G.size(-1) else G
    return X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)


def sweep(weights) -> list[dict]:
    """Each kernel's candidates with the other kernel at its default, five steps of the launcher on
    the square and the wide X; and cuBLAS's rate on the three products of one iteration."""
    a, b, c = MUON_COEFFICIENTS
    xs = {name: wide_normalised(weights[name]) for name in ("wq,wk,wv,wo", "w2")}
    rows = []
    combos = [Tiles(s, TILES.gemm) for s in SYRK_CANDIDATES] + [Tiles(TILES.syrk, g) for g in GEMM_CANDIDATES
                                                                 if g != TILES.gemm]
    for tiles in combos:
        row = {"syrk": tiles.syrk.__dict__, "gemm": tiles.gemm.__dict__}
        for name, x in xs.items():
            try:
                ms = bench_ms(lambda: newton_schulz_triton(x, STEPS, a, b, c, tiles=tiles))
                row[name] = {"ms": ms, "TFLOP/s": flops(x.shape) / ms / 1e9}
            except Exception as e:  # a candidate that does not compile or launch is reported, not fatal
                row[name] = {"error": repr(e)[:200]}
        rows.append(row)
        print("sweep", json.dumps(row), flush=True)
    x = xs["w2"]
    A = x @ x.mT
    for label, fn, f in (("cuBLAS X Xt 4096x11008", lambda: x @ x.mT, 2.0 * D * D * D_FF),
                         ("cuBLAS A A 4096", lambda: A @ A, 2.0 * D**3),
                         ("cuBLAS B X 4096x11008", lambda: A @ x, 2.0 * D * D * D_FF)):
        ms = bench_ms(fn)
        rows.append({"cublas": label, "ms": ms, "TFLOP/s": f / ms / 1e9})
        print(f"sweep {label}: {ms:.3f} ms {f / ms / 1e9:.0f} TFLOP/s", flush=True)
    return rows


def time_model(fn, weights_list, reps=3) -> float:
    """Median over ``reps`` of one pass over every matrix (after one warm pass), ms."""
    fn_all = lambda: [fn(w) for w in weights_list]  # noqa: E731
    fn_all()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn_all()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time the tile candidates first")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    weights = {name: torch.randn(shape, device=dev, dtype=torch.bfloat16) for name, shape, _ in SHAPES}
    figures = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "tiles": {"syrk": TILES.syrk.__dict__, "gemm": TILES.gemm.__dict__}, "shapes": []}
    print(f"{figures['device']}  torch {torch.__version__}  triton {triton.__version__}  tiles {TILES}")
    if args.sweep:
        figures["sweep"] = sweep(weights)

    compiled_iterations = torch.compile(plain_iterations, dynamic=False)
    compiled_zeropower = torch.compile(plain_zeropower, dynamic=False)
    a, b, c = MUON_COEFFICIENTS
    ours_iterations = lambda x: torch.ops.cstack.newton_schulz(x, STEPS, a, b, c)  # noqa: E731
    header = f"{'shape':>12s} {'':10s} {'ours ms':>9s} {'Inductor':>9s} {'ours TF/s':>9s} {'Ind TF/s':>9s} " \
             f"{'speedup':>8s} {'max |diff|':>10s} {'rel diff':>9s}"
    print(header)
    for name, shape, count in SHAPES:
        G = weights[name]
        X = wide_normalised(G)
        for label, ours, theirs, arg in (("iterations", ours_iterations, compiled_iterations, X),
                                         ("zeropower", zeropower, compiled_zeropower, G)):
            out_ours, out_theirs = ours(arg).float(), theirs(arg).float()
            diff = (out_ours - out_theirs).abs().max().item()
            rel = ((out_ours - out_theirs).norm() / out_theirs.norm()).item()
            ms_ours, ms_theirs = bench_ms(lambda: ours(arg)), bench_ms(lambda: theirs(arg))
            row = {"weights": name, "shape": list(shape), "per_layer": count, "what": label, "ours_ms": ms_ours,
                   "inductor_ms": ms_theirs, "ours_TFLOPs": flops(shape) / ms_ours / 1e9,
                   "inductor_TFLOPs": flops(shape) / ms_theirs / 1e9, "speedup": ms_theirs / ms_ours,
                   "max_abs_diff": diff, "rel_frobenius_diff": rel}
            figures["shapes"].append(row)
            print(f"{'x'.join(map(str, shape)):>12s} {label:10s} {ms_ours:9.3f} {ms_theirs:9.3f} "
                  f"{row['ours_TFLOPs']:9.0f} {row['inductor_TFLOPs']:9.0f} {row['speedup']:7.2f}x {diff:10.2e} "
                  f"{rel:9.2e}", flush=True)

    del weights
    model = [torch.randn(shape, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS) for _, shape, count in SHAPES
             for _ in range(count)]
    total_flops = sum(flops(w.shape) for w in model)
    ours_ms = time_model(zeropower, model)
    inductor_ms = time_model(compiled_zeropower, model)
    figures["model"] = {"matrices": len(model), "ours_ms": ours_ms, "inductor_ms": inductor_ms,
                        "speedup": inductor_ms / ours_ms, "ours_TFLOPs": total_flops / ours_ms / 1e9,
                        "inductor_TFLOPs": total_flops / inductor_ms / 1e9}
    print(f"whole 8B update, {len(model)} matrices, 5 steps each: ours {ours_ms:.1f} ms "
          f"({figures['model']['ours_TFLOPs']:.0f} TFLOP/s), Inductor {inductor_ms:.1f} ms "
          f"({figures['model']['inductor_TFLOPs']:.0f} TFLOP/s), speedup {inductor_ms / ours_ms:.2f}x")
    append_result(f"Muon Newton-Schulz, 8B hidden weights ({len(model)} matrices, 5 steps), {figures['device']}",
                  f"{ours_ms:.1f} ms", f"Inductor {inductor_ms:.1f} ms", extra={"figures": figures})
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_newton_schulz.json"), "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
