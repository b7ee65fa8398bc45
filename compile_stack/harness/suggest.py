"""What to run instead of a config whose memory estimate does not fit: a change of the command
line whose estimate does, so that a refusal never suggests the config it refused, nor an option
(``--compile`` on a CPU, say) that would be refused in turn."""
import dataclasses

import torch

from compile_stack.memory_plan import sizes
from compile_stack.memory_plan.estimate import estimate_peak_bytes
from compile_stack.workloads.config import PRESET_ORDER, PRESETS, ModelConfig
from compile_stack.harness.options import OVERRIDES

MIN_SEQ = 16  # shorter sequences are not worth suggesting


def peak_estimate(cfg: ModelConfig, compiled: bool, budget: float | None, device: torch.device, world: int,
                  nbytes: int) -> float:
    """The step's estimated peak; with the budget chosen per graph (compiled on a GPU, no
    ``--memory-budget``), at the least budget: whether any plan fits."""
    auto = compiled and budget is None and device.type == "cuda"
    return estimate_peak_bytes(cfg, compiled, 0.0 if auto else 1.0 if budget is None else budget, nbytes, world)


def check_estimate(cfg: ModelConfig, nbytes: int) -> float:
    """``--check``'s eager reference step beside ours: its estimate plus a second model's state."""
    return estimate_peak_bytes(cfg, False, nbytes=nbytes) + 4 * cfg.params * nbytes


def _halvings(n: int, least: int) -> list[int]:
    out = [n]
    while out[-1] // 2 >= least:
        out.append(out[-1] // 2)
    return out


def _flags(preset: str, cfg: ModelConfig) -> str:
    """The options that give ``cfg``: the preset and what differs from it."""
    differs = [f"--{n.replace('_', '-')} {getattr(cfg, n)}" for n in OVERRIDES
               if getattr(cfg, n) != getattr(PRESETS[preset], n)]
    return " ".join([f"--preset {preset}", *differs])


def smaller_config(args, plan, device_bytes: float, with_check: bool) -> tuple[str, float] | None:
    """The largest config that fits, as options, and its estimate in GiB: within the run's preset,
    its sequence and layers halved; else the next smaller preset (the width overrides kept).
    ``with_check``: the eager reference step must fit beside it too. None: nothing fits."""
    nbytes = plan.dtype.itemsize

    def estimate(cfg):
        ours = peak_estimate(cfg, args.compile, plan.budget, plan.device, plan.world, nbytes)
        fit = sizes.fits(ours, device_bytes) and not (with_check and not sizes.fits(check_estimate(cfg, nbytes),
                                                                                     device_bytes))
        return max(ours, check_estimate(cfg, nbytes) if with_check else 0.0) if fit else None

    widths = {n: getattr(plan.cfg, n) for n in ("batch", "d_model", "heads", "d_ff", "vocab")}
    for preset in PRESET_ORDER[PRESET_ORDER.index(plan.preset):]:
        base = plan.cfg if preset == plan.preset else _with(PRESETS[preset], widths)
        if base is None:
            continue
        fitting = [(e, cfg) for seq in _halvings(base.seq, MIN_SEQ) for layers in _halvings(base.layers, 1)
                   if (cfg := dataclasses.replace(base, seq=seq, layers=layers)) != plan.cfg
                   and (e := estimate(cfg)) is not None]
        if fitting:
            e, cfg = max(fitting, key=lambda pair: pair[0])
            return _flags(preset, cfg), e / sizes.GIB
    return None


def _with(cfg: ModelConfig, widths: dict) -> ModelConfig | None:
    """A smaller preset with the run's widths, if they make a valid config there."""
    try:
        return dataclasses.replace(cfg, **widths)
    except ValueError:
        return None


def instead(args, plan, device_bytes: float) -> str:
    """What to try when the step's estimate does not fit: ``--compile`` or ``--memory-budget 0``
    where that alone fits (and, with ``--check``, the eager step beside it), and the largest
    smaller config that does; ``--force`` last."""
    nbytes = plan.dtype.itemsize
    check_fits = not args.check or sizes.fits(check_estimate(plan.cfg, nbytes), device_bytes)
    tries = []
    if check_fits and not args.compile and sizes.fits(
            peak_estimate(plan.cfg, True, plan.budget, plan.device, plan.world, nbytes), device_bytes):
        tries.append("--compile")
    if check_fits and args.compile and plan.budget and sizes.fits(
            peak_estimate(plan.cfg, True, 0.0, plan.device, plan.world, nbytes), device_bytes):
        tries.append("--memory-budget 0")
    smaller = smaller_config(args, plan, device_bytes, with_check=args.check)
    if smaller:
        tries.append(f"{smaller[0]} (estimated {smaller[1]:.1f} GiB)")
    return f"Try {', or '.join(tries)}; or --force to run anyway." if tries else "Use --force to run anyway."
