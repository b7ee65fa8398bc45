"""Run the leaderboard's train step, eagerly or compiled with our passes and kernels.

    python run_step.py                 # eager reference step, default preset
    python run_step.py --compile       # compiled: our passes + Triton kernels + Inductor
    python run_step.py --compile --model mymodels:build_gpt --loss mymodels:my_loss   # your own code
    torchrun --nproc-per-node 2 run_step.py --compile   # data parallel, FSDP2-sharded (compile_stack/distributed/)

Prints the config, compile time, median step time, tokens/s, peak memory, MFU,
the loss and what each of our passes replaced. See --help for the options.
The step is built by the library (``compile_stack.compile_step``); each phase of
the run is a call into the harness (``compile_stack/harness/``).
"""
import argparse
import sys
from pathlib import Path

import torch

from compile_stack import caches
from compile_stack.capture.targets import raise_on_bad_targets
from compile_stack.harness.build import build_step, use_caches
from compile_stack.harness.check import check_against_eager
from compile_stack.harness.compare import compare_stock
from compile_stack.harness.measure import measure
from compile_stack.harness.options import (OVERRIDES, HelpFormatter, add_offload_option, check_args,
                                           offload_label, passes_of)
from compile_stack.harness.plan import plan_run
from compile_stack.harness.profiling import profile_overlap, profile_rank
from compile_stack.harness.report import is_rank0, pass_summary, print_summary, write_summary
from compile_stack.harness.user_code import StepCode
from compile_stack.memory_plan.fit import MemoryPlanError
from compile_stack.workloads.config import PRESETS


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--compile", action="store_true", help="compile the step (default: run it eagerly)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="model size (default: the largest that fits; tiny on CPU)")
    for name in OVERRIDES:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"override the preset's {name}")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first (compiling) step")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="model dtype")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch")
    p.add_argument("--model", metavar="MODULE:FACTORY",
                   help="your model: FACTORY(vocab_size=, context_length=, d_model=, num_layers=, num_heads=, d_ff=) "
                        "returns an nn.Module mapping token ids [B, S] to logits [B, S, V] (MODULE: an importable "
                        "module or a .py file; default: the reference model)")
    p.add_argument("--loss", metavar="MODULE:FN",
                   help="your loss: FN(logits, targets); the step sums it (default: the reference cross-entropy)")
    p.add_argument("--optimizer", metavar="MODULE:CLASS",
                   help="your optimizer, built as CLASS(model.parameters()) (default: the reference AdamW)")
    p.add_argument("--passes", help="comma-separated passes to run (default: all registered)")
    p.add_argument("--whole-graph", action="store_true",
                   help="compile forward+loss as one graph with every block inlined (compile time grows with "
                        "depth) instead of compiling the model's repeated blocks once for all of them")
    p.add_argument("--memory-budget", type=float,
                   help="activation memory budget in [0, 1] for the partitioner: lower saves less and recomputes "
                        "more (default on a GPU: for each graph, the largest whose plan fits the GPU's memory)")
    add_offload_option(p)
    p.add_argument("--check", action="store_true",
                   help="also run the eager reference step from the same weights and data and report relative errors")
    p.add_argument("--inspect", type=Path, metavar="DIR", help="write graphs before/after our passes and Inductor's code to DIR")
    p.add_argument("--json", type=Path, metavar="FILE", help="write a machine-readable summary to FILE")
    p.add_argument("--cache-dir", type=Path, help=f"compile caches (default: ${caches.CACHE_ENV} or ~/.cache/compile_stack)")
    p.add_argument("--fresh-cache", action="store_true", help="start from empty compile caches (a cold start)")
    p.add_argument("--compare", choices=("stock",),
                   help="also time the step built from stock PyTorch parts, in this process once ours is freed "
                        "(sharded with FSDP2 under torchrun)")
    p.add_argument("--profile", type=Path, metavar="FILE", help="write a torch.profiler trace of one step and print a breakdown")
    p.add_argument("--force", action="store_true",
                   help="run even if the memory estimate says the config (or, with --check, the eager reference "
                        "step beside it) does not fit the device; without it such a run is refused with a config "
                        "that fits")
    args = p.parse_args(argv)
    check_args(args, p)
    return args


def run(args) -> dict:
    """The run, phase by phase; its summary."""
    code = StepCode.from_args(args)  # the user's code, if any: callable as its options say
    plan = plan_run(args)  # device, config and budget; refuses what cannot fit
    code.check_loss(plan.cfg, plan.dtype)
    use_caches(args, plan)
    ours = build_step(args, plan, code)
    summary = plan.summary(args)
    if args.check:
        summary["check"] = check_against_eager(ours, code)
    summary.update(measure(ours.step, ours.batch, args, plan, "ours"))
    if plan.world > 1:
        summary["comm_overlap"] = profile_overlap(lambda: ours.step(*ours.batch))
    summary.update(pass_summary(passes_of(args)))
    raise_on_bad_targets()
    if args.profile:
        summary["profile"] = profile_rank(lambda: ours.step(*ours.batch), plan, args.profile)
    if args.compare == "stock":
        batch = ours.batch
        del ours  # the stock step needs the memory back
        summary["compare"] = compare_stock(args, plan, code, batch, summary)
    return summary


def record(s: dict, args) -> None:
    """A compiled run on a GPU: its figures (and the stock step's) for docs/benchmarks.md's table."""
    if not (s["compiled"] and s["device"].startswith("cuda") and is_rank0()):
        return
    from benchmarks.results import append_result  # a checkout's file, not part of the package

    world = s.get("world_size", 1)
    over = ", ".join(f"{n} {getattr(args, n)}" for n in OVERRIDES if getattr(args, n) is not None)
    code = ", ".join(filter(None, (args.model, args.loss, args.optimizer))) or "reference model"
    figure = (f"{s['preset']} step{f' ({over})' if over else ''}, {world} × {s['device_name']}"
              f"{', FSDP2' if world > 1 else ''}, {code}{offload_label(args.offload_activations)}")
    ours = (f"{s['step_ms']:,.1f} ms, MFU {s['mfu']:.3f}, peak {s['peak_mem_gib']:.2f} GiB"
            f"{'/rank' if world > 1 else ''}, first step {s['compile_s']:.1f} s")
    c = s.get("compare")
    anchor = (None if not c else f"stock step not run: {c['not_run']}" if c.get("stock") is None
              else f"stock step {c['stock']['step_ms']:,.1f} ms ({c['speedup']:.3f}×)")
    append_result(figure, ours, anchor, extra={"summary": s})


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        summary = run(args)
    except MemoryPlanError as e:  # refused as the plan met the step's first graph that cannot fit
        raise SystemExit(str(e)) from None
    except torch.OutOfMemoryError as e:
        raise SystemExit(f"out of memory: {e}\nTry --memory-budget lower, or a smaller config.")
    print_summary(summary)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    write_summary(summary, args.json)
    record(summary, args)
    return 0 if summary.get("check", {}).get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
