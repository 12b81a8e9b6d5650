"""The process group and what surrounds it: the world as seen by one rank, the backend, the
device, intra-op threads per rank, and the all-reduce of metric sums.

Rules and where they come from:

* ``backend=auto`` is nccl when every local rank can own a CUDA device, else gloo
  (torch.distributed docs, "Which backend to use?").
* Threads per rank: the user's ``OMP_NUM_THREADS`` if set, else ``max(1, cores // local ranks)``.
  torchrun sets ``OMP_NUM_THREADS=1`` in its CLI only (pytorch #22260, PR #22501); the launcher
  API does not, so each rank sets its own: two ranks at torch's default of one thread per core
  run 5-6x slower on this 2-core machine (../shared/DESIGN.md).
* Metrics are reduced as float64 sums and counts with ``ReduceOp.SUM`` (AVG is NCCL-only, and a
  mean of per-rank means is wrong for uneven shards).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddp_exp.config import ConfigError


@dataclass(frozen=True)
class World:
    """Where this process sits: ``rank`` in ``[0, world_size)``, ``local_rank`` on its node."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int

    @property
    def is_main(self) -> bool:
        """Rank 0, the only rank that writes outputs."""
        return self.rank == 0

    @classmethod
    def from_env(cls) -> World:
        """Read ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` (set by torchrun
        and the elastic launcher)."""
        world_size = int(os.environ["WORLD_SIZE"])
        return cls(rank=int(os.environ["RANK"]), local_rank=int(os.environ["LOCAL_RANK"]),
                   world_size=world_size,
                   local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))


def resolve_backend(backend: str, local_world_size: int) -> str:
    """Turn ``auto`` into ``nccl`` or ``gloo``; check that ``nccl`` can run here.

    Counts devices through NVML (``PYTORCH_NVML_BASED_CUDA_CHECK=1``), which does not
    initialise CUDA in this process, so ranks forked from it can still use their GPU.

    Raises:
        ConfigError: ``backend=nccl`` without one CUDA device per local rank.
    """
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= local_world_size and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and (gpus < local_world_size or not dist.is_nccl_available()):
        raise ConfigError(f"backend=nccl needs one CUDA device per local rank ({local_world_size} "
                          f"here) and found {gpus}; use backend=gloo or backend=auto")
    return backend


def device_for(backend: str, local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` for nccl, the CPU otherwise."""
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def threads_per_rank(local_world_size: int) -> int:
    """Intra-op threads for one rank: ``OMP_NUM_THREADS`` if the user set it, else
    ``max(1, usable cores // local_world_size)``."""
    user = os.environ.get("OMP_NUM_THREADS", "").strip()
    if user.isdigit() and int(user) > 0:
        return int(user)
    return max(1, len(os.sched_getaffinity(0)) // local_world_size)


def init_process_group(backend: str, world: World, timeout_s: float) -> None:
    """Join the world's default process group (env:// rendezvous set up by the launcher).

    ``timeout_s`` bounds every collective, so a rank whose peer died fails instead of hanging.
    """
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(world.local_rank)
        kwargs["device_id"] = torch.device("cuda", world.local_rank)
    dist.init_process_group(backend=backend, rank=world.rank, world_size=world.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def destroy_process_group() -> None:
    """Leave the process group if one is initialised (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum ``values`` (any shape, float64 for exact counts) over all ranks, in place; returns it.

    A no-op outside a process group.
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values
