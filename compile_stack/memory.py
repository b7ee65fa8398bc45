"""Memory estimates: refuse a config that cannot fit before allocating anything.

The estimate is deliberately simple and errs high; it is a guard, not a plan.

- State: parameters, gradients and the two AdamW moments, all in the model
  dtype (REFERENCE.md §2): 4 × params × bytes.
- Eager (the reference as written): per layer, autograd keeps two B·H·S²
  tensors (the exponentials and the normalized weights) and the S×S mask,
  plus the token activations below; the last layer's forward has three more
  alive at once (scores, masked, shifted); the loss keeps the full logits
  three times (logits, shifted, log-probs).
- Compiled with our ops: no S×S and no T×V tensor. Per layer and token the
  step saves between a floor (the block input, the residual after attention,
  and the attention output and its log-sum-exp, which our passes mark
  must-save) and what AOTAutograd's partitioner saves at budget 1.0 (ten
  d-wide tensors, three d_ff-wide ones and the norms' fp32 statistics), in
  proportion to the activation memory budget, plus a margin for the
  knapsack's overshoot. (Calibrated on the full preset's block graph at
  budgets 0 to 1 with torch 2.13: the estimate is at or above what the
  partitioner saved at every budget; torch 2.11 saves less.) Plus one layer's
  full working set during the backward, and the cross-entropy chunk.
- The peak is at the backward's start: parameters, moments, every saved
  activation, the LM head's gradient; block gradients only appear as the
  blocks' activations are freed, which are larger.
- Data parallel over ``world`` ranks: the state is sharded, each rank holds
  batch/world sequences, and FSDP2 adds the unsharded parameters and
  gradients of the groups in flight (the root group and two blocks).
"""
import os

import torch

from compile_stack.config import ModelConfig

GIB = 2**30
# Of the memory a device reports, the share a run may plan to use (allocator slack).
USABLE_FRACTION = 0.92
CE_CHUNK_BYTES = 1.25 * GIB


def _token_bytes_per_layer(cfg: ModelConfig, nbytes: int) -> tuple[float, float]:
    """(floor, everything) bytes a layer saves per token."""
    d, f = cfg.d_model, cfg.d_ff
    floor = 3 * d * nbytes + cfg.heads * 4
    everything = (10 * d + 3 * f) * nbytes + cfg.heads * 4 + 2 * 4
    return floor, everything


def estimate_peak_bytes(
    cfg: ModelConfig, compiled: bool, memory_budget: float = 1.0, nbytes: int = 2, world: int = 1
) -> float:
    """Peak bytes on one device; with ``world`` data-parallel ranks the state is sharded
    across them and each holds batch/world sequences."""
    state = 4 * cfg.params * nbytes / world
    tokens = cfg.tokens / world
    everything = _token_bytes_per_layer(cfg, nbytes)[1]
    if not compiled:
        scores = cfg.batch / world * cfg.heads * cfg.seq**2 * nbytes
        logits = 3 * tokens * cfg.vocab * nbytes
        return state + cfg.layers * (2 * scores + cfg.seq**2 + tokens * everything) + 3 * scores + logits
    working = tokens * everything + CE_CHUNK_BYTES
    if world > 1:
        block_params = (cfg.params - 2 * cfg.vocab * cfg.d_model) / cfg.layers
        working += 2 * (2 * cfg.vocab * cfg.d_model + 2 * block_params) * nbytes
    # Gradients appear while the backward frees activations, a block at a time, and a block
    # saves more than its gradients take: the peak is at the backward's start, before any
    # block's gradient exists (the LM head's does: the fused loss computes it in the forward).
    params_and_moments = 3 * cfg.params * nbytes / world
    head_grads = (cfg.vocab + tokens) * cfg.d_model * nbytes
    saved = cfg.layers * tokens * saved_bytes_per_token(cfg, memory_budget, nbytes)
    backward_start = params_and_moments + saved + head_grads + working
    return max(backward_start, state + working)


def saved_bytes_per_token(cfg: ModelConfig, memory_budget: float, nbytes: int = 2) -> float:
    """Bytes one compiled layer saves for its backward, per token, at ``memory_budget``."""
    floor, everything = _token_bytes_per_layer(cfg, nbytes)
    # The partitioner's knapsack works on discretized sizes and can overshoot its budget a
    # little (by up to 2% of the floor-to-everything range at the budgets we measured): +10%.
    return floor + min(1.0, 1.1 * memory_budget) * (everything - floor)


def fits(estimate_bytes: float, device_bytes: float) -> bool:
    """Whether an estimated peak leaves the allocator its slack on a device of ``device_bytes``."""
    return estimate_bytes <= USABLE_FRACTION * device_bytes


def device_bytes(device: torch.device) -> float:
    """Memory a run on ``device`` can have: the GPU's, or the machine's RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
