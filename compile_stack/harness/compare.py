"""``--compare stock``: the step a stock PyTorch user would build, timed as ours was, in the same
process once ours is freed (both fit only one at a time at the full preset)."""
import gc

import torch

from compile_stack import distributed
from compile_stack.memory_plan import sizes
from compile_stack.memory_plan.sizes import GIB
from compile_stack.harness.measure import FirstCallTimer, measure
from compile_stack.harness.report import log
from compile_stack.harness.stock import StockStep
from custom_ops.activation_offload import release_host_memory


def stock_peak_bytes(cfg, nbytes: int, world: int = 1) -> float:
    """A floor of the stock step's peak (stock.py): parameters, gradients and fused AdamW's two moments
    in the model dtype, and every checkpointed block's input (81 GiB measured at the full preset on
    an H200, this floor 77.5)."""
    return 4 * cfg.params * nbytes / world + cfg.layers * cfg.tokens / world * cfg.d_model * nbytes


def compare_stock(args, plan, code, batch, ours: dict) -> dict:
    """Build the stock step on fresh weights and time it; its figures, speedup and memory ratio.

    For the reference model (``code`` a ``user_code.StepCode``): the stock-parts step (stock.py).
    For the user's own code: the same step compiled by stock ``torch.compile`` (Inductor, none of
    our passes). Under torchrun it is sharded as ours is (FSDP2, a group per block) and steps on
    this rank's share of the batch; its step time is the slowest rank's, its peak the largest.
    """
    torch.compiler.reset()  # compiled code and its guards may still refer to our model
    gc.collect()  # the compiled pieces and their modules refer to each other
    if plan.device.type == "cuda":
        release_host_memory()  # ours' pinned buffers for offloaded activations
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(plan.device)
        log(f"[stock] memory still allocated after freeing ours: "
            f"{torch.cuda.memory_allocated(plan.device) / GIB:.2f} GiB")
    if not code.own and plan.device.type == "cuda" and not args.force:
        needed = stock_peak_bytes(plan.cfg, plan.dtype.itemsize, plan.world)
        if not sizes.fits(needed, sizes.device_bytes(plan.device)):
            why = (f"the stock step does not fit this GPU: its state and checkpointed block inputs alone take "
                   f"{needed / GIB:.1f} GiB of {sizes.device_bytes(plan.device) / GIB:.1f} GiB (--force tries anyway)")
            log(f"[stock] {why}")
            return {"stock": None, "not_run": why}
    torch.manual_seed(args.seed)
    if not code.own:
        log("[stock] building the stock step (torch.compile per block, SDPA, checkpointing, fused AdamW)...")
        step = StockStep(code.build_model(plan.cfg, plan.device, plan.dtype), sharded=plan.world > 1)
    else:
        log("[stock] building your step compiled by stock torch.compile (none of our passes)...")
        model = code.build_model(plan.cfg, plan.device, plan.dtype)
        if plan.world > 1:
            distributed.shard(model)
        step = torch.compile(code.train_step(model))
    try:
        stock = measure(FirstCallTimer(step), batch, args, plan, "stock")
    except torch.OutOfMemoryError as e:
        why = f"the stock step ran out of memory on this GPU ({str(e).splitlines()[0]})"
        log(f"[stock] {why}")
        return {"stock": None, "not_run": why}
    return {
        "stock": stock,
        "speedup": round(stock["step_ms"] / ours["step_ms"], 3),
        "memory_ratio": round(ours["peak_mem_gib"] / stock["peak_mem_gib"], 3) if stock["peak_mem_gib"] else None,
    }
