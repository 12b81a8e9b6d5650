"""The training loss of the logging intervals and epochs: kept on the device, all-reduced
asynchronously at logging steps, and checked for NaN/inf.

``train/loss`` is the mean over an interval's samples: every micro-batch's mean loss times its
batch size, summed in float64 and all-reduced with the sample count (never a mean of per-rank
means), so it is exact for any world size and uneven last batches. A logging step only starts
that all-reduce (``async_op``); the loop finishes it at its next check, so the host never waits
for it between steps (issue 13).

Uses :mod:`ddp_exp.distributed.process_group` (the rank's place, ``PeerFailed``) and torch only;
the loop
(:mod:`ddp_exp.train.loop`) uses it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ddp_exp.distributed.process_group import PeerFailed, World


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite: raised by the rank whose loss did first (the
    earliest step, then the lowest rank); every other rank raises
    :class:`ddp_exp.distributed.process_group.PeerFailed` at the same check, so that the failure is
    reported
    as that rank's."""


class LossWindow:
    """The training losses of the steps since the last check, kept on the device, and the
    world's running (loss sum, samples, seconds) of the current logging interval.

    ``add`` only appends (no kernel, no sync). ``start`` sums ``loss * batch size`` of the
    pending steps in float64 and starts one all-reduce of (sum, count) without waiting;
    ``finish`` waits for it and counts the result towards the interval (read and reset by
    ``take_interval`` every ``trainer.log_every_n_steps`` global steps) and towards the caller's
    epoch. Checks happen at logging steps and at the end of every epoch, so an interval may span
    an epoch boundary and every ``train/loss`` point averages exactly ``log_every_n_steps``
    steps. The trainer finishes a logging step's check at the next check (the all-reduce then
    overlaps the steps in between: no host wait for it) and the epoch's last check at once. If
    a check's sum is not finite, a second all-reduce finds the first bad step over all ranks and
    that rank raises :class:`NonFiniteLossError`, the others
    :class:`ddp_exp.distributed.process_group.PeerFailed`.
    """

    def __init__(self, device: torch.device):
        self.device = device
        # Sum on the host (Python floats) on the CPU; elsewhere on the device (see start).
        self.on_host = device.type == "cpu"
        self.losses: list[float | torch.Tensor] = []  # floats on the host (see add)
        self.sizes: list[int] = []
        self.weights: list[int] = []  # what each loss is multiplied by: its size, or 1 (sums)
        self.steps: list[int] = []
        # The interval so far, over the whole world (host floats: the checkpoint carries them,
        # so that a resumed run logs the interval it was in like an uninterrupted one).
        self.interval_sum, self.interval_count, self.interval_s = 0.0, 0, 0.0
        self.pending: tuple | None = None  # a check started and not finished (see start)
        self.flags: list[float] = []  # the last finished check's flags, summed over the world

    def add(self, loss: torch.Tensor, size: int, step: int, summed: bool = False) -> None:
        """One micro-batch's mean loss (a device scalar), its sample count and global step;
        with ``summed``, ``loss`` is the sum over its ``size`` counted elements (per-element
        targets: a micro-batch may count none)."""
        # On the CPU the value now (no device to wait for; one call instead of detach() here
        # and float() at the check); elsewhere the tensor, read at the check.
        self.losses.append(loss.item() if self.on_host else loss.detach())
        self.sizes.append(size)
        self.weights.append(1 if summed else size)
        self.steps.append(step)

    def __len__(self) -> int:
        return len(self.losses)

    def start(self, world: World, extra: list[float] | None = None,
              context: Any = None, flags: tuple[float, ...] = ()) -> None:
        """Every rank calls it at the same step: start one all-reduce of the pending steps'
        (loss sum, sample count) without waiting for it (``async_op``), and empty the pending
        list; :meth:`finish` waits for it. A check started before must be finished first.

        ``extra`` (floats) is summed over the world in the same collective (the perf timer's
        table at logging steps); ``context`` is handed back by :meth:`finish` as it was (what
        the logging step wrote down). ``flags`` (floats) ride in the same collective too, and
        :meth:`finish` leaves their world sums in :attr:`flags`: decisions every rank must take
        at the same step (a checkpoint rank 0's clock says is due, a preemption any rank was
        told of) cost no collective of their own (issue 30).

        On the CPU the sum is taken in Python floats, each loss (a float32) times its batch size
        in float64, and the collective's one tensor is built from a list (a world of one needs
        none): a handful of tensor operations would cost more host time (~5-10 us each) than a
        logging interval's steps of a small model can hide (issue 13). Elsewhere the losses stay
        on the device (reading them would wait for it): one stacked product and sum in float64.
        Both sums are exact as long as an interval's terms span less than ~2^24 in magnitude,
        so the two agree.
        """
        import torch.distributed as dist

        assert self.pending is None, "finish() the check started before"
        collective = dist.is_initialized() and world.world_size > 1
        losses: list[float] | torch.Tensor
        totals: list[float] | torch.Tensor
        if self.on_host:
            losses = self.losses  # floats already (add)
            total = 0.0
            for loss, weight in zip(losses, self.weights, strict=True):
                total += loss * weight
            totals = [total, float(sum(self.sizes)), *flags, *(extra or ())]
            if collective:
                totals = torch.tensor(totals, dtype=torch.float64)
        else:
            losses = (torch.stack(self.losses).double() if self.losses
                      else torch.zeros(0, dtype=torch.float64, device=self.device))
            sizes = torch.tensor(self.sizes, dtype=torch.float64, device=self.device)
            weights = torch.tensor(self.weights, dtype=torch.float64, device=self.device)
            totals = torch.stack([(losses * weights).sum(), sizes.sum()])
            if extra is not None or flags:
                totals = torch.cat([totals, torch.tensor([*flags, *(extra or ())],
                                                         dtype=torch.float64,
                                                         device=self.device)])
        work = dist.all_reduce(totals, async_op=True) if collective else None
        self.pending = (work, totals, losses, self.steps, extra is not None, context,
                        len(flags))
        self.losses, self.sizes, self.weights, self.steps = [], [], [], []

    def finish(self, world: World) -> tuple[float, int, list[float] | None, Any] | None:
        """Wait for the check :meth:`start` began (None if there is none) and add its sums to
        the interval; returns the world's (loss sum, sample count), the reduced ``extra`` (None
        without it) and the ``context``.

        Raises:
            NonFiniteLossError: the sum is NaN or infinite, on the rank whose loss was first.
            PeerFailed: the sum is NaN or infinite, on every other rank.
        """
        if self.pending is None:
            return None
        work, totals, losses, steps, has_extra, context, n_flags = self.pending
        self.pending = None
        if work is not None:
            work.wait()
        values = totals.tolist() if isinstance(totals, torch.Tensor) else totals
        loss_sum, count = values[0], int(values[1])
        if not math.isfinite(loss_sum):
            self._raise_nonfinite(losses, steps, world)
        self.interval_sum += loss_sum
        self.interval_count += count
        self.flags = values[2:2 + n_flags]
        return loss_sum, count, values[2 + n_flags:] if has_extra else None, context

    def check(self, world: World) -> tuple[float, int]:
        """:meth:`start` and :meth:`finish` at once: the world's (loss sum, sample count)."""
        self.start(world)
        loss_sum, count, _, _ = self.finish(world)
        return loss_sum, count

    def take_interval(self) -> tuple[float, int, float]:
        """The interval's world (loss sum, samples, training seconds); starts the next one."""
        taken = (self.interval_sum, self.interval_count, self.interval_s)
        self.interval_sum, self.interval_count, self.interval_s = 0.0, 0, 0.0
        return taken

    def _raise_nonfinite(self, losses: list[float] | torch.Tensor, steps: list[int],
                         world: World) -> None:
        import torch.distributed as dist

        bad = (~torch.isfinite(torch.as_tensor(losses, dtype=torch.float64))).nonzero()
        # Encode (step, rank) in one number so one MIN all-reduce finds the earliest.
        mine = steps[int(bad[0])] * world.world_size + world.rank if len(bad) else math.inf
        code = torch.tensor([float(mine)], dtype=torch.float64, device=self.device)
        if dist.is_initialized() and world.world_size > 1:
            dist.all_reduce(code, op=dist.ReduceOp.MIN)
        step, rank = divmod(int(code.item()), world.world_size)
        if rank != world.rank:  # that rank reports it: "rank R failed: NonFiniteLossError: ..."
            raise PeerFailed(f"rank {rank} failed first: non-finite training loss at step {step}")
        raise NonFiniteLossError(f"non-finite training loss at step {step} (the earliest on any "
                                 f"rank); all {world.world_size} rank(s) stopped. Lower optim.lr"
                                 " or check the data for NaN/inf")
