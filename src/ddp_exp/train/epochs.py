"""The epochs of the loop (:mod:`ddp_exp.train.loop`'s steps 4 and 5) and what follows each:
validation, the epoch's line, data=tokens' text sample, the straggler line, histograms, the
monitored metric (a new best, early stopping, a sweep's pruning: :mod:`ddp_exp.train.monitor`),
a per-epoch schedule's step, the epoch's checkpoints (:mod:`ddp_exp.train.checkpointing`) and a
preemption decided at its last step; then the run's final metrics (``metrics.json``).

Each function takes the loop, a :class:`ddp_exp.train.loop.Trainer`, read through its
attributes (``cfg``, ``epoch``, ``global_step``, ``evaluator``, ``lm``, ``perf``, ``writer``,
``model``, ``monitor``, ``scheduler``, ``step_scheduler``, ``cadence``, ``preempted``,
``checkpoint_due``, ``steps_per_epoch``) and its ``train_epoch()``; it advances ``epoch`` and
sets ``last_train``. This module does not import the loop.

May use: :mod:`ddp_exp.metrics` (the epoch's line, the dashboard, the writer's mean),
:mod:`ddp_exp.train.schedule`, :mod:`ddp_exp.train.checkpointing`,
:mod:`ddp_exp.train.step_checkpoint` (``Preempted``), :mod:`ddp_exp.train.step_validation`
(``trainer.val_every_n_steps``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ddp_exp.metrics import dashboard, warmup
from ddp_exp.metrics.progress import EpochResult, epoch_line
from ddp_exp.metrics.writer import mean
from ddp_exp.train import checkpointing, schedule, step_checkpoint, step_validation
from ddp_exp.train.step_checkpoint import Preempted

if TYPE_CHECKING:
    from ddp_exp.train.step_checkpoint import CheckpointedLoop
    from ddp_exp.train.training_loop import TrainingLoop

log = logging.getLogger("ddp_exp.train")


def run_epochs(loop: CheckpointedLoop) -> tuple[EpochResult | None, float, int]:
    """The epochs of :meth:`ddp_exp.train.loop.Trainer.fit`: returns the last epoch's result
    (None if none ran), the seconds in the training loops and the samples trained in them,
    warm-up left out of both (:mod:`ddp_exp.metrics.warmup`)."""
    trainer = loop.cfg.trainer
    max_steps = trainer.max_steps
    last: EpochResult | None = None
    train_s, run_samples = 0.0, 0
    while loop.epoch < trainer.epochs and not loop.monitor.stopped_early:
        entered, step_before = step_checkpoint.steps_entered(loop), loop.global_step
        loss_sum, samples, seconds = loop.train_epoch()
        # trainer.max_steps stopped the epoch part-way: last.pt is the step checkpoint of
        # where it stopped, taken before validation changes the monitor or the schedule, so
        # a resume finds nothing left to train, or continues exactly under a larger max_steps.
        done_in_epoch = entered + loop.global_step - step_before
        # (Or early stopping by validation steps stopped it.)
        stopped = ((max_steps is not None and loop.global_step >= max_steps)
                   or loop.monitor.stopped_early)
        partial = stopped and done_in_epoch < loop.steps_per_epoch
        if partial:
            step_checkpoint.at_stop(loop, done_in_epoch, loss_sum, samples, seconds)
        timed = samples - loop.warmup.take_epoch_samples()  # warm-up is not in seconds
        train_s, run_samples = train_s + seconds, run_samples + timed
        by_steps = step_validation.every(loop) is not None  # validated inside the epoch
        val = (step_validation.at_epoch_end(loop, stopped or loop.epoch + 1 >= trainer.epochs)
               if by_steps else loop.evaluator.validate(loop.epoch, loop.global_step))
        last = EpochResult(loop.epoch, loop.global_step, mean(loss_sum, samples), samples,
                           seconds, val, loop.lm.unit, timed,
                           loop.last_val_step if by_steps else None)
        log.info(epoch_line(last, trainer.epochs))
        warmup.report(loop.warmup, loop.writer, loop.global_step)  # perf/compile_s, its line
        with loop.strategy.evaluation():  # FSDP: whole parameters for rank 0's reads
            if not by_steps:
                loop.lm.sample(loop.epoch, loop.global_step)  # rank 0, its own generator
            dashboard.write_histograms(loop.writer, loop.model, loop.epoch, loop.global_step,
                                       trainer.log_histograms_every_n_epochs)
        loop.last_train = (last.train_loss, last.train_samples)  # kept in checkpoints
        if loop.perf is not None:  # the straggler line (trainer.perf_metrics)
            loop.perf.end_epoch(loop.epoch)
        final = loop.epoch + 1 >= trainer.epochs or (max_steps is not None
                                                     and loop.global_step >= max_steps)
        # reduced: all agree (by steps: each validation updated the monitor)
        improved = not by_steps and loop.monitor.update(last.val, loop.epoch, final)
        if loop.scheduler is not None and loop.step_scheduler is None:  # per epoch
            schedule.step_epoch(loop.scheduler, last.val, loop.monitor.metric)
        loop.epoch += 1
        if loop.monitor.stopped_early:
            log.info(loop.monitor.stop_line(trainer.epochs))
        # A partial epoch: its last.pt is the step checkpoint above; a new best is still kept
        # (marked not resumable: it was taken after the partial epoch's validation).
        checkpointing.at_epoch_end(loop, best=improved, complete=not partial,
                                   force_last=loop.preempted or loop.checkpoint_due)
        loop.cadence.written()
        if loop.preempted:
            raise Preempted(f"preempted at the end of epoch {loop.epoch} (step "
                            f"{loop.global_step}): checkpoints/last.pt holds it")
        if max_steps is not None and loop.global_step >= max_steps:
            break
        loop.writer.flush()  # the epoch's events on disk before the next epoch's loop
        if loop.monitor.stopped_early:
            break
    return last, train_s, run_samples


def final_metrics(loop: TrainingLoop, last: EpochResult, run_samples: int, train_s: float
                  ) -> dict[str, Any]:
    """The final global metrics of the last epoch (docs/metrics-and-tensorboard.md). For
    token data the loop counts tokens: ``train/num_samples`` and ``train/samples_per_sec``
    count windows, ``train/num_tokens`` and ``train/tokens_per_sec`` tokens."""
    windows = loop.lm.windows(last.train_samples)
    tokens = {"train/num_tokens": last.train_samples} if loop.lm.active else {}
    return {
        **last.val,
        "train/epoch_loss": last.train_loss,  # TensorBoard's train/loss: an interval
        "train/num_samples": None if windows is None else round(windows),
        **tokens,
        "train/samples_per_sec": loop.lm.windows(warmup.rate(run_samples, train_s)),
        **loop.lm.train_scalars(warmup.rate(run_samples, train_s)),
        "time/train_s": train_s,
        **warmup.final_metrics(loop.warmup),
        "epoch": last.epoch + 1,
        "global_step": loop.global_step,
        "steps_per_epoch": loop.steps_per_epoch,
    }
