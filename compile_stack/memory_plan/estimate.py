"""Memory estimates: refuse a config that cannot fit before allocating anything.

The estimate is deliberately simple and errs high; it is a guard, not a plan.

- State: parameters, gradients and the two AdamW moments, all in the model
  dtype (docs/reference.md §2): 4 × params × bytes.
- Eager (the reference as written): per layer, autograd keeps two B·H·S²
  tensors (the exponentials and the normalized weights) and the S×S mask,
  plus the token activations below; the last layer's forward has three more
  alive at once (scores, masked, shifted); the loss keeps the full logits
  three times (logits, shifted, log-probs).
- Compiled with our ops: no S×S and no T×V tensor. Per layer and token the
  step saves what AOTAutograd's partitioner chooses at the activation memory
  budget. For the full preset's block that choice was measured at budgets
  0.02 apart (torch 2.13, since attention reads v in place and writes its
  output in v's layout; the H200's torch 2.11 saved the same at 0.6,
  docs/decisions.md) and is looked up. Any other block is bounded by a line between a floor (the
  block input, the rotated queries, and the attention output and its
  log-sum-exp, which our passes mark must-save) and what the partitioner
  saves at budget 1.0 (up to ten d-wide tensors, three d_ff-wide ones, the
  log-sum-exp and the norms' fp32 statistics), with a 10% margin for the
  knapsack's overshoot (up to 4% measured on a miniature block). Plus one
  layer's working set during the backward, taken as that budget-1.0 set, and
  the cross-entropy chunk (10.3 GiB together at 65,536 tokens, where one
  H200's measured peak leaves 9.95 GiB beyond the other terms).
- The peak is at the backward's start: parameters, moments, every saved
  activation, the LM head's gradient; block gradients only appear as the
  blocks' activations are freed, which are larger.
- Data parallel over ``world`` ranks: the state is sharded, each rank holds
  batch/world sequences, and FSDP2 adds the unsharded parameters of the
  groups in flight (the root group and two blocks); a block's unsharded
  gradients live only inside its backward, in the working set.
- ``fits`` leaves 5% of the device to what the caching allocator does not
  count (CUDA context, NCCL and cuBLAS buffers) and to fragmentation, which
  ``expandable_segments`` (compile_stack turns it on at import) keeps small.
"""
from typing import Protocol

from custom_ops.linear_cross_entropy import CHUNK_BYTES as CE_CHUNK_BYTES

KNAPSACK_OVERSHOOT = 1.1
# The partitioner's plans for the full preset's block in 16-bit dtypes, keyed by (d_model,
# d_ff, heads, bytes per element): (budget from which a plan holds, d-wide tensors, d_ff-wide
# tensors) saved per token besides the log-sum-exp and the norms' statistics. Each plan is
# entered at the last measured budget below the one where it was seen, so the lookup errs high.
# From 0.62 (6, 2): every matmul output the backward needs is saved; only norms are recomputed.
MEASURED_PLANS = {
    (4096, 11008, 32, 2): (
        (0.0, 2, 0), (0.06, 3, 0), (0.12, 4, 0), (0.16, 2, 1), (0.18, 5, 0), (0.24, 3, 1), (0.26, 6, 0),
        (0.30, 4, 1), (0.34, 2, 2), (0.36, 5, 1), (0.42, 3, 2), (0.44, 6, 1), (0.48, 4, 2), (0.54, 5, 2),
        (0.62, 6, 2), (0.98, 8, 3),
    ),
}


class DecoderShape(Protocol):
    """The sizes of a pre-norm decoder's train step the estimate reads (a harness's config)."""

    layers: int
    seq: int
    batch: int
    d_model: int
    heads: int
    d_ff: int
    vocab: int
    params: int  # every parameter
    tokens: int  # batch × seq


def _saved_row_bytes(cfg: DecoderShape, nbytes: int, d_wide: int, ff_wide: int, norm_stats: bool = True) -> float:
    """Per token: ``d_wide`` d-wide and ``ff_wide`` d_ff-wide tensors, attention's fp32
    log-sum-exp (one per head) and, with ``norm_stats``, the two norms' fp32 statistics."""
    return (d_wide * cfg.d_model + ff_wide * cfg.d_ff) * nbytes + cfg.heads * 4 + (2 * 4 if norm_stats else 0)


def _token_bytes_per_layer(cfg: DecoderShape, nbytes: int) -> tuple[float, float]:
    """(floor, everything) bytes a layer saves per token."""
    return _saved_row_bytes(cfg, nbytes, 3, 0, norm_stats=False), _saved_row_bytes(cfg, nbytes, 10, 3)


def estimate_peak_bytes(
    cfg: DecoderShape, compiled: bool, memory_budget: float = 1.0, nbytes: int = 2, world: int = 1
) -> float:
    """Peak bytes on one device; with ``world`` data-parallel ranks the state is sharded
    across them and each holds batch/world sequences."""
    if not compiled:
        state = 4 * cfg.params * nbytes / world
        tokens = cfg.tokens / world
        everything = _token_bytes_per_layer(cfg, nbytes)[1]
        scores = cfg.batch / world * cfg.heads * cfg.seq**2 * nbytes
        logits = 3 * tokens * cfg.vocab * nbytes
        return state + cfg.layers * (2 * scores + cfg.seq**2 + tokens * everything) + 3 * scores + logits
    beside, at_end = compiled_fixed_bytes(cfg, nbytes, world)
    return max(beside + saved_bytes(cfg, memory_budget, nbytes, world), at_end)


def compiled_fixed_bytes(cfg: DecoderShape, nbytes: int = 2, world: int = 1) -> tuple[float, float]:
    """A compiled step's bytes besides its saved activations at the backward's start, and its
    state and working set at the end of the backward (with every gradient)."""
    tokens = cfg.tokens / world
    working = tokens * _token_bytes_per_layer(cfg, nbytes)[1] + CE_CHUNK_BYTES
    if world > 1:
        block_params = (cfg.params - 2 * cfg.vocab * cfg.d_model) / cfg.layers
        working += (2 * cfg.vocab * cfg.d_model + 2 * block_params) * nbytes
    # Gradients appear while the backward frees activations, a block at a time, and a block
    # saves more than its gradients take: the peak is at the backward's start, before any
    # block's gradient exists (the LM head's does: the fused loss computes it in the forward).
    params_and_moments = 3 * cfg.params * nbytes / world
    head_grads = (cfg.vocab + tokens) * cfg.d_model * nbytes
    return params_and_moments + head_grads + working, 4 * cfg.params * nbytes / world + working


def saved_bytes(cfg: DecoderShape, memory_budget: float, nbytes: int = 2, world: int = 1) -> float:
    """Bytes every compiled layer saves for its backward at ``memory_budget``, on one rank."""
    return cfg.layers * cfg.tokens / world * saved_bytes_per_token(cfg, memory_budget, nbytes)


def saved_bytes_per_token(cfg: DecoderShape, memory_budget: float, nbytes: int = 2) -> float:
    """Bytes one compiled layer saves for its backward, per token, at ``memory_budget``."""
    plans = MEASURED_PLANS.get((cfg.d_model, cfg.d_ff, cfg.heads, nbytes))
    if plans is not None:
        _, d_wide, ff_wide = max(plan for plan in plans if plan[0] <= memory_budget)
        return _saved_row_bytes(cfg, nbytes, d_wide, ff_wide)
    floor, everything = _token_bytes_per_layer(cfg, nbytes)
    # The partitioner's knapsack can save more than the proportional line.
    return floor + min(1.0, KNAPSACK_OVERSHOOT * memory_budget) * (everything - floor)
