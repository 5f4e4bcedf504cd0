"""torch.distributed helpers for `torchrun --nproc_per_node=K -m moe_attrib ...` (data parallel)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` across ranks in place (moved to the collective's device and back)."""
        if self.world > 1:
            work = tensor.to(self.device) if dist.get_backend() == "nccl" else tensor.cpu()
            dist.all_reduce(work)
            tensor.copy_(work.to(tensor.device))
        return tensor


def setup(device: str | None = None) -> Dist:
    """Join the process group torchrun set up (gloo on CPU, nccl on GPUs), or run alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank, world, dev)


def teardown() -> None:
    """Leave the process group (if one was joined): a rank that exits with gloo's connections still
    open can abort at exit ("terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
