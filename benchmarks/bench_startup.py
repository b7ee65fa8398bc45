"""Start-up time against depth: the cold and warm first step of ``run_step.py --compile``.

For each depth, one process with empty caches (cold), then ``--warm`` processes on the same
caches (warm); each reports its first, compiling call (``compile_s`` of run_step's ``--json``)
and the process's whole wall time. The widths are the preset's (``tiny`` by default, a CPU's),
so what grows with depth is per-block and per-parameter host work, which a warm start should
not have (the block compiles once). A benchmark, not a test: nothing here asserts a time.

    python benchmarks/bench_startup.py                                  # tiny widths, 2, 8 and 34 layers
    python benchmarks/bench_startup.py --layers 2,34 --warm 2 --json out/startup.json
    python benchmarks/bench_startup.py --preset full --device cuda      # on a GPU
    python benchmarks/bench_startup.py --layers 2,16 --model examples/transformers_llama.py:build_llama \
        --optimizer torch.optim:AdamW                                   # a transformers model
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import append_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def first_step(layers: int, cache: Path, fresh: bool, args) -> dict:
    """One run_step process: its first (compiling) call, that call's phases (run_step's ``startup``)
    and the process's wall time, in seconds."""
    with tempfile.NamedTemporaryFile(suffix=".json") as summary:
        cmd = [sys.executable, str(ROOT / "run_step.py"), "--compile", "--preset", args.preset, "--layers",
               str(layers), "--steps", "1", "--warmup", "0", "--device", args.device, "--cache-dir", str(cache),
               "--json", summary.name, *(["--fresh-cache"] if fresh else []),
               *(["--model", args.model] if args.model else []),
               *(["--optimizer", args.optimizer] if args.optimizer else [])]
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"run_step.py failed at {layers} layers:\n{done.stderr[-2000:]}")
        figures = json.loads(Path(summary.name).read_text())
        return {"compile_s": figures["compile_s"], "wall_s": round(wall, 1), "startup": figures.get("startup")}


def warm_firsts(row: dict) -> str:
    """A depth's warm first steps, as the table and the record show them."""
    return " / ".join(f"{w['compile_s']:.1f}" for w in row["warm"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="2,8,34", help="comma-separated depths (default 2,8,34)")
    parser.add_argument("--warm", type=int, default=2, help="warm processes after each cold one (default 2)")
    parser.add_argument("--preset", default="tiny", help="run_step.py preset whose widths are used (default tiny)")
    parser.add_argument("--device", default="cpu", help="run_step.py --device (default cpu)")
    parser.add_argument("--model", help="run_step.py --model MODULE:FACTORY (default: the reference model)")
    parser.add_argument("--optimizer", help="run_step.py --optimizer MODULE:CLASS (default: the reference AdamW)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--record", action="store_true", help="append the figures to benchmarks/results.jsonl")
    args = parser.parse_args(argv)
    try:
        depths = [int(x) for x in args.layers.split(",")]
    except ValueError:
        parser.error(f"--layers: expected comma-separated integers, got {args.layers!r}")
    if args.warm < 1 or any(d < 1 for d in depths):
        parser.error("--warm and every --layers depth: expected at least 1")

    rows = []
    with tempfile.TemporaryDirectory(prefix="cstack_startup_") as caches:
        for layers in depths:
            cache = Path(caches) / str(layers)
            print(f"{layers} layers: cold ...", flush=True)
            cold = first_step(layers, cache, True, args)
            warm = []
            for i in range(args.warm):
                print(f"{layers} layers: warm {i + 1}/{args.warm} ...", flush=True)
                warm.append(first_step(layers, cache, False, args))
            rows.append({"layers": layers, "cold": cold, "warm": warm})

    print(f"\n{'layers':>6}  {'cold first step':>16}  {'warm first step':>24}  (process wall, s)")
    for row in rows:
        walls = " / ".join(f"{w['wall_s']:.0f}" for w in row["warm"])
        print(f"{row['layers']:>6}  {row['cold']['compile_s']:>14.1f} s  {warm_firsts(row):>22} s  "
              f"(cold {row['cold']['wall_s']:.0f}, warm {walls})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if args.record:
        figures = "; ".join(f"{r['layers']} layers: cold {r['cold']['compile_s']:.1f} s, warm {warm_firsts(r)} s"
                            for r in rows)
        base, deepest = rows[0], rows[-1]
        best = lambda row: min(w["compile_s"] for w in row["warm"])  # noqa: E731
        against = (f"{deepest['layers']} against {base['layers']} layers, same call: warm "
                   f"{best(deepest) / best(base):.2f}x, cold {deepest['cold']['compile_s'] / base['cold']['compile_s']:.2f}x")
        model = f", model {args.model}" if args.model else ""
        optimizer = f", optimizer {args.optimizer}" if args.optimizer else ""
        append_result(f"start-up against depth, {args.preset} widths, {args.device}{model}{optimizer}", figures, against)
    return 0


if __name__ == "__main__":
    sys.exit(main())
