"""torch.distributed helpers for `torchrun --nproc_per_node=K -m moe_attrib ...` (data parallel,
optionally with the model sharded over the ranks by FSDP2: `--fsdp`, see `moe_attrib.model.sharding`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass
class Dist:
    rank: int
    world: int
    device: torch.device
    fsdp: bool = False

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

    def lockstep(self, items: Sequence[T], filler: T) -> list[tuple[T, bool]]:
        """This rank's work items as `(item, real)`, padded with `(filler, False)` to the largest count
        of any rank when the model is sharded (`fsdp`): every forward gathers each layer with all ranks,
        so all ranks must run the same number of them. A filler's results are to be discarded."""
        steps = [(item, True) for item in items]
        if not self.fsdp or self.world == 1:
            return steps
        count = torch.tensor([len(steps)], device=self.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return steps + [(filler, False)] * (int(count) - len(steps))


def setup(device: str | None = None, fsdp: bool = False) -> Dist:
    """Join the process group torchrun set up (gloo on CPU, nccl on GPUs), or run alone.

    `fsdp` (the model will be sharded) joins the group also with one rank, and needs torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if fsdp and "MASTER_ADDR" not in os.environ:
        raise RuntimeError(
            "--fsdp shards the model over the ranks of a torchrun launch; run it as "
            "`torchrun --nproc_per_node K -m moe_attrib ... --fsdp` (K = 1 works too)."
        )
    if (world > 1 or fsdp) and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank, world, dev, fsdp)


def teardown() -> None:
    """Leave the process group (if one was joined): a rank that exits with gloo's connections still
    open can abort at exit ("terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
