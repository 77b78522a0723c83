"""Data-parallel scale-out: the same training under ``torchrun`` with DistributedDataParallel.

Every rank builds the same global batch (batches are a function of the step) and trains on its own disjoint,
equal slice; DDP averages the gradients, so the update equals the single-process one on the whole batch up to
the order of floating-point reductions. gloo on CPU, NCCL on GPU.

    torchrun --nproc_per_node 2 -m addnorm train --preset tiny --steps 200
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "current", "init_from_env", "local_slice", "mean_across_ranks", "barrier"]


@dataclass(kw_only=True, frozen=True)
class DistInfo:
    """This process's place among torchrun ranks (rank 0 of 1 without torchrun): the record training and the lab's
    executor (addnorm.lab.executor) both pass around."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    # This record's maker joined the process group (init_process_group): close() leaves it again.
    initialized_here: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.initialized_here:
            dist.destroy_process_group()


def current() -> DistInfo:
    """This process's place in the process group (rank 0 of 1 when none is initialized)."""
    if dist.is_available() and dist.is_initialized():
        return DistInfo(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=int(os.environ.get("LOCAL_RANK", dist.get_rank())),
        )
    return DistInfo()


def init_from_env(device: str | torch.device | None = None) -> DistInfo:
    """Join the process group torchrun describes (WORLD_SIZE > 1 in the environment); else a single process.

    The backend is NCCL for CUDA devices, gloo otherwise. Idempotent."""
    if dist.is_initialized():
        return current()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but torch.distributed is not available in this torch build")
    use_cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return dataclasses.replace(current(), initialized_here=True)


def local_slice(batch_size: int, info: DistInfo) -> slice:
    """This rank's rows of the global batch (disjoint and equal across ranks)."""
    if batch_size % info.world_size:
        raise ValueError(
            f"batch_size ({batch_size}) must be divisible by the number of processes ({info.world_size}) so each "
            "rank gets an equal slice"
        )
    per = batch_size // info.world_size
    return slice(info.rank * per, (info.rank + 1) * per)


def mean_across_ranks(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The mean of a (scalar) tensor over ranks; itself on one process."""
    if not info.enabled:
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / info.world_size


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
