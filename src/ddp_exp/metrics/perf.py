"""Where each rank's step goes, and which rank holds the others back (the ``perf/*`` scalars).

Every rank splits each optimizer step into four parts:

* ``data``: waiting for the next batch (time inside ``next()`` of the training loader);
* ``compute``: from the batch's arrival to the end of the backward graph, i.e. forward and
  backward up to the moment this rank's last gradient (so its last DDP bucket) is ready. The
  moment is stamped by an autograd end-of-backward callback (``queue_callback``), queued by a
  hook registered once on the parameter whose gradient comes first in the backward (the last
  one of ``parameters()``: DDP's bucket order assumes the same), so it runs before the callback
  DDP queues once all its buckets are ready (``finalize_backward``, which waits for the
  gradient all-reduce);
* ``sync``: from there until ``backward()`` returns: waiting for the all-reduce to finish;
* ``optim``: the optimizer step (loss scaling, clipping included).

In synchronous DDP every rank's step lasts as long as the slowest rank's: a rank that computes
faster waits longer in ``sync``. So step time cannot name a straggler; the straggler is the rank
with the longest ``data + compute`` (and the shortest ``sync``).

Cost: four ``time.perf_counter()`` calls, one hook and one callback per backward, nothing
that synchronises the host with the device. On CUDA the compute, sync and optim parts are CUDA
events on the current stream, read at the logging step only (``data`` stays host time). Per
logging interval one all-reduce of a ``[world_size, 7]`` float64 table gathers every rank's
sums; the trainer packs it into the all-reduce of the interval's losses, so the timer adds no
collective of its own. With ``trainer.perf_metrics=false`` none of this exists (the loop holds
``None``).

Limits: collectives inside the forward (DDP's buffer broadcast with BatchNorm, SyncBatchNorm)
count as compute; DataLoader workers' own time is only visible as ``data`` wait; a step in
which the hooked parameter gets no gradient (``find_unused_parameters``) counts its sync wait
as compute.

Uses :mod:`ddp_exp.distributed.process_group`; the loop uses it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ddp_exp.compat.tensors import backward_end_queue
from ddp_exp.distributed.process_group import World, peak_rss_mb

log = logging.getLogger("ddp_exp.perf")

# The per-rank row gathered once per logging interval (seconds, steps, MiB).
FIELDS = ("data_s", "compute_s", "sync_s", "optim_s", "steps", "rss_mb", "cuda_mb")
STRAGGLER_MARGIN = 0.20  # the epoch line names a rank whose data + compute exceeds the fastest's
# ... and by at least this much per step: on a shared machine, 1-3 ms steps jitter by more than
# 20 % (a healthy digits run named a "straggler" that flipped between ranks).
STRAGGLER_MIN_MS = 2.0
PERF_TAGS = ("perf/step_ms", "perf/compute_ms_min", "perf/compute_ms_max",
             "perf/sync_wait_ms_max", "perf/data_wait_fraction", "perf/straggler_rank",
             "perf/max_rss_mb")
CUDA_TAG = "perf/cuda_max_allocated_mb"


def summarize(table: torch.Tensor | list[list[float]], cuda: bool) -> dict[str, float]:
    """The ``perf/*`` scalars of one interval from every rank's sums.

    Computed on the host in Python floats (a few rows: cheaper than a dozen tiny tensor
    operations at every logging step).

    Args:
        table: ``[world_size, len(FIELDS)]`` float64 (a tensor or nested lists), row ``r`` =
            rank ``r``'s sums over the interval (seconds, steps, MiB; see :data:`FIELDS`).
        cuda: also report ``perf/cuda_max_allocated_mb``.

    Returns:
        ``perf/step_ms`` (mean over ranks of each rank's mean step, ms), ``perf/compute_ms_min``
        and ``_max`` (over ranks), ``perf/sync_wait_ms_max``, ``perf/data_wait_fraction``
        (largest over ranks of data / step time), ``perf/straggler_rank`` (the rank with the
        longest data + compute; the lowest such rank on a tie), ``perf/max_rss_mb`` (peak
        resident memory, largest rank) and on CUDA ``perf/cuda_max_allocated_mb``.
    """
    rows = table.tolist() if isinstance(table, torch.Tensor) else table
    per_step = []  # (data, compute, sync, optim) in ms per step, per rank
    for row in rows:
        scale = 1e3 / max(row[4], 1.0)
        per_step.append([row[i] * scale for i in range(4)])
    steps = [sum(r) for r in per_step]
    compute = [r[1] for r in per_step]
    out = {
        "perf/step_ms": sum(steps) / len(steps),
        "perf/compute_ms_min": min(compute),
        "perf/compute_ms_max": max(compute),
        "perf/sync_wait_ms_max": max(r[2] for r in per_step),
        "perf/data_wait_fraction": max(r[0] / max(sum(r), 1e-12) for r in per_step),
        "perf/straggler_rank": float(_straggler(rows)),
        "perf/max_rss_mb": max(row[5] for row in rows),
    }
    if cuda:
        out[CUDA_TAG] = max(row[6] for row in rows)
    return out


def _straggler(rows: list[list[float]]) -> int:
    busy = [(r[0] + r[1]) / max(r[4], 1.0) for r in rows]
    return busy.index(max(busy))


def straggler_rank(table: torch.Tensor) -> int:
    """The rank with the longest ``data + compute`` per step in ``table`` (as in
    :func:`summarize`); the lowest such rank on a tie."""
    return _straggler(table.double().tolist())


def straggler_line(table: torch.Tensor, epoch: int) -> str | None:
    """The end-of-epoch sentence naming a straggler, or None: a rank whose ``data + compute``
    per step over the epoch exceeds the fastest rank's by more than
    :data:`STRAGGLER_MARGIN` (20 %) and by at least :data:`STRAGGLER_MIN_MS` (2 ms: below that
    the difference is scheduling noise on a shared machine).

    Args:
        table: ``[world_size, len(FIELDS)]`` sums over the epoch.
        epoch: 0-based epoch index (printed 1-based).
    """
    t = table.double()
    if len(t) < 2 or float(t[:, 4].min()) == 0:
        return None
    busy = (t[:, 0] + t[:, 1]) / t[:, 4] * 1e3
    slow, fast = straggler_rank(t), int(busy.argmin())
    if float(busy[slow]) <= float(busy[fast]) * (1 + STRAGGLER_MARGIN) or (
            float(busy[slow] - busy[fast]) < STRAGGLER_MIN_MS):
        return None
    sync = t[:, 2] / t[:, 4] * 1e3
    return (f"epoch {epoch + 1}: rank {slow} is a straggler: data + compute "
            f"{float(busy[slow]):.2f} ms/step, {float(busy[slow] / busy[fast]):.2f}x the fastest "
            f"rank's (rank {fast}, {float(busy[fast]):.2f} ms); the other ranks wait for it in "
            f"every all-reduce (rank {fast} waits {float(sync[fast]):.2f} ms/step)")


class StepTimer:
    """One rank's step timing; the loop calls it at four points, and once per interval.

    Usage in the loop (see :class:`ddp_exp.train.loop.Trainer`)::

        timer.attach(model)                                      # once
        for group in groups(timer.timed(loader), accumulate):   # data wait, batch arrival
            ... forward, backward of each micro-batch
            timer.backward_done()                                # after the last backward()
            timer.step_done()                                    # after optimizer.step()
        flat = timer.row()                       # every rank, at logging steps: its sums
        scalars = timer.take(summed_over_world)  # that list summed over the ranks (all-reduce)

    Args:
        world: this rank's place.
        device: the rank's device; on ``cuda`` compute/sync/optim are CUDA events.
    """

    def __init__(self, world: World, device: torch.device):
        self.world, self.device = world, device
        self.cuda = device.type == "cuda"
        self.sums = [0.0] * 5  # data, compute, sync, optim (seconds), steps
        # The epoch's sums, every rank's row (what end_epoch's straggler line reads).
        self.epoch_rows = self._zero_rows()
        self._t_batch = self._t_grads = self._t_backward = 0.0
        self._grads_seen = False
        # CUDA: one set of 4 events per step of the interval (start, grads, backward, optim),
        # reused across intervals; `_slot` is the current step's set.
        self._events: list[tuple[Any, ...]] = []
        self._slot = 0
        self._grads_recorded: list[bool] = []

    def _zero_rows(self) -> list[list[float]]:
        return [[0.0] * len(FIELDS) for _ in range(self.world.world_size)]

    # ----------------------------------------------------------------- the four points
    def timed(self, batches: Iterable) -> Iterator:
        """Yield ``batches``' items, adding the time spent waiting for each to ``data``."""
        it = iter(batches)
        clock = time.perf_counter
        while True:
            t = clock()
            try:
                item = next(it)
            except StopIteration:
                return
            now = clock()
            self.sums[0] += now - t
            self._t_batch = now
            if self.cuda:
                self._cuda_slot()[0].record()
            yield item

    def attach(self, model: torch.nn.Module) -> None:
        """Stamp the end of every backward graph of ``model`` (all gradients, hence every DDP
        bucket, ready): a hook on its last trainable parameter queues the callback."""
        params = [p for p in model.parameters() if p.requires_grad]
        if params:
            # Autograd's end-of-backward queue, looked up once (not per step); the callback
            # runs before DDP's finalize (queued later).
            queue, ready = backward_end_queue(), self._grads_ready
            params[-1].register_post_accumulate_grad_hook(lambda _param: queue(ready))

    def _grads_ready(self) -> None:
        self._grads_seen = True
        if self.cuda:
            self._cuda_slot()[1].record()
            self._grads_recorded[self._slot] = True
        else:
            self._t_grads = time.perf_counter()

    def backward_done(self) -> None:
        """After the last micro-batch's ``backward()`` (DDP's all-reduce has finished)."""
        if self.cuda:
            self._cuda_slot()[2].record()
            return
        now = time.perf_counter()
        grads = self._t_grads if self._grads_seen else now
        self.sums[1] += grads - self._t_batch
        self.sums[2] += now - grads
        self._t_backward = now
        self._grads_seen = False

    def step_done(self) -> None:
        """After ``optimizer.step()``: the step is complete."""
        if self.cuda:
            self._cuda_slot()[3].record()
            self._slot += 1
        else:
            self.sums[3] += time.perf_counter() - self._t_backward
        self.sums[4] += 1
        self._grads_seen = False

    # ------------------------------------------------------------------- CUDA events
    def _cuda_slot(self) -> tuple[Any, ...]:
        while len(self._events) <= self._slot:
            self._events.append(tuple(torch.cuda.Event(enable_timing=True) for _ in range(4)))
            self._grads_recorded.append(False)
        return self._events[self._slot]

    def _read_events(self) -> None:
        """Add the interval's CUDA event times to the sums (synchronises with the last one)."""
        if not self._slot:
            return
        self._events[self._slot - 1][3].synchronize()
        for i in range(self._slot):
            start, grads, backward, optim = self._events[i]
            grads = grads if self._grads_recorded[i] else backward
            self.sums[1] += start.elapsed_time(grads) / 1e3
            self.sums[2] += grads.elapsed_time(backward) / 1e3
            self.sums[3] += backward.elapsed_time(optim) / 1e3
            self._grads_recorded[i] = False
        self._slot = 0  # the next batch is fetched after the logging step

    # ---------------------------------------------------------------- per interval
    def row(self) -> list[float]:
        """This rank's row of the interval's ``[world_size, 7]`` table, flattened
        (``world_size * 7`` floats, zeros in the other ranks' rows), and the start of the next
        interval: what :meth:`take` needs once summed over the world. The trainer all-reduces
        it in the same collective as the losses. Python floats: a logging step builds one
        tensor for the whole collective, not one per part (each tensor operation costs
        ~5-10 us of host time, a step of a small model ~700 us: issue 13)."""
        if self.cuda:
            self._read_events()
        row = [*self.sums, peak_rss_mb(),
               torch.cuda.max_memory_allocated(self.device) / 2**20 if self.cuda else 0.0]
        self.sums = [0.0] * 5  # the next interval starts
        width = len(FIELDS)
        flat = [0.0] * (self.world.world_size * width)
        flat[self.world.rank * width:(self.world.rank + 1) * width] = row
        return flat

    @property
    def tags(self) -> tuple[str, ...]:
        """The tags :meth:`take` returns."""
        return (*PERF_TAGS, CUDA_TAG) if self.cuda else PERF_TAGS

    def take(self, flat: list[float]) -> dict[str, float]:
        """The interval's ``perf/*`` scalars from the world's table (the sum over ranks of
        :meth:`row`, flattened, which started the next interval); keeps the epoch's totals
        for :meth:`end_epoch`. Rank 0 calls it when it writes the interval's scalars (after
        the epoch's loop), in step order, before :meth:`end_epoch`."""
        width = len(FIELDS)
        rows = [flat[r * width:(r + 1) * width] for r in range(self.world.world_size)]
        for total, row in zip(self.epoch_rows, rows, strict=True):
            for i in range(5):
                total[i] += row[i]
        return summarize(rows, self.cuda)

    def end_epoch(self, epoch: int) -> str | None:
        """At the end of each epoch: rank 0 logs a warning naming a straggler (see
        :func:`straggler_line`); returns the line (None if no rank stands out). No collective:
        rank 0 holds the epoch's gathered table (:meth:`take`)."""
        line = straggler_line(torch.tensor(self.epoch_rows, dtype=torch.float64), epoch)
        self.epoch_rows = self._zero_rows()
        if line and self.world.is_main:
            log.warning(line)
        return line
