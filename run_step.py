"""Run the leaderboard's train step, eagerly or compiled with our passes and kernels.

    python run_step.py                 # eager reference step, default preset
    python run_step.py --compile       # compiled: our passes + Triton kernels + Inductor
    python run_step.py --compile --model mymodels:build_gpt --loss mymodels:my_loss   # your own code
    torchrun --nproc-per-node 2 run_step.py --compile   # data parallel, FSDP2-sharded (compile_stack/distributed.py)

Prints the config, compile time, median step time, tokens/s, peak memory, MFU,
the loss and what each of our passes replaced. See --help for the options.
"""
import argparse
import copy
import gc
import importlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import compile_stack
from compile_stack import distributed, memory, settings
from compile_stack.config import H200_PEAK_BF16_FLOPS, PRESET_ORDER, PRESETS, ModelConfig
from compile_stack.harness.profiling import profile_overlap
from compile_stack.reference import AdamW, build_model, cross_entropy
from compile_stack.user_step import StepOptions
from custom_ops import adamw as adamw_op
from custom_ops import linear_cross_entropy as lce_op
from passes import registry

# Read at CUDA's first allocation: a step that plans to fill ~120 GiB cannot afford fragmentation.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

OVERRIDES = ("layers", "seq", "batch", "d_model", "heads", "d_ff", "vocab")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--compile", action="store_true", help="compile the step (default: run it eagerly)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="model size (default: the largest that fits; tiny on CPU)")
    for name in OVERRIDES:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"override the preset's {name}")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first (compiling) step")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="model dtype")
    p.add_argument("--seed", type=int, default=0)
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
    p.add_argument("--check", action="store_true",
                   help="also run the eager reference step from the same weights and data and report relative errors")
    p.add_argument("--inspect", type=Path, metavar="DIR", help="write graphs before/after our passes and Inductor's code to DIR")
    p.add_argument("--json", type=Path, metavar="FILE", help="write a machine-readable summary to FILE")
    p.add_argument("--cache-dir", type=Path, help=f"compile caches (default: ${settings.CACHE_ENV} or ~/.cache/compile_stack)")
    p.add_argument("--fresh-cache", action="store_true", help="start from empty compile caches (a cold start)")
    p.add_argument("--compare", choices=("stock",),
                   help="also time the step built from stock PyTorch parts, in this process once ours is freed "
                        "(sharded with FSDP2 under torchrun)")
    p.add_argument("--profile", type=Path, metavar="FILE", help="write a torch.profiler trace of one step and print a breakdown")
    p.add_argument("--force", action="store_true", help="run even if the memory estimate says the config does not fit")
    args = p.parse_args(argv)
    for name in OVERRIDES:
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive integer, got {value}")
    for name in ("steps", "warmup"):
        if getattr(args, name) < 0:
            p.error(f"--{name}: expected a non-negative integer, got {getattr(args, name)}")
    if args.steps < 1:
        p.error("--steps: expected at least 1 timed step")
    if args.inspect and not args.compile:
        p.error("--inspect: needs --compile (there are no compiled graphs to inspect otherwise)")
    if args.memory_budget is not None and not 0.0 <= args.memory_budget <= 1.0:
        p.error(f"--memory-budget: expected a fraction in [0, 1], got {args.memory_budget}")
    for option in ("model", "loss", "optimizer"):
        spec = getattr(args, option)
        if spec is not None and (spec.count(":") != 1 or not all(spec.split(":"))):
            p.error(f"--{option}: expected MODULE:NAME (e.g. mymodels:{option}), got {spec!r}")
    device = check_device(args, p)
    if args.preset or device.type != "cuda":  # else the preset is chosen by memory: checked in run()
        try:
            config_of(args, args.preset or "tiny")
        except SystemExit as e:
            p.error(str(e))
    if args.passes:
        try:
            registry.resolve(args.passes.split(","))
        except ValueError as e:
            p.error(f"--{e}")
    check_outputs(args, p)
    return args


def check_device(args, p: argparse.ArgumentParser) -> torch.device:
    """--device names cpu, cuda or cuda:N that this machine has; the device the run will use."""
    if distributed.is_distributed():
        return torch.device("cuda")  # torchrun: each rank takes its own GPU
    if args.device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        p.error(f"--device: expected cpu, cuda or cuda:N, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device: expected cpu on this machine (no CUDA GPU is available), got {args.device!r}")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        p.error(f"--device: expected cuda:0 to cuda:{torch.cuda.device_count() - 1}, got {args.device!r}")
    return device


def config_of(args, preset: str) -> ModelConfig:
    """The preset with the command-line overrides; a bad combination exits naming the option."""
    overrides = {name: getattr(args, name) for name in OVERRIDES}
    try:
        return PRESETS[preset].with_overrides(**overrides)
    except ValueError as e:  # "heads: expected ...": ModelConfig names the field
        field, _, message = str(e).partition(": ")
        option = f"--{field.replace('_', '-')}" if field in OVERRIDES else field
        raise SystemExit(f"{option}: {message} (preset {preset})") from None


def _writable_dir_error(path: Path) -> str | None:
    """Why files cannot be created in ``path`` (made with its parents if missing), or None if they can.

    Makes nothing: probes with a temporary file in the nearest directory that exists."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"{str(probe)!r} is not a directory"
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        return f"cannot write in {str(probe)!r} ({e.strerror or e})"
    return None


def check_outputs(args, p: argparse.ArgumentParser) -> None:
    """Every file and directory the run writes is writable, checked before any work (a summary
    is not lost to a bad --json path after the whole run)."""
    for option in ("json", "profile"):
        path = getattr(args, option)
        if path is None:
            continue
        expected = f"--{option}: expected a writable file path"
        if path.is_dir():
            p.error(f"{expected}, got {str(path)!r}, which is a directory")
        if not path.parent.is_dir():
            p.error(f"{expected} in an existing directory, got {str(path)!r} "
                    f"(no directory {str(path.parent)!r})")
        if path.exists() and not os.access(path, os.W_OK):
            p.error(f"{expected}, got {str(path)!r}, which is not writable")
        why = _writable_dir_error(path.parent)
        if why:
            p.error(f"{expected}, got {str(path)!r}: {why}")
    cache_dir = args.cache_dir if args.cache_dir is not None else settings.default_cache_dir()
    for option, path in (("inspect", args.inspect), ("cache-dir", cache_dir)):
        if path is None:
            continue
        path = path.expanduser()
        expected = f"--{option}: expected a writable directory"
        if option == "cache-dir" and args.cache_dir is None:
            expected += f" (the default, ${settings.CACHE_ENV} or ~/.cache/compile_stack)"
        if path.exists() and not path.is_dir():
            p.error(f"{expected}, got {str(path)!r}, which is not a directory")
        why = _writable_dir_error(path)
        if why:
            p.error(f"{expected}, got {str(path)!r}: {why}")


def load_object(spec: str, option: str):
    """``MODULE:NAME`` -> the object; MODULE is an importable module or a path to a .py file."""
    module_name, name = spec.split(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise SystemExit(f"--{option}: no such file {module_name!r}")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_spec.name] = module  # Dynamo looks a traced function's module up by name
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise SystemExit(f"--{option}: cannot import {module_name!r}: {e}") from None
    if not hasattr(module, name):
        raise SystemExit(f"--{option}: module {module_name!r} has no {name!r}")
    return getattr(module, name)


def build_user_model(factory, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The user's model from ``--model``'s factory, on ``device`` in ``dtype``."""
    with torch.device(device):
        model = factory(vocab_size=cfg.vocab, context_length=cfg.seq, d_model=cfg.d_model, num_layers=cfg.layers,
                        num_heads=cfg.heads, d_ff=cfg.d_ff)
    if not isinstance(model, torch.nn.Module):
        raise SystemExit(f"--model: expected a factory returning an nn.Module, got {type(model).__name__}")
    return model.to(device=device, dtype=dtype)


def make_train_step(model, loss_fn, optimizer):
    """The leaderboard's step (REFERENCE.md §1) over the given model, loss and optimizer."""

    def train_step(inputs, targets):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets).sum()
        loss.backward()
        optimizer.step()
        return loss

    return train_step


def is_rank0() -> bool:
    """Whether this process prints and writes files: the only one, or torchrun's rank 0."""
    return os.environ.get("RANK", "0") == "0"


def log(msg: str) -> None:
    if is_rank0():
        print(msg, flush=True)


def choose_config(args, device: torch.device, device_bytes: float, world: int,
                  nbytes: int) -> tuple[str, ModelConfig, str]:
    """The preset (given, or the largest that fits) with the command-line overrides applied."""
    if args.preset:
        return args.preset, config_of(args, args.preset), "given"
    if device.type != "cuda":
        return "tiny", config_of(args, "tiny"), "no GPU: tiny runs on the CPU"
    for name in PRESET_ORDER:
        cfg = config_of(args, name)
        estimate = memory.estimate_peak_bytes(cfg, args.compile, 0.0, nbytes, world)
        if memory.fits(estimate, device_bytes):
            return name, cfg, (f"largest preset whose estimate ({estimate / memory.GIB:.0f} GiB) fits the GPU's "
                               f"{device_bytes / memory.GIB:.0f} GiB")
    return "tiny", config_of(args, "tiny"), "nothing larger fits"


def choose_budget(args, cfg: ModelConfig, device: torch.device, device_bytes: float, world: int,
                  reference_fsdp: bool, nbytes: int) -> float | None:
    """The budget given; None (compile_step fits each graph's plan to the GPU, budget.py) but for
    the reference model's FSDP step, whose own backends take the largest budget whose estimate fits."""
    if args.memory_budget is not None or not args.compile or device.type != "cuda" or not reference_fsdp:
        return args.memory_budget
    for budget in [b / 100 for b in range(100, -1, -1)]:
        if memory.fits(memory.estimate_peak_bytes(cfg, True, budget, nbytes, world), device_bytes):
            return budget
    return 0.0


class FirstCallTimer:
    """Wraps a step; remembers how long its first (compiling) call took, synchronized."""

    def __init__(self, step):
        self.step = step
        self.first_s = None

    def __call__(self, *batch):
        if self.first_s is not None:
            return self.step(*batch)
        t0 = time.perf_counter()
        loss = self.step(*batch)
        loss.detach().item()  # synchronizes
        self.first_s = time.perf_counter() - t0
        _raise_on_bad_targets()
        return loss


def timed_steps(step, batch, n: int, device: torch.device) -> tuple[list[float], float]:
    """Milliseconds per step (CUDA events on a GPU, the wall clock on a CPU), and the last loss."""
    times = []
    for i in range(n):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step(*batch)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            loss = step(*batch)
            times.append((time.perf_counter() - t0) * 1e3)
        _raise_on_bad_targets()  # synced above: the flags cost no extra wait, outside the timing
        log(f"  step {i + 1}/{n}: {times[-1]:.1f} ms")
    return times, loss.detach().item()


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / memory.GIB
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / memory.GIB


def measure(step: FirstCallTimer, batch, args, device, cfg: ModelConfig, label: str) -> dict:
    """First (compiling) step unless it already ran, warm-up, timed steps; the summary figures."""
    if step.first_s is None:
        log(f"[{label}] first step (compiles when compiled)...")
        step(*batch)
    log(f"[{label}] first step took {step.first_s:.1f} s")
    for i in range(args.warmup):
        step(*batch)
        log(f"[{label}] warm-up {i + 1}/{args.warmup}")
    log(f"[{label}] timing {args.steps} steps...")
    times, loss = timed_steps(step, batch, args.steps, device)
    step_ms = statistics.median(times)
    return {
        "compile_s": round(step.first_s, 2),
        "step_ms": round(step_ms, 2),
        "tokens_per_s": round(cfg.tokens / (step_ms / 1e3), 1),
        "peak_mem_gib": round(peak_memory_gib(device), 2),
        "mfu": round(cfg.flops_per_step / (step_ms / 1e3) / H200_PEAK_BF16_FLOPS, 4),
        "loss": round(loss, 5),
    }


def across_ranks(figures: dict, world: int) -> None:
    """``measure``'s figures of this rank made the step's, in place: per-rank times and peaks, the
    slowest rank's time, the largest peak, and MFU as a share of ``world`` GPUs' peak."""
    figures.update(distributed.rank_summary(figures["step_ms"], figures["peak_mem_gib"]))
    figures["mfu"] = round(figures["mfu"] / world, 4)


def run(args) -> dict:
    rank, world = 0, 1
    if distributed.is_distributed():
        if args.check:
            raise SystemExit("--check: not supported under torchrun; run it in one process")
        rank, world, device = distributed.setup_distributed()
    else:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device: expected cpu on this machine (no CUDA GPU is available), got cuda")
    device_bytes = memory.device_bytes(device)
    dtype = getattr(torch, args.dtype)
    preset, cfg, why = choose_config(args, device, device_bytes, world, dtype.itemsize)
    reference_fsdp = world > 1 and args.model is None and args.loss is None and args.optimizer is None
    budget = choose_budget(args, cfg, device, device_bytes, world, reference_fsdp, dtype.itemsize)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    log(f"device: {device} ({device_name}); torch {torch.__version__}")
    log(f"preset: {preset} ({why}); config: {cfg}")
    auto = args.compile and budget is None and device.type == "cuda"
    log(f"mode: {'compiled' if args.compile else 'eager'}; dtype {args.dtype}; memory budget: "
        f"{'chosen per graph to fit the GPU (the pass notes say which)' if auto else budget}")
    # With the budget chosen per graph, the estimate at the least budget says whether anything fits.
    estimate = memory.estimate_peak_bytes(cfg, args.compile, 0.0 if auto else 1.0 if budget is None else budget,
                                          dtype.itemsize, world)
    if not memory.fits(estimate, device_bytes) and not args.force:
        raise SystemExit(
            f"config does not fit: estimated peak {estimate / memory.GIB:.1f} GiB "
            f"({'compiled' if args.compile else 'eager'}, budget {budget}) with {device_bytes / memory.GIB:.1f} GiB "
            f"on {device}. "
            "Use a smaller preset or overrides, --compile, a lower --memory-budget, or --force to try anyway."
        )
    # --check keeps a second model and its optimizer state, and runs it eagerly.
    eager_estimate = memory.estimate_peak_bytes(cfg, False, nbytes=dtype.itemsize) + 4 * cfg.params * dtype.itemsize
    if args.check and not memory.fits(eager_estimate, device_bytes) and not args.force:
        raise SystemExit(
            f"--check: the eager reference step it runs next to ours does not fit: estimated peak "
            f"{eager_estimate / memory.GIB:.1f} GiB with {device_bytes / memory.GIB:.1f} GiB on {device}. "
            "Check a smaller config (e.g. --preset small --seq 4096), or --force to try anyway."
        )

    try:
        settings.use_cache_dir(args.cache_dir, fresh=args.fresh_cache and rank == 0)
    except ValueError as e:  # "cache_dir: expected a writable directory ..."
        raise SystemExit(f"--cache-dir: {str(e).partition(': ')[2]}") from None
    if world > 1:
        torch.distributed.barrier()  # rank 0 has emptied the shared caches
    log(f"compile caches: {settings.default_cache_dir()}{' (emptied)' if args.fresh_cache else ''}")
    passes = args.passes.split(",") if args.passes else None
    registry.REPORT.clear()  # this run's replacements only
    pass_names = [p.name for p in registry.resolve(passes)]

    log("building the model...")
    model_factory = load_object(args.model, "model") if args.model else None
    loss_fn = load_object(args.loss, "loss") if args.loss else cross_entropy
    optimizer_class = load_object(args.optimizer, "optimizer") if args.optimizer else AdamW
    torch.manual_seed(args.seed)
    model = build_user_model(model_factory, cfg, device, dtype) if model_factory else build_model(cfg, device, dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the fp32 initialization's blocks
    generator = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    batch = tuple(torch.randint(cfg.vocab, (cfg.batch, cfg.seq), generator=generator).to(device) for _ in range(2))
    compile_options = dict(passes=passes, inspect_dir=args.inspect, memory_budget=budget, blocks=not args.whole_graph)
    reference_model = copy.deepcopy(model) if args.check else None
    if world > 1:
        batch = tuple(distributed.shard_batch(t, rank, world) for t in batch)
    if reference_fsdp:
        options = StepOptions(passes=passes, inspect_dir=args.inspect, memory_budget=budget) if args.compile else None
        step = FirstCallTimer(distributed.DistributedTrainStep(model, AdamW, options))
    else:
        if world > 1:
            distributed.shard_blocks(model)
        step = make_train_step(model, loss_fn, optimizer_class(model.parameters()))
        step = FirstCallTimer(compile_stack.compile_step(step, **compile_options) if args.compile else step)

    summary = {
        "device": str(device), "device_name": device_name, "torch": torch.__version__,
        "preset": preset, "config": cfg.__dict__, "dtype": args.dtype, "compiled": args.compile,
        "model": args.model or "reference", "loss_fn": args.loss or "reference",
        "optimizer": args.optimizer or "reference",
        "memory_budget": budget, "estimated_peak_gib": round(estimate / memory.GIB, 1),
    }
    if args.check:
        from compile_stack.harness.check import STEPS, compare_steps

        log(f"check: {STEPS} steps compiled vs eager from the same weights and data...")
        eager = make_train_step(reference_model, loss_fn, optimizer_class(reference_model.parameters()))
        summary["check"] = compare_steps(step, eager, model, reference_model, [batch] * STEPS)
        del eager, reference_model
        log(f"check: {json.dumps(summary['check'])}")

    summary.update(measure(step, batch, args, device, cfg, "ours"))
    if world > 1:
        across_ranks(summary, world)
        summary["comm_overlap"] = profile_overlap(lambda: step(*batch))
    summary["passes"] = registry.REPORT.as_dict(pass_names)
    summary["pass_notes"] = list(registry.REPORT.notes)
    _raise_on_bad_targets()

    if args.profile:
        from compile_stack.harness.profiling import format_breakdown, profile_step

        rank_cfg = cfg
        if world > 1:
            args.profile = args.profile.with_name(f"{args.profile.stem}.rank{rank}{args.profile.suffix}")
            rank_cfg = cfg.with_overrides(batch=cfg.batch // world)  # the work this rank does
        log(f"profiling one step into {args.profile}...")
        summary["profile"] = profile_step(lambda: step(*batch), rank_cfg, args.profile)
        log(format_breakdown(summary["profile"]))

    if args.compare == "stock":
        del step, model  # the stock step needs the memory back
        user_code = (model_factory, loss_fn, optimizer_class) if args.model or args.loss or args.optimizer else None
        summary["compare"] = compare_stock(args, cfg, device, dtype, batch, summary, world, user_code)
    return summary


def _raise_on_bad_targets() -> None:
    """The fused cross-entropy flags out-of-range targets on device, and the fused AdamW skips its
    update (parameters and moments unchanged) while that flag is set, or on a bad lr/step; read both
    flags after a step that synced, so a bad batch stops the run at the step that saw it."""
    lce_op.check_targets_flag()
    adamw_op.raise_if_refused()


def compare_stock(args, cfg, device, dtype, batch, ours: dict, world: int = 1, user_code=None) -> dict:
    """Build the stock step on fresh weights, once ours is freed, and time it the same way.

    For the reference model: the stock-parts step (stock.py). For the user's own code
    (``user_code``: model factory or None, loss, optimizer class): the same step compiled by
    stock ``torch.compile`` (Inductor, none of our passes).
    Under torchrun it is sharded as ours is (FSDP2, a group per block) and steps on this rank's
    share of the batch; its step time is the slowest rank's, its peak the largest.
    """
    from compile_stack.harness.stock import StockStep

    torch._dynamo.reset()  # compiled code and its guards may still refer to our model
    gc.collect()  # the compiled pieces and their modules refer to each other
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        log(f"[stock] memory still allocated after freeing ours: {torch.cuda.memory_allocated(device) / memory.GIB:.2f} GiB")
    torch.manual_seed(args.seed)
    if user_code is None:
        log("[stock] building the stock step (torch.compile per block, SDPA, checkpointing, fused AdamW)...")
        step = FirstCallTimer(StockStep(build_model(cfg, device, dtype), sharded=world > 1))
    else:
        log("[stock] building your step compiled by stock torch.compile (none of our passes)...")
        factory, loss_fn, optimizer_class = user_code
        model = build_user_model(factory, cfg, device, dtype) if factory else build_model(cfg, device, dtype)
        if world > 1:
            distributed.shard_blocks(model)
        step = FirstCallTimer(torch.compile(make_train_step(model, loss_fn, optimizer_class(model.parameters()))))
    stock = measure(step, batch, args, device, cfg, "stock")
    if world > 1:
        across_ranks(stock, world)
    return {
        "stock": stock,
        "speedup": round(stock["step_ms"] / ours["step_ms"], 3),
        "memory_ratio": round(ours["peak_mem_gib"] / stock["peak_mem_gib"], 3) if stock["peak_mem_gib"] else None,
    }


def print_summary(s: dict) -> None:
    log("")
    log(f"{'mode':<22}{'compiled' if s['compiled'] else 'eager'}")
    for key in ("compile_s", "step_ms", "tokens_per_s", "peak_mem_gib", "mfu", "loss"):
        log(f"{key:<22}{s[key]}")
    for key in ("world_size", "step_ms_per_rank", "peak_mem_gib_per_rank", "comm_overlap"):
        if key in s:
            log(f"{key:<22}{s[key]}")
    log(f"{'passes':<22}{s['passes']}")
    for n in s["pass_notes"]:
        log(f"{'':<22}note: {n}")
    if "check" in s:
        log(f"{'check':<22}{'ok' if s['check']['ok'] else 'FAILED'} {s['check']}")
    if "compare" in s:
        c = s["compare"]
        log(f"{'stock step_ms':<22}{c['stock']['step_ms']} (ours {s['step_ms']}: {c['speedup']}x)")
        log(f"{'stock peak_mem_gib':<22}{c['stock']['peak_mem_gib']} (ours {s['peak_mem_gib']})")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        summary = run(args)
    except torch.OutOfMemoryError as e:
        raise SystemExit(f"out of memory: {str(e).splitlines()[0]}\nTry --memory-budget lower, or a smaller config.")
    print_summary(summary)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if args.json and is_rank0():
        args.json.write_text(json.dumps(summary, indent=2))
        log(f"summary written to {args.json}")
    return 0 if summary.get("check", {}).get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
