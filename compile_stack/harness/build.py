"""Our step as run_step times it: the compile caches, then the model, a batch and the step
(``compile_step`` on the model, loss and optimizer; under torchrun, sharded with FSDP2)."""
import copy
import dataclasses

import torch

import compile_stack
from compile_stack import caches, distributed
from compile_stack.harness.measure import FirstCallTimer
from compile_stack.harness.options import passes_of
from compile_stack.harness.report import log


def use_caches(args, plan) -> None:
    """``--cache-dir``/``--fresh-cache`` for every compile of the run; rank 0 empties them, the others wait."""
    try:
        caches.use_cache_dir(args.cache_dir, fresh=args.fresh_cache and plan.rank == 0)
    except ValueError as e:  # "cache_dir: expected a writable directory ..."
        raise SystemExit(f"--cache-dir: {str(e).partition(': ')[2]}") from None
    if plan.world > 1:
        torch.distributed.barrier()
    log(f"compile caches: {caches.default_cache_dir()}{' (emptied)' if args.fresh_cache else ''}")


@dataclasses.dataclass
class Built:
    """Our step and what the later phases step it with and compare it to."""

    step: FirstCallTimer
    model: torch.nn.Module
    batch: tuple[torch.Tensor, torch.Tensor]  # this rank's share under torchrun
    eager_twin: torch.nn.Module | None  # --check: a copy of the model's first weights


def build_step(args, plan, code) -> Built:
    """The model from ``code`` (a ``user_code.StepCode``), the batch, and the step, compiled with
    ``--compile`` (its pass report then the current one: ``registry.current()``)."""
    log("building the model...")
    torch.manual_seed(args.seed)
    model = code.build_model(plan.cfg, plan.device, plan.dtype)
    if plan.device.type == "cuda":
        torch.cuda.empty_cache()  # the fp32 initialization's blocks
    generator = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    batch = tuple(torch.randint(plan.cfg.vocab, (plan.cfg.batch, plan.cfg.seq), generator=generator).to(plan.device)
                  for _ in range(2))
    eager_twin = copy.deepcopy(model) if args.check else None
    passes = passes_of(args)
    if plan.world > 1:
        batch = tuple(distributed.shard_batch(t, plan.rank, plan.world) for t in batch)
    if plan.world > 1:
        compile_stack.shard(model)  # FSDP2 by the model's repeated blocks, then the root
    step = code.train_step(model)
    if args.compile:
        step = compile_stack.compile_step(step, passes=passes, inspect_dir=args.inspect, memory_budget=plan.budget,
                                          blocks=not args.whole_graph, offload_activations=args.offload_activations)
    return Built(FirstCallTimer(step), model, batch, eager_twin)
