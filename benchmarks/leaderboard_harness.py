"""The leaderboard's timing code (docs/reference.md §1) with one added line: ``compile_step``.

    python benchmarks/leaderboard_harness.py                       # full config on the GPU, the reference model
    python benchmarks/leaderboard_harness.py --model mymodels:build --rep 3000 --warmup 1000
    python benchmarks/leaderboard_harness.py --no-compile          # the same code, uncompiled
    python benchmarks/leaderboard_harness.py --offload-activations 0.88  # the added line with offload

The train step is written exactly as the leaderboard times it: a closure over
the model and optimizer, timed with ``triton.testing.do_bench(train_step,
rep=30_000, warmup=10_000)`` (``--rep``/``--warmup`` shorten it). The one line
this package adds is marked below; ``--offload-activations`` passes that option
in it. On a machine without a GPU do_bench cannot time, so the step is timed
with the wall clock instead (said in the output).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import compile_stack  # noqa: E402
from compile_stack.workloads.config import PRESETS  # noqa: E402
from compile_stack.workloads.reference import AdamW, build_model, cross_entropy  # noqa: E402
from compile_stack.harness.user_code import build_user_model, load_user_code  # noqa: E402
from compile_stack.harness.options import HelpFormatter, add_offload_option, check_offload, offload_label  # noqa: E402
from benchmarks.results import append_result  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="model size (default: full on a GPU, tiny on a CPU)")
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--seq", type=int, help="override the preset's sequence length")
    p.add_argument("--model", metavar="MODULE:FACTORY", help="a model factory (run_step.py's --model); "
                   "default: the reference model")
    p.add_argument("--rep", type=int, default=30_000, help="do_bench's rep, ms")
    p.add_argument("--warmup", type=int, default=10_000, help="do_bench's warmup, ms")
    p.add_argument("--no-compile", action="store_true", help="time the step as written, uncompiled")
    add_offload_option(p)
    p.add_argument("--json", type=Path, metavar="FILE", help="write the figures to FILE")
    args = p.parse_args(argv)
    for name in ("rep", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: expected a positive number of milliseconds, got {getattr(args, name)}")
    if args.offload_activations and args.no_compile:
        p.error("--offload-activations: needs the compiled step (not --no-compile)")
    check_offload(args, p)
    return args


def wall_clock_bench(fn, rep: int, warmup: int) -> float:
    """Median ms of ``fn`` by the wall clock, after ``warmup`` ms of calls, over ``rep`` ms of calls."""
    for deadline, times in ((warmup, None), (rep, [])):
        start = time.perf_counter()
        while (time.perf_counter() - start) * 1e3 < deadline or (times is not None and not times):
            t0 = time.perf_counter()
            fn()
            if times is not None:
                times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = PRESETS[args.preset or ("full" if device.type == "cuda" else "tiny")]
    cfg = cfg.with_overrides(layers=args.layers, seq=args.seq)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    if args.model:
        model = build_user_model(load_user_code(args.model, "model"), cfg, device, dtype)
    else:
        model = build_model(cfg, device, dtype)
    optimizer = AdamW(model.parameters())
    inputs = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), device=device)
    targets = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), device=device)

    # ---- the leaderboard's code, as published ----
    def train_step():
        optimizer.zero_grad(set_to_none=True)
        logits = model(inputs)
        loss = cross_entropy(logits, targets).sum()
        loss.backward()
        optimizer.step()

    if not args.no_compile:  # the one added line:
        train_step = compile_stack.compile_step(train_step, offload_activations=args.offload_activations)
    # ----------------------------------------------

    print(f"config {cfg}; model {args.model or 'reference'}; compiled {not args.no_compile}", flush=True)
    t0 = time.perf_counter()
    train_step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    print(f"first step (compiles): {first_s:.1f} s", flush=True)
    if device.type == "cuda":
        import triton.testing

        ms = triton.testing.do_bench(train_step, rep=args.rep, warmup=args.warmup, return_mode="median")
        timer = "triton.testing.do_bench (median)"
    else:
        ms = wall_clock_bench(train_step, args.rep, args.warmup)
        timer = "wall clock (no GPU: do_bench needs CUDA), median"
    result = {"config": cfg.__dict__, "model": args.model or "reference", "compiled": not args.no_compile,
              "offload_activations": args.offload_activations,
              "first_step_s": round(first_s, 2), "step_ms": round(ms, 2), "timer": timer,
              "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
              "passes": compile_stack.pass_report() if not args.no_compile else None}
    print(json.dumps(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if device.type == "cuda" and not args.no_compile:
        over = [f"{n} {v}" for n, v in (("layers", args.layers), ("seq", args.seq)) if v]
        size = ", ".join([args.preset or "full", *over])
        append_result(f"leaderboard harness + `compile_step`, {size} step, 1 × {torch.cuda.get_device_name()}, "
                      f"{args.model or 'reference model'}{offload_label(args.offload_activations)}",
                      f"{ms:,.1f} ms, peak {result['peak_mem_gib']:.2f} GiB, first step {first_s:.1f} s", None,
                      extra={"figures": result})
    return result


if __name__ == "__main__":
    main()
