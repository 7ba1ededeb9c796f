"""The processes of one site: a single process, or ``torchrun`` ranks sharing an FSDP2 model.

Only rank 0 speaks to the swarm. The other ranks follow: rank 0 broadcasts each command (train a
step, gather parameters, load parameters, save, stop) and every rank then runs the same collectives.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from greenswarm.errors import ConfigError


@dataclass
class World:
    """This process's place in its site: rank, world size and device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_environment(cls, device_pref: str = "auto") -> World:
        """Read torchrun's variables; start the process group (gloo on CPU, nccl on GPU) if world > 1."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = torch.cuda.is_available() if device_pref == "auto" else device_pref == "cuda"
        if use_cuda and not torch.cuda.is_available():
            raise ConfigError(
                "is 'cuda' but this machine has no usable CUDA GPU (or torch is a CPU build); "
                "use 'auto' or 'cpu'",
                field="train.device",
            )
        if use_cuda and local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPU(s) are visible",
                field="train.device",
            )
        if use_cuda:
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        if world_size > 1 and not dist.is_initialized():
            dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        return cls(rank=rank, world_size=world_size, local_rank=local_rank, device=device)

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (a no-op on a single process)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()
