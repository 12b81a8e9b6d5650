"""The loop's logging checks (:mod:`ddp_exp.train.loop`'s step 3), rank 0's side: finishing
a started check of the ``train/loss`` window (:class:`ddp_exp.metrics.train_loss.LossWindow`,
one all-reduce per logging step and per epoch end) and writing a logging step's interval:
``train/loss``, ``train/lr``, ``train/samples_per_sec``, ``train/grad_norm`` (and data=tokens'
rates) in one TensorBoard event, the Custom Scalars layout once, the progress bar's figures.

Each function takes the loop, a :class:`ddp_exp.train.loop.Trainer`, read through its
attributes (``world``, ``writer``, ``perf``, ``lm``, ``evaluator``, ``layout_written``,
``optimizer``, ``step_scheduler``, ``step_lr``); this module does not import the loop.

May use: :mod:`ddp_exp.metrics` (the window, the writer's mean, the dashboard, the progress
bar), torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ddp_exp.metrics import dashboard, warmup
from ddp_exp.metrics.progress import Progress
from ddp_exp.metrics.train_loss import LossWindow
from ddp_exp.metrics.writer import mean

if TYPE_CHECKING:
    from ddp_exp.train.training_loop import TrainingLoop


def settle(loop: TrainingLoop, window: LossWindow, progress: Progress) -> tuple[float, int]:
    """Finish the window's started check, if any; a logging step's check writes its
    interval (:func:`write_interval`). Returns the check's world (loss sum, samples), (0, 0) if
    none."""
    done = window.finish(loop.world)
    if done is None:
        window.flags = []  # no check finished here: no decision either
        return 0.0, 0
    loss_sum, samples, timing, context = done
    if context is not None:
        write_interval(loop, window, progress, timing, *context)
    return loss_sum, samples


def write_interval(loop: TrainingLoop, window: LossWindow, progress: Progress,
                   timing: list[float] | None, step: int, grad_norm: torch.Tensor | None,
                   lr: float) -> None:
    """Write the interval's scalars at x = ``step``, the logging step (rank 0), and start
    the next interval; ``timing``: the world's perf table of the interval
    (``trainer.perf_metrics``); ``grad_norm`` and ``lr``: the logging step's."""
    loss_sum, samples, seconds = window.take_interval()
    rate = warmup.rate(samples - loop.warmup.take_interval_samples(), seconds)  # no warm-up
    loss = mean(loss_sum, samples)
    scalars = {
        "train/loss": loss,
        "train/lr": lr,
        "train/samples_per_sec": loop.lm.windows(rate),  # data=tokens: windows, as metrics.json
        "train/grad_norm": grad_norm,
        **loop.lm.train_scalars(rate),
    }
    # One TensorBoard event, encoded after the epoch's loop (MetricsWriter.queue_scalars);
    # every rank's step timing, reduced with the losses, is summarised then too.
    perf = loop.perf if timing is not None else None
    loop.writer.queue_scalars(step, scalars,
                              None if perf is None else lambda: perf.take(timing),
                              () if perf is None else perf.tags)
    if not loop.layout_written:  # the Custom Scalars layout, once per run
        tags = loop.writer.tags | set(loop.evaluator.tags)
        loop.writer.custom_scalars(dashboard.layout(tags))
        loop.layout_written = True
    progress.interval(loss, rate)


def lr_used(loop: TrainingLoop) -> float:
    """The learning rate of the last optimizer step (a per-step scheduler has already set
    the next one)."""
    if loop.step_scheduler is not None:
        return loop.step_lr
    return loop.optimizer.param_groups[0]["lr"]
