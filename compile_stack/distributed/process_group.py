"""The process group torchrun describes: joining it, and each rank's share of a batch."""
import os

import torch
import torch.distributed as dist

from custom_ops.checks import require

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def is_distributed() -> bool:
    """Whether this process was started by torchrun with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def setup_distributed() -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes: (rank, world size, this rank's device).

    One GPU per process (``cuda:LOCAL_RANK``, NCCL), or the CPU with gloo.
    """
    missing = [v for v in ENV_VARS if v not in os.environ]
    require(not missing, "environment", f"torchrun's variables {ENV_VARS}", f"{missing} missing")
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def shard_batch(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous share of the global batch (dim 0)."""
    require(tensor.dim() >= 1 and tensor.shape[0] % world == 0, "tensor",
            f"a batch dimension divisible by the world size {world}", tuple(tensor.shape))
    share = tensor.shape[0] // world
    return tensor[rank * share:(rank + 1) * share]
