"""The process group and what surrounds it: the world as seen by one rank, the backend, the
device, intra-op threads per rank, and the all-reduce of metric sums.

Rules and where they come from:

* ``device=auto`` is cuda when every local rank can own a GPU (``cuda:LOCAL_RANK``), and
  ``backend=auto`` is nccl on cuda, gloo on the CPU (torch.distributed docs, "Which backend to
  use?"); see :func:`resolve_placement`.
* Threads per rank: the user's ``OMP_NUM_THREADS`` if set, else ``max(1, cores // local ranks)``.
  torchrun sets ``OMP_NUM_THREADS=1`` in its CLI only (pytorch #22260, PR #22501); the launcher
  API does not, so each rank sets its own: two ranks at torch's default of one thread per core
  run 5-6x slower on this 2-core machine (docs/scaling-out.md).
* Metrics are reduced as float64 sums and counts with ``ReduceOp.SUM``. ``ReduceOp.AVG`` also
  works on gloo for floating-point tensors (torch 2.13: ``[1.5, 15.0]`` from ``[1, 10]`` and
  ``[2, 20]``; integer tensors fail), but an average over ranks is a mean of per-rank means,
  wrong for uneven shards; summed (sum, count) divided at the end is exact.
"""

from __future__ import annotations

import datetime
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddp_exp.config.errors import ConfigError


class PeerFailed(RuntimeError):
    """This rank stops because another rank failed first; the message names that rank and its
    failure. Raised where every rank learns of one rank's failure together (a collective said
    so): the launchers then report the other rank's own error as the cause
    (:func:`ddp_exp.rank.failures.is_peer_failure`), not this one."""


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


def cuda_device_count() -> int:
    """CUDA devices visible to this process, counted through NVML
    (``PYTORCH_NVML_BASED_CUDA_CHECK=1``), which does not initialise CUDA here, so ranks forked
    from this process can still use their GPU."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_placement(device: str, backend: str, local_world_size: int,
                      gpus: int | None = None) -> tuple[str, str]:
    """Turn ``device`` and ``backend`` (each possibly ``auto``) into what the ranks use.

    Rules (torch.distributed docs, "Which backend to use?": NCCL for CUDA tensors, gloo for CPU
    tensors; gloo also reduces CUDA tensors, more slowly):

    * ``device=auto`` is ``cuda`` when every local rank can own a GPU (rank ``r`` on
      ``cuda:LOCAL_RANK``) and the backend is not an explicit ``gloo``; otherwise ``cpu``.
    * ``backend=auto`` is ``nccl`` on ``cuda`` (when this torch has NCCL), ``gloo`` on ``cpu``.

    Args:
        device: ``auto``, ``cpu`` or ``cuda`` (the ``device`` key).
        backend: ``auto``, ``gloo`` or ``nccl`` (the ``backend`` group).
        local_world_size: ranks on this node (``world_size / launcher.nnodes``).
        gpus: CUDA devices on this node; None counts them (:func:`cuda_device_count`).

    Returns:
        ``(device type, backend)``: ``("cpu" | "cuda", "gloo" | "nccl")``.

    Raises:
        ConfigError: ``device=cuda`` or ``backend=nccl`` without one CUDA device per local rank,
            ``backend=nccl`` with ``device=cpu``, or ``nccl`` in a torch built without it.
    """
    device, backend = str(device), str(backend)  # an Enum of the schema: its plain name
    gpus = cuda_device_count() if gpus is None else gpus
    enough = gpus >= local_world_size
    if device == "auto":
        device = "cuda" if enough and backend != "gloo" else "cpu"
    if device == "cuda" and not enough:
        raise ConfigError(f"device=cuda needs one CUDA device per local rank ({local_world_size} "
                          f"here) and found {gpus}; use device=cpu or device=auto")
    if backend == "auto":
        backend = "nccl" if device == "cuda" and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        if device != "cuda" and not enough:
            raise ConfigError(f"backend=nccl needs one CUDA device per local rank "
                              f"({local_world_size} here) and found {gpus}; use backend=gloo or "
                              "backend=auto")
        if device != "cuda":
            raise ConfigError("backend=nccl needs device=cuda (NCCL reduces CUDA tensors only); "
                              "use device=auto or backend=gloo")
        if not dist.is_nccl_available():
            raise ConfigError("backend=nccl: this torch build has no NCCL; use backend=gloo")
    return device, backend


def device_for(device_type: str, local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` for ``cuda``, the CPU otherwise."""
    return torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")


def threads_per_rank(local_world_size: int, num_workers: int = 0) -> int:
    """Intra-op threads for one rank: ``OMP_NUM_THREADS`` if the user set it, else
    ``max(1, usable cores // (local_world_size * (1 + num_workers)))``: each DataLoader worker
    (``data.num_workers``, a process decoding batches) takes a core of its own too. With 2
    cores, one rank and 2 decoding workers, 2 intra-op threads made both the rank and its
    workers crawl (measured in make bench's image-folder group: ~10x slower)."""
    user = os.environ.get("OMP_NUM_THREADS", "").strip()
    if user.isdigit() and int(user) > 0:
        return int(user)
    return max(1, len(os.sched_getaffinity(0)) // (local_world_size * (1 + num_workers)))


def oversubscription_warning(ranks_on_host: int, jobs: int = 1) -> str | None:
    """One line when this machine runs more ranks than it has usable CPU cores, else None.
    ``jobs``: a sweep's jobs running at once, whose ranks ``ranks_on_host`` counts together.

    Each rank then gets one thread and the ranks take turns on the cores; every step waits
    for the rank that is off its core, so a step runs slower than with one rank per core (the
    results are those of this world on enough cores); ``make bench`` measures it
    (world_size=4 on 2 cores).
    """
    cores = len(os.sched_getaffinity(0))
    if ranks_on_host <= cores:
        return None
    together = (f" ({jobs} sweep jobs at once x {ranks_on_host // jobs} ranks; fewer "
                "hydra.launcher.n_jobs or ranks avoid it)" if jobs > 1 else "")
    return (f"{ranks_on_host} ranks on this machine's {cores} CPU core(s){together}: the ranks "
            f"take turns on the cores and every step waits for the slowest, so training runs "
            f"slower than on {ranks_on_host} cores (the same results as there)")


def init_process_group(backend: str, world: World, timeout_s: float,
                       device_type: str = "cpu") -> None:
    """Join the world's default process group (env:// rendezvous set up by the launcher).

    ``timeout_s`` bounds every collective, so a rank whose peer died fails instead of hanging.
    On ``cuda`` the rank first makes ``cuda:LOCAL_RANK`` its current device (NCCL and
    ``all_gather_object`` use the current device); with nccl the group is bound to it
    (``device_id``: eager NCCL communicator creation).
    """
    kwargs = {}
    if device_type == "cuda":
        torch.cuda.set_device(world.local_rank)
        if backend == "nccl":
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


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum of ``values`` over all ranks, in place; returns it. A no-op outside a
    process group."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, MiB (``getrusage``'s ``ru_maxrss``: KiB on
    Linux, bytes on macOS). DataLoader workers are other processes and are not counted."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


def rss_mb() -> float | None:
    """This process's resident memory now, MiB (``VmRSS`` of ``/proc/self/status``): the
    steady state once a step's temporaries are freed, where ``peak_rss_mb`` is the high-water
    mark. None where there is no ``/proc`` (macOS, Windows)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**10
    except OSError:
        return None
    return None


def broadcast_from_main(tensors: list[torch.Tensor]) -> None:
    """Overwrite ``tensors`` on every rank with rank 0's values, in place (one broadcast each).
    A no-op outside a process group."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for tensor in tensors:
            dist.broadcast(tensor, src=0)


def broadcast_buffers_from_main(module: torch.nn.Module) -> None:
    """Overwrite every buffer of ``module`` (BatchNorm's running statistics and
    ``num_batches_tracked``, or any other ``register_buffer``) with rank 0's, in place: one
    broadcast per dtype and device (the buffers flattened into one tensor). A no-op outside a
    process group or for a module without buffers; every rank must call it.

    The same rule as DDP's ``broadcast_buffers=True``, which copies rank 0's buffers to every
    rank before each synchronised training forward (``DistributedDataParallel._sync_buffers``:
    "The process with rank 0 is considered the authoritative copy"): between those forwards
    each rank's BatchNorm updates its running statistics from its own shard, so at the end of
    an epoch they differ. Calling this before evaluating makes every rank evaluate rank 0's
    model, the one rank 0 saves; DDP's next training forward would copy the same values, so
    training is unchanged.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for buffer in module.buffers():
        groups.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    with torch.no_grad():
        for buffers in groups.values():
            flat = torch.cat([b.reshape(-1) for b in buffers])
            dist.broadcast(flat, src=0)
            offset = 0
            for b in buffers:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()


def gather_rng_states(device: torch.device) -> list[dict[str, torch.Tensor | None]]:
    """Every rank's random-number-generator states, in rank order, on every rank:
    :func:`start_rng_gather` waited for at once. Every rank must call it."""
    return start_rng_gather(device).wait()


class RngGather:
    """Every rank's RNG states as they were when :func:`start_rng_gather` ran, on every rank,
    once :meth:`wait` returns. Started on the default group, the collective runs meanwhile;
    given a side group, :meth:`wait` runs it (on the thread that calls it)."""

    def __init__(self, parts: list[torch.Tensor] | None, work: Any, own: dict, cpu_bytes: int,
                 group: Any = None):
        self._parts, self._work, self._own, self._n = parts, work, own, cpu_bytes
        self._group = group

    def wait(self) -> list[dict[str, torch.Tensor | None]]:
        """``[{"torch": CPU generator state, "cuda": CUDA generator state or None}, ...]`` in
        rank order (CPU uint8 tensors, each its own storage)."""
        if self._group is not None:  # a side group's gather, run here (CPU tensors, gloo)
            group, self._group = self._group, None
            if dist.get_world_size(group) > 1:
                cpu, cuda = self._own["torch"], self._own["cuda"]
                mine = cpu if cuda is None else torch.cat([cpu, cuda.cpu()])
                self._parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
                dist.all_gather(self._parts, mine, group=group)
        if self._parts is None:
            return [self._own]
        if self._work is not None:
            # May run on another thread (the checkpoint writer's): NCCL's wait orders the
            # current stream of the thread's current device, so make it the parts' device.
            device = self._parts[0].device
            with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
                self._work.wait()
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
            self._work = None
        n, has_cuda = self._n, self._own["cuda"] is not None
        return [{"torch": p[:n].cpu().clone(), "cuda": p[n:].cpu().clone() if has_cuda else None}
                for p in self._parts]


def start_rng_gather(device: torch.device, group: Any = None) -> RngGather:
    """Start gathering every rank's random-number-generator states (this rank's as they are
    now: ``torch.get_rng_state()``, 5,056 bytes, and on CUDA ``torch.cuda.get_rng_state``, 16)
    without waiting; :meth:`RngGather.wait` returns them. Every rank must call it, and wait
    for it where ``group`` is given.

    One ``all_gather`` of the states laid end to end in one uint8 tensor, not
    ``all_gather_object``, which pickles and runs two collectives (sizes, then bytes). Every
    rank's states have the same sizes (the same torch build and device type), so rank ``r``'s
    part is its own slice. Outside a process group: this rank's states alone.

    Args:
        device: this rank's device (NCCL gathers device tensors).
        group: None: the gather starts now on the default group (``async_op``: issued here,
            in the order of this thread's collectives, on ``device``). A side group
            (:class:`SideGroup`'s gloo ``group``): the states are only read here (copies),
            and :meth:`RngGather.wait` gathers them over that group as CPU tensors, on the
            thread that calls it (the checkpoint writer's); every rank must wait for its
            gathers on that group in the same order. Issuing the gather (~25 us warm, ~50 us
            after an epoch's steps) was on the loop's thread at every checkpoint (issue 42).
    """
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    own = {"torch": cpu, "cuda": cuda}
    if group is not None:
        return RngGather(None, None, own, cpu.numel(), group)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return RngGather(None, None, own, cpu.numel())
    mine = (cpu if cuda is None else torch.cat([cpu, cuda])).to(device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    return RngGather(parts, dist.all_gather(parts, mine, async_op=True), own, cpu.numel())


class SideGroup:
    """A gloo process group of the whole world beside the default one, for collectives that run
    on a background thread while the loop's own run (a sharded checkpoint's ``dcp.save`` on the
    checkpoint writer's thread: two threads must never share one group's collectives), and a
    ``tag`` every rank agrees on (rank 0's random number), so that names derived from it (a
    checkpoint's temp folder) are the same on every rank and differ between attempts.

    Create on every rank at the same point of its collectives (:func:`side_group`)."""

    def __init__(self, group: Any, tag: str):
        self.group, self.tag = group, tag


def side_group(timeout_s: float) -> SideGroup:
    """A :class:`SideGroup` (one ``new_group`` and one broadcast on the default group; every
    rank must call it). Outside a process group: ``group`` None."""
    import secrets

    token = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
    if not dist.is_initialized():
        return SideGroup(None, f"{int(token):x}")
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    dist.broadcast(token, src=0, group=group)
    return SideGroup(group, f"{int(token):x}")
