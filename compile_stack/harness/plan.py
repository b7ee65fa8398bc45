"""What a run steps and where, decided before anything is allocated: the device (a rank's under
torchrun), the config (a preset that fits), the memory budget, and the refusal of what cannot fit."""
import dataclasses
import platform

import torch

from compile_stack import distributed
from compile_stack.memory_plan import host, levers, sizes
from compile_stack.memory_plan.estimate import estimate_peak_bytes
from compile_stack.workloads.config import PRESET_ORDER, ModelConfig
from compile_stack.harness import suggest
from compile_stack.harness.options import config_of
from compile_stack.harness.report import log


@dataclasses.dataclass(frozen=True)
class Plan:
    """The run's decisions, shared by its phases."""

    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    preset: str
    cfg: ModelConfig
    budget: float | None  # None: compile_step fits each graph's plan to the GPU, or the partitioner's default
    estimate: float  # the memory model's peak, bytes

    @property
    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else platform.processor() or "cpu"

    def summary(self, args) -> dict:
        """The summary's first entries: what ran, where."""
        return {
            "device": str(self.device), "device_name": self.device_name, "torch": torch.__version__,
            "preset": self.preset, "config": self.cfg.__dict__, "dtype": args.dtype, "compiled": args.compile,
            "model": args.model or "reference", "loss_fn": args.loss or "reference",
            "optimizer": args.optimizer or "reference",
            "memory_budget": self.budget, "estimated_peak_gib": round(self.estimate / sizes.GIB, 1),
        }


def plan_run(args) -> Plan:
    """Join torchrun's process group (if any), choose the config and budget, and refuse a run whose
    estimate does not fit (unless ``--force``)."""
    rank, world = 0, 1
    if distributed.is_distributed():
        if args.check:
            raise SystemExit("--check: not supported under torchrun; run it in one process")
        rank, world, device = distributed.setup_distributed()
    else:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device: expected cpu on this machine (no CUDA GPU is available), got cuda")
    device_bytes = sizes.device_bytes(device)
    dtype = getattr(torch, args.dtype)
    preset, cfg, why = choose_config(args, device, device_bytes, world, dtype.itemsize)
    budget = choose_budget(args, cfg, device, device_bytes, world, dtype.itemsize)
    auto = args.compile and budget is None and device.type == "cuda"
    # With the budget chosen per graph, the levers (memory_plan/levers.py) say whether anything fits.
    levers = choose_levers(args, cfg, device_bytes, world, dtype.itemsize) if auto else None
    estimate = (levers.peak if levers is not None else
                estimate_peak_bytes(cfg, args.compile, 1.0 if budget is None else budget, dtype.itemsize, world))
    plan = Plan(rank, world, device, dtype, preset, cfg, budget, estimate)
    log(f"device: {device} ({plan.device_name}); torch {torch.__version__}")
    log(f"preset: {preset} ({why}); config: {cfg}")
    log(f"mode: {'compiled' if args.compile else 'eager'}; dtype {args.dtype}; memory budget: "
        f"{'chosen per graph to fit the GPU (the pass notes say which)' if auto else budget}")
    if levers is not None:
        log(f"estimated {levers.describe()}")
        if not levers.fits and not args.force:
            raise SystemExit(f"{levers.describe()} (or --force to try anyway)")
    if not args.force:
        refuse_what_cannot_fit(args, plan, device_bytes)
    return plan


def choose_levers(args, cfg: ModelConfig, device_bytes: float, world: int, nbytes: int) -> levers.Levers:
    """The plan the estimate expects of a compiled step on this GPU and host (memory_plan/levers.py)."""
    machine = levers.Machine(device_bytes, *host.host_memory(), host.local_ranks())
    return levers.choose(cfg, machine, args.offload_activations, nbytes, world)


def refuse_what_cannot_fit(args, plan: Plan, device_bytes: float) -> None:
    """Exit with the estimate if the step, or with ``--check`` the eager reference beside it, cannot fit."""
    if not sizes.fits(plan.estimate, device_bytes):
        raise SystemExit(
            f"config does not fit: estimated peak {plan.estimate / sizes.GIB:.1f} GiB "
            f"({'compiled' if args.compile else 'eager'}, budget {plan.budget}) with "
            f"{device_bytes / sizes.GIB:.1f} GiB on {plan.device}. {suggest.instead(args, plan, device_bytes)}"
        )
    # --check keeps a second model and its optimizer state, and runs it eagerly.
    eager_estimate = suggest.check_estimate(plan.cfg, plan.dtype.itemsize)
    if args.check and not sizes.fits(eager_estimate, device_bytes):
        smaller = suggest.smaller_config(args, plan, device_bytes, with_check=True)
        check_smaller = f", or check {smaller[0]} (estimated {smaller[1]:.1f} GiB with the check)" if smaller else ""
        raise SystemExit(
            f"--check: the eager reference step it runs next to ours does not fit: estimated peak "
            f"{eager_estimate / sizes.GIB:.1f} GiB with {device_bytes / sizes.GIB:.1f} GiB on {plan.device}. "
            f"Run without --check{check_smaller}; or --force to run anyway."
        )


def choose_config(args, device: torch.device, device_bytes: float, world: int,
                  nbytes: int) -> tuple[str, ModelConfig, str]:
    """The preset (given, or the largest that fits) with the command-line overrides applied, and why."""
    if args.preset:
        return args.preset, config_of(args, args.preset), "given"
    if device.type != "cuda":
        return "tiny", config_of(args, "tiny"), "no GPU: tiny runs on the CPU"
    for name in PRESET_ORDER:
        cfg = config_of(args, name)
        estimate = (choose_levers(args, cfg, device_bytes, world, nbytes).peak
                    if args.compile and args.memory_budget is None else
                    estimate_peak_bytes(cfg, args.compile, 0.0, nbytes, world))
        if sizes.fits(estimate, device_bytes):
            return name, cfg, (f"largest preset whose estimate ({estimate / sizes.GIB:.0f} GiB) fits the GPU's "
                               f"{device_bytes / sizes.GIB:.0f} GiB")
    return "tiny", config_of(args, "tiny"), "nothing larger fits"


def choose_budget(args, cfg: ModelConfig, device: torch.device, device_bytes: float, world: int,
                  nbytes: int) -> float | None:
    """The budget given; None (compile_step fits each graph's plan to the GPU, memory_plan/) but for
    a step sharded over ``world`` > 1 GPUs, which takes the largest budget whose sharded estimate fits
    (the per-graph plan does not count the other ranks' shares)."""
    if args.memory_budget is not None or not args.compile or device.type != "cuda" or world == 1:
        return args.memory_budget
    for budget in [b / 100 for b in range(100, -1, -1)]:
        if sizes.fits(estimate_peak_bytes(cfg, True, budget, nbytes, world), device_bytes):
            return budget
    return 0.0
