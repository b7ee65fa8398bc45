"""run_step.py's options checked before any work: each refusal is one line naming the option
(the offload option also benchmarks/leaderboard_harness.py's).

A bad option found only after the model was built (or after the whole run,
for an output path) would cost the run; so every check that needs no model
runs at parse time.
"""
import argparse
import os
import tempfile
from pathlib import Path

import torch

from compile_stack import caches, distributed
from compile_stack.memory_plan.host import MIN_RESERVE_BYTES, RESERVE_FRACTION
from compile_stack.memory_plan.options import check_options
from compile_stack.memory_plan.sizes import GIB
from compile_stack.workloads.config import PRESETS, ModelConfig
from passes import registry

OVERRIDES = ("layers", "seq", "batch", "d_model", "heads", "d_ff", "vocab")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends an option's default only where it has one (not None or False) and its help does
    not already say it."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_offload_option(p: argparse.ArgumentParser) -> None:
    """``--offload-activations [SHARE]``: run_step.py's and benchmarks/leaderboard_harness.py's."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--offload-activations", nargs="?", const=True, default=None, type=float, metavar="SHARE",
                       help="on one GPU: keep what a larger memory budget would save, beyond the GPU's room, in "
                            "pinned host memory between forward and backward instead of recomputing it, within "
                            "SHARE of the host's memory (default, and without SHARE: on, within the host's free "
                            f"memory less a reserve of max({MIN_RESERVE_BYTES // GIB} GiB, 1/{1 / RESERVE_FRACTION:.0f} "
                            "of it))")
    group.add_argument("--no-offload-activations", dest="offload_activations", action="store_false",
                       help="recompute what does not fit the GPU instead of offloading it")


def check_offload(args, p: argparse.ArgumentParser, budget=None) -> None:
    """Refuse a share outside (0, 1), offload with a fixed budget (memory_plan/options.py) and offload
    asked for under torchrun."""
    try:
        check_options(budget, args.offload_activations, "--memory-budget", "--offload-activations")
    except ValueError as e:
        p.error(str(e))
    if args.offload_activations not in (None, False) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        p.error("--offload-activations: one GPU only (not built for FSDP2 under torchrun)")


def offload_label(share: bool | float | None) -> str:
    """What a figure's name adds for an offload setting (docs/benchmarks.md's table keys on it)."""
    return ("" if share is None else ", no activation offload" if share is False
            else ", activation offload" if share is True else f", activation offload ({share:g} of host memory)")


def check_args(args, p: argparse.ArgumentParser) -> None:
    """Refuse (``p.error``) what run_step cannot run: bad numbers, devices, configs, passes, user-code
    specs and unwritable outputs."""
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
    if args.offload_activations not in (None, False) and not args.compile:
        p.error("--offload-activations: needs --compile")
    check_offload(args, p, args.memory_budget)
    for option in ("model", "loss", "optimizer"):
        spec = getattr(args, option)
        if spec is not None and (spec.count(":") != 1 or not all(spec.split(":"))):
            p.error(f"--{option}: expected MODULE:NAME (e.g. mymodels:{option}), got {spec!r}")
    device = check_device(args, p)
    if args.preset or device.type != "cuda":  # else the preset is chosen by memory, once the device is known
        try:
            config_of(args, args.preset or "tiny")
        except SystemExit as e:
            p.error(str(e))
    if args.passes:
        try:
            registry.resolve(passes_of(args))
        except ValueError as e:
            p.error(f"--{e}")
    check_outputs(args, p)


def passes_of(args) -> list[str] | None:
    """``--passes`` as names; None: every registered pass."""
    return args.passes.split(",") if args.passes else None


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
    cache_dir = args.cache_dir if args.cache_dir is not None else caches.default_cache_dir()
    for option, path in (("inspect", args.inspect), ("cache-dir", cache_dir)):
        if path is None:
            continue
        path = path.expanduser()
        expected = f"--{option}: expected a writable directory"
        if option == "cache-dir" and args.cache_dir is None:
            expected += f" (the default, ${caches.CACHE_ENV} or ~/.cache/compile_stack)"
        if path.exists() and not path.is_dir():
            p.error(f"{expected}, got {str(path)!r}, which is not a directory")
        why = _writable_dir_error(path)
        if why:
            p.error(f"{expected}, got {str(path)!r}: {why}")
