"""When the loop writes a step checkpoint (``checkpoints/last.pt`` inside an epoch) and when it
stops for a preemption: the decision every rank must take at the same optimizer step (issue 30).

* ``trainer.checkpoint_every_n_steps``: due at every global step that is a multiple of it; every
  rank counts the same steps, so no communication is needed. Begun at that step without
  waiting for a collective, completed at the next (:func:`begin`, :func:`complete`); the
  minutes, a preemption and ``trainer.max_steps``' stop complete it at once (:func:`take`,
  :func:`at_stop`). Every checkpoint is taken and landed by :mod:`ddp_exp.train.checkpointing`.
* ``trainer.checkpoint_every_n_minutes``: rank 0's clock alone decides (a clock per rank would
  disagree, and gathering the state is a collective that every rank must enter); its "due" flag
  rides in the logging interval's all-reduce (:meth:`ddp_exp.metrics.train_loss.LossWindow.start`,
  ``flags``), which already runs at every logging step and at the end of each epoch, so every
  rank learns it at the same check, within ``trainer.log_every_n_steps`` to twice that many
  steps of the clock's moment (the check is finished one logging interval after it starts).
* Preemption: each rank's ``preempt_requested()`` (the loop's argument of that name: the rank's
  signal handler's flag, ``ddp_exp.rank.preemption.requested``, which the rank hands down: the
  train layer imports nothing of the rank layer) rides in the same all-reduce, which the loop
  then settles at the step that starts it (:attr:`Cadence.decide_now`: within
  ``trainer.log_every_n_steps`` steps of the signal); when any rank
  was told, every rank writes a step checkpoint at that check's step and raises
  :class:`Preempted` (at an epoch's last step: after the epoch's own checkpoint, which is then
  ``last.pt`` whatever ``trainer.save_last``).

The checkpoint itself (what it holds, the position as global samples consumed) is
:mod:`ddp_exp.train.state`'s; the loop (:mod:`ddp_exp.train.loop`) asks this module, and has
it take a step checkpoint (:func:`take`) and enter an epoch at a step checkpoint's position
(:func:`enter_position`). Uses :mod:`ddp_exp.train.checkpointing`; the functions read the
loop through the attributes their docstrings name (this module does not import the loop).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ddp_exp.train import checkpointing
from ddp_exp.train.checkpointing import Taken
from ddp_exp.train.training_loop import TrainingLoop

if TYPE_CHECKING:
    from ddp_exp.config.schema import TrainerConfig

CLOCK, PREEMPT = 0, 1  # the flags' places in the all-reduce (LossWindow.flags)


class Preempted(Exception):
    """Raised by :meth:`ddp_exp.train.loop.Trainer.fit` on every rank, at the same step, once a
    rank was told of a preemption: the step checkpoint (``checkpoints/last.pt``, the position
    in the epoch included) is on disk when it propagates (rank 0 has waited for its writer).
    The rank's caller reports the job as preempted (and requeues it where the cluster can)."""


def never() -> bool:
    """No preemption was requested (the probe of a loop given none)."""
    return False


class Cadence:
    """The step checkpoints' cadence on one rank.

    Args:
        trainer: ``cfg.trainer`` (``checkpoint_every_n_steps``, ``checkpoint_every_n_minutes``;
            null: off).
        is_main: this rank is rank 0 (its clock decides the minutes).
        preempt_requested: True once this rank was told of a preemption (called at each
            check); None: not listened for (``trainer.preempt_signal`` off). Given, every
            logging check is settled at its own step (:attr:`decide_now`) instead of at the
            next one: a stop within one logging interval, for one collective's wait every
            interval.
    """

    def __init__(self, trainer: TrainerConfig, is_main: bool,
                 preempt_requested: Callable[[], bool] | None = None):
        self.every_steps = trainer.checkpoint_every_n_steps
        minutes = trainer.checkpoint_every_n_minutes
        self.every_s = None if minutes is None else 60.0 * float(minutes)
        self.is_main = is_main
        self.last = time.monotonic()
        # A preemption is listened for: each logging check is then settled where it starts,
        # so every rank stops within trainer.log_every_n_steps steps of the signal (issue 30).
        self.decide_now = preempt_requested is not None
        self.preempt_requested = preempt_requested or never

    def flags(self) -> tuple[float, float]:
        """This rank's part of the next check: (rank 0's clock says a checkpoint is due, this
        rank was told of a preemption), as 0.0 / 1.0; summed over the world by the check."""
        due = (self.is_main and self.every_s is not None
               and time.monotonic() - self.last >= self.every_s)
        return float(due), float(bool(self.preempt_requested()))

    def step_due(self, global_step: int) -> bool:
        """``trainer.checkpoint_every_n_steps`` divides ``global_step``."""
        return self.every_steps is not None and global_step % self.every_steps == 0

    def written(self) -> None:
        """A checkpoint was written now: the clock starts again."""
        self.last = time.monotonic()


def decided(flags: list[float]) -> tuple[bool, bool]:
    """A finished check's world flags (``LossWindow.flags``) -> (a checkpoint is due by the
    clock, a preemption was requested); (False, False) when the check carried none."""
    if len(flags) <= PREEMPT:
        return False, False
    return flags[CLOCK] > 0, flags[PREEMPT] > 0


def enter_position(loop: CheckpointedLoop) -> tuple[int, tuple[float, int, float]]:
    """Where the loop's epoch starts: ``(steps done in it, (its world loss sum, samples and
    seconds so far))``, all 0 unless a step checkpoint interrupted it (``loop.position``
    global samples consumed, ``loop.epoch_sums``, set by
    :func:`ddp_exp.train.state.load_state_dict`); then ``loop.loader`` starts at this rank's
    share, ``position / world_size`` (a strided shard: global position ``P`` is every rank's
    sample ``P / W``). Call after the loader's ``set_epoch``."""
    if not loop.position:
        return 0, (0.0, 0, 0.0)
    first = loop.position // loop.cfg.global_batch_size
    loop.loader.set_start(loop.position // loop.world.world_size)
    sums = loop.epoch_sums or (0.0, 0, 0.0)
    loop.position, loop.epoch_sums = 0, None  # consumed: a resume's, once
    return first, (float(sums[0]), int(sums[1]), float(sums[2]))


def take(loop: CheckpointedLoop, window: Any, settle: Callable[[], tuple[float, int]], steps: int,
         loss_sum: float, samples: int, seconds: float) -> tuple[float, int, bool]:
    """Write a step checkpoint after the epoch's ``steps``-th step now (every rank, at the
    same step: the minutes' cadence, a preemption): :func:`begin` and :func:`complete` at
    once. First every loss so far is counted: the pending check finished (``settle``: the
    loop's, which also writes a logging step's scalars), the steps since checked on
    ``window`` (the loop's :class:`ddp_exp.metrics.train_loss.LossWindow`), so the checkpoint
    holds the epoch's sums (``loss_sum``, ``samples``: the world's so far; ``seconds`` in the
    epoch's loop) and the open ``train/loss`` interval whole, and TensorBoard's events up to
    this step are on disk before it is.

    Returns:
        The epoch's world (loss sum, samples) and whether a check finished here carried a
        preemption.
    """
    loss_sum, samples, preempt, taken = begin(loop, window, settle, False, steps, loss_sum,
                                              samples, seconds)
    loss_sum, samples, carried = complete(loop, window, settle, taken, loss_sum, samples)
    return loss_sum, samples, preempt or carried


def begin(loop: CheckpointedLoop, window: Any, settle: Callable[[], tuple[float, int]],
          started_now: bool, steps: int, loss_sum: float, samples: int, seconds: float
          ) -> tuple[float, int, bool, Taken]:
    """Begin a step checkpoint after the epoch's ``steps``-th step without waiting for any
    collective (every rank, at the same step): the check of the steps since the last one is
    started (``started_now``: the loop started it at this logging step; else the check in
    flight, started at an earlier step and so done, is settled first and the steps since are
    started on ``window``), and the checkpoint is taken
    (:func:`ddp_exp.train.checkpointing.take`: the ranks' RNG states sent, rank 0's state
    snapshotted with the position and ``seconds``). The cadence's checkpoint is completed at
    the next step (:func:`complete`), when the check has had a step's time to arrive: a
    synchronous checkpoint waited ~2.4 ms in its collectives for a step of ~2.5 ms on digits
    (issue 30's cost).

    Returns:
        The epoch's world (loss sum, samples) with the check settled here, whether that check
        carried a preemption (then complete at once, and stop), and the taken checkpoint.
    """
    preempt = False
    if not started_now:
        s, n = settle()
        preempt = decided(window.flags)[PREEMPT]
        loss_sum, samples = loss_sum + s, samples + n
        if len(window):
            window.start(loop.world)
    # The sums are the next check's: complete() sets them.
    taken = checkpointing.take(loop, steps * loop.cfg.global_batch_size, (0.0, 0, seconds))
    return loss_sum, samples, preempt, taken


def complete(loop: CheckpointedLoop, window: Any, settle: Callable[[], tuple[float, int]],
             taken: Taken, loss_sum: float, samples: int) -> tuple[float, int, bool]:
    """Complete a step checkpoint :func:`begin` began (every rank, before anything else of
    this step's check): the check started then is settled (the epoch's sums through that
    step, the open ``train/loss`` interval), and the checkpoint lands
    (:func:`ddp_exp.train.checkpointing.land`, TensorBoard's events up to that step in their
    file before the checkpoint is).

    Returns:
        The epoch's world (loss sum, samples) with that check, and whether it carried a
        preemption.
    """
    s, n = settle()
    preempt = decided(window.flags)[PREEMPT]
    loss_sum, samples = loss_sum + s, samples + n
    if taken.state is not None:  # rank 0's snapshot
        taken.state["epoch_sums"] = [loss_sum, samples, taken.state["epoch_sums"][2]]
        taken.state["train_interval"] = [window.interval_sum, window.interval_count,
                                         window.interval_s]
    _land(loop, taken)
    return loss_sum, samples, preempt


def steps_entered(loop: CheckpointedLoop) -> int:
    """The optimizer steps the epoch ``loop.epoch`` has taken before the loop enters it: a
    step checkpoint's ``loop.position`` in this run's global batch, else 0 (call before
    ``loop.train_epoch()``, which consumes the position)."""
    return (loop.position or 0) // loop.cfg.global_batch_size


def at_stop(loop: CheckpointedLoop, steps: int, loss_sum: float, samples: int, seconds: float
            ) -> None:
    """``trainer.max_steps`` stopped the epoch after its ``steps``-th step (< its steps per
    epoch): write ``checkpoints/last.pt`` as a step checkpoint there (every rank; the
    epoch's world ``loss_sum``, ``samples`` and ``seconds`` so far, settled by
    ``train_epoch``), when the run keeps a ``last.pt`` at all (``trainer.save_last`` or
    step checkpoints on). Call after ``train_epoch`` returns and before validation: the
    checkpoint is the loop's state at that step, so a resume under the same
    ``trainer.max_steps`` has nothing left to train, and one under a larger one continues
    exactly (a ``last.pt`` of an earlier step or epoch would train the last steps again)."""
    if not (loop.cfg.trainer.save_last or loop.cadence.every_steps is not None
            or loop.cadence.every_s is not None):
        return
    # Snapshotted here, not on the writer (take's lands_now): validation, the monitor and a
    # per-epoch schedule (the optimizer's learning rate) change before the next step.
    _land(loop, checkpointing.take(loop, steps * loop.cfg.global_batch_size,
                                   (loss_sum, samples, seconds)))


def _land(loop: CheckpointedLoop, taken: Taken) -> None:
    """Land a step checkpoint as ``last.pt`` (after the records up to its step:
    :func:`ddp_exp.train.checkpointing.land`)."""
    checkpointing.land(loop, taken, checkpointing.INSIDE_EPOCH)
    loop.cadence.written()


class CheckpointedLoop(TrainingLoop, Protocol):
    """The loop as this module's helpers see it: :class:`ddp_exp.train.training_loop.TrainingLoop`
    and the step checkpoints' cadence (declared here, beside its class: the protocol's module
    cannot import this one, which imports it)."""

    cadence: Cadence
