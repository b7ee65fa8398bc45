"""The leaderboard's timing code (docs/reference.md §1) with one added line: ``compile_step``.

    python benchmarks/leaderboard_harness.py                       # full config on the GPU, the reference model
    python benchmarks/leaderboard_harness.py --model mymodels:build --rep 3000 --warmup 1000
    python benchmarks/leaderboard_harness.py --no-compile          # the same code, uncompiled
    python benchmarks/leaderboard_harness.py --offload-activations 0.88  # the added line with offload
    torchrun --nproc-per-node 2 benchmarks/leaderboard_harness.py --model mymodels:build  # two GPUs, sharded

The train step is written exactly as the leaderboard times it: a closure over
the model and optimizer, timed with ``triton.testing.do_bench(train_step,
rep=30_000, warmup=10_000)`` (``--rep``/``--warmup`` shorten it). The one line
this package adds is marked below; ``--offload-activations`` passes that option
in it. On a machine without a GPU do_bench cannot time, so the step is timed
with the wall clock instead (said in the output).

Under ``torchrun`` each rank builds the same model, ``compile_stack.shard``
shards it by its repeated blocks (FSDP2), the optimizer is built over the
shards, and each rank steps on its share of the global batch; the step's time
is the slowest rank's. Only rank 0 prints and records.
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
from compile_stack import distributed  # noqa: E402
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
    p.add_argument("--batch", type=int, help="override the preset's (global) batch; --batch 1 on one GPU is one "
                   "rank's share of the full preset on two")
    p.add_argument("--model", metavar="MODULE:FACTORY", help="a model factory (run_step.py's --model); "
                   "default: the reference model")
    p.add_argument("--rep", type=int, default=30_000, help="do_bench's rep, ms")
    p.add_argument("--warmup", type=int, default=10_000, help="do_bench's warmup, ms")
    p.add_argument("--no-compile", action="store_true", help="time the step as written, uncompiled")
    add_offload_option(p)
    p.add_argument("--json", type=Path, metavar="FILE", help="write the figures to FILE")
    args = p.parse_args(argv)
    if args.batch is not None and args.batch < 1:
        p.error(f"--batch: expected a positive number of sequences, got {args.batch}")
    for name in ("rep", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: expected a positive number of milliseconds, got {getattr(args, name)}")
    if args.offload_activations not in (None, False) and args.no_compile:
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
    rank, world = 0, 1
    if distributed.is_distributed():
        rank, world, device = distributed.setup_distributed()
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = PRESETS[args.preset or ("full" if device.type == "cuda" else "tiny")]
    cfg = cfg.with_overrides(layers=args.layers, seq=args.seq, batch=args.batch)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    if args.model:
        model = build_user_model(load_user_code(args.model, "model"), cfg, device, dtype)
    else:
        model = build_model(cfg, device, dtype)
    inputs = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), device=device)
    targets = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), device=device)
    if world > 1:  # every rank the same model and batch (one seed); each its shard and share
        compile_stack.shard(model)
        inputs, targets = (distributed.shard_batch(t, rank, world) for t in (inputs, targets))
    optimizer = AdamW(model.parameters())

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

    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"config {cfg}; model {args.model or 'reference'}; compiled {not args.no_compile}; {world} process(es)",
        flush=True)
    t0 = time.perf_counter()
    train_step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    say(f"first step (compiles): {first_s:.1f} s", flush=True)
    if device.type == "cuda":
        import triton.testing

        ms = triton.testing.do_bench(train_step, rep=args.rep, warmup=args.warmup, return_mode="median")
        timer = "triton.testing.do_bench (median)"
    else:
        ms = wall_clock_bench(train_step, args.rep, args.warmup)
        timer = "wall clock (no GPU: do_bench needs CUDA), median"
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None
    if world > 1:
        ranks = [None] * world
        torch.distributed.all_gather_object(ranks, (ms, peak))
        ms, peak = max(r[0] for r in ranks), None if peak is None else max(r[1] for r in ranks)
    result = {"config": cfg.__dict__, "model": args.model or "reference", "compiled": not args.no_compile,
              "world_size": world,
              "offload_activations": args.offload_activations,
              "first_step_s": round(first_s, 2), "step_ms": round(ms, 2), "timer": timer,
              "peak_mem_gib": peak,  # per rank (the largest) under torchrun
              "passes": compile_stack.pass_report() if not args.no_compile else None}
    say(json.dumps(result), flush=True)
    if args.json and rank == 0:
        args.json.write_text(json.dumps(result, indent=2))
    if device.type == "cuda" and not args.no_compile and rank == 0:
        over = [f"{n} {v}" for n, v in (("layers", args.layers), ("seq", args.seq), ("batch", args.batch)) if v]
        size = ", ".join([args.preset or "full", *over])
        append_result(f"leaderboard harness + `compile_step`, {size} step, {world} × {torch.cuda.get_device_name()}, "
                      f"{args.model or 'reference model'}{offload_label(args.offload_activations)}",
                      f"{ms:,.1f} ms, peak {result['peak_mem_gib']:.2f} GiB, first step {first_s:.1f} s", None,
                      extra={"figures": result})
    return result


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
