"""This process's place in a job: its rank and node from torchrun's environment, and its GPU."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from plate_inspect.errors import ConfigError


@dataclass(frozen=True)
class RankInfo:
    """This process's place in a distributed job, from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK; its
    node: GROUP_RANK of GROUP_WORLD_SIZE nodes, LOCAL_WORLD_SIZE ranks on it)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node: int = 0
    nodes: int = 1

    @property
    def is_root(self) -> bool:
        """Rank 0: the rank that prepares the directory, writes the manifest and says the job's verdicts."""
        return self.rank == 0


def rank_from_env() -> RankInfo:
    """The job this process belongs to; a single process when WORLD_SIZE is unset or 1."""
    if os.environ.get("RANK", "0").strip() != "0" and "WORLD_SIZE" not in os.environ:
        raise ConfigError(
            f"RANK={os.environ['RANK']} is set but WORLD_SIZE is not (torchrun sets both): unset RANK for a "
            "single-process scan, or launch distributed scans with torchrun"
        )
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise ConfigError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (as torchrun sets them)") from None
    env = os.environ.get
    try:  # its node (default: one node holding every rank); only for saying where a problem is, so never an error
        place = (
            int(env("LOCAL_WORLD_SIZE", str(world))),
            int(env("GROUP_RANK", "0")),
            int(env("GROUP_WORLD_SIZE", "1")),
        )
    except ValueError:
        place = (world, 0, 1)
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is not a rank of WORLD_SIZE={world}")
    missing = [var for var in ("MASTER_ADDR", "MASTER_PORT") if world > 1 and var not in os.environ]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE={world} but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} unset: launch "
            "distributed scans with torchrun (or unset WORLD_SIZE and RANK for a single-process scan)"
        )
    return RankInfo(rank, world, local, *place)


def rank_device(device: torch.device, info: RankInfo) -> torch.device:
    """One GPU per rank: ``cuda`` under torchrun means ``cuda:LOCAL_RANK``; an explicit index is kept."""
    if device.type != "cuda" or device.index is not None or info.world_size == 1:
        return device
    count = torch.cuda.device_count()
    if info.local_rank >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        # a scheduler that binds one GPU to each rank (Slurm's --gpus-per-task) shows each rank its own as cuda:0
        bound = (
            f" (CUDA_VISIBLE_DEVICES={visible}: if the scheduler gives each rank a GPU of its own, give --device "
            "cuda:0)"
            if visible is not None
            else ""
        )
        raise ConfigError(
            f"rank {info.rank} has LOCAL_RANK={info.local_rank} but this process sees {count} CUDA "
            f"device{'' if count == 1 else 's'}{bound}; run at most one process per GPU (--nproc-per-node)"
        )
    return torch.device("cuda", info.local_rank)
