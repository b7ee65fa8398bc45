"""The leaderboard's step on two GPUs: your model, sharded, compiled by compile-stack; prints ms per step.

    uv run main.py                                  # your model package if installed, else the reference
    uv run main.py --model my_package.model:build   # any factory(vocab_size, context_length, d_model, ...)
    uv run main.py --preset tiny --rep 1 --warmup 1 # a CPU smoke run (gloo)

It starts its own processes (one per GPU, ``--nproc``; two gloo processes on
a CPU), so no ``torchrun`` is needed (under torchrun it runs as the rank it is
given). Each rank builds the same model (one seed), ``compile_stack.shard``
shards it with FSDP2 by its repeated blocks (skip it if your factory calls
``fully_shard`` itself: compile_step finds that too), the optimizer is built
over the shards, and each rank steps on its share of the global batch. The
step is the leaderboard's as published, timed by ``triton.testing.do_bench``
(the wall clock on a CPU, where do_bench cannot time); the one added line is
marked. Rank 0 prints one line: the slowest rank's median ms per step.
"""
import argparse
import importlib
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import compile_stack
from compile_stack import distributed
from compile_stack.workloads.config import PRESETS
from compile_stack.workloads.reference import AdamW, build_model, cross_entropy

# Your course's model package, used when it is installed (add it to pyproject.toml's dependencies).
DEFAULT_MODEL = "cs336_basics.model:BasicsTransformerLM"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="MODULE:FACTORY",
                   help="your model's factory; the reference model where its module is not installed")
    p.add_argument("--preset", choices=sorted(PRESETS), help="model size (default: full on GPUs, tiny on a CPU)")
    p.add_argument("--nproc", type=int, help="processes (default: 2 GPUs, or 2 gloo processes on a CPU)")
    p.add_argument("--rep", type=int, default=30_000, help="do_bench's rep, ms")
    p.add_argument("--warmup", type=int, default=10_000, help="do_bench's warmup, ms")
    args = p.parse_args(argv)
    if ":" not in args.model:
        p.error(f"--model: expected MODULE:FACTORY, got {args.model!r}")
    nproc = args.nproc or (min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2)
    if nproc < 1 or (torch.cuda.is_available() and nproc > torch.cuda.device_count()):
        p.error(f"--nproc: expected 1 to {torch.cuda.device_count() or 'any'} processes, got {nproc}")
    args.nproc = nproc
    return args


def user_factory(spec: str):
    """The factory ``MODULE:FACTORY`` names, or None when its module is not installed."""
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            return None
        raise


def wall_clock_ms(fn, rep: int, warmup: int) -> float:
    for deadline, times in ((warmup, None), (rep, [])):
        start = time.perf_counter()
        while (time.perf_counter() - start) * 1e3 < deadline or (times is not None and not times):
            t0 = time.perf_counter()
            fn()
            if times is not None:
                times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(args) -> float:
    """This rank's part: build, shard, compile, time; returns the slowest rank's ms per step."""
    rank, world, device = distributed.setup_distributed()
    cfg = PRESETS[args.preset or ("full" if device.type == "cuda" else "tiny")]
    torch.manual_seed(0)
    factory = user_factory(args.model)
    with torch.device(device):
        model = (factory(vocab_size=cfg.vocab, context_length=cfg.seq, d_model=cfg.d_model, num_layers=cfg.layers,
                         num_heads=cfg.heads, d_ff=cfg.d_ff).to(torch.bfloat16)
                 if factory is not None else build_model(cfg, device, torch.bfloat16))
    inputs = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), device=device)
    targets = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), device=device)
    if world > 1:
        compile_stack.shard(model)  # drop this if your factory calls fully_shard itself
        inputs, targets = (distributed.shard_batch(t, rank, world) for t in (inputs, targets))
    optimizer = AdamW(model.parameters())

    # ---- the leaderboard's code, as published ----
    def train_step():
        optimizer.zero_grad(set_to_none=True)
        logits = model(inputs)
        loss = cross_entropy(logits, targets).sum()
        loss.backward()
        optimizer.step()

    train_step = compile_stack.compile_step(train_step)  # the one added line
    # ----------------------------------------------

    if device.type == "cuda":
        import triton.testing

        ms = triton.testing.do_bench(train_step, rep=args.rep, warmup=args.warmup, return_mode="median")
    else:
        ms = wall_clock_ms(train_step, args.rep, args.warmup)
    times = [None] * world
    dist.all_gather_object(times, ms)
    if rank == 0:
        which = args.model if factory is not None else "the reference model"
        print(f"{max(times):.1f} ms per step ({which}, {cfg.layers} layers, {world} × "
              f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'})", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return max(times)


def _spawned(rank, port, nproc, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_RANK=str(rank))
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    run(args)


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # started by torchrun
        run(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(port, args.nproc, args), nprocs=args.nproc)


if __name__ == "__main__":
    main(sys.argv[1:])
