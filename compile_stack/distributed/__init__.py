"""Data parallel over torchrun's processes: the process group, each rank's batch share, and FSDP2
sharding by the model's repeated blocks (``capture.blocks``). May import ``capture`` and below."""
from compile_stack.distributed.process_group import is_distributed, setup_distributed, shard_batch
from compile_stack.distributed.sharding import full_params, mean_over_ranks, shard, shard_groups

__all__ = ["full_params", "is_distributed", "mean_over_ranks", "setup_distributed", "shard", "shard_batch",
           "shard_groups"]
