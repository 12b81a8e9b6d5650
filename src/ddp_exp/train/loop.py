"""The per-rank training loop: DDP, one epoch of optimizer steps, the logging step, the epochs.

One epoch, on every rank (nanoGPT / torchtitan idiom, top to bottom):

1. ``sampler.set_epoch(epoch)``: a new permutation per epoch, the same on every rank, strided
   into shards (``DistributedSampler``).
2. Per optimizer step: ``zero_grad`` (autograd accumulates into ``.grad``), then for each of the
   ``trainer.accumulate_grad_batches`` micro-batches a forward through the DDP wrapper and
   ``backward()``; DDP all-reduces gradient buckets while the last micro-batch's backward runs,
   and the earlier ones run forward *and* backward inside ``no_sync()`` (a ``no_sync`` around
   backward alone still syncs: DDP docstring). Each micro-batch loss is weighted by its share of
   the step's samples, so ``accumulate_grad_batches=2, batch_size=b`` steps exactly like
   ``batch_size=2b``. Per-element labels (tokens, pixels) weigh every counted element alike:
   each backward takes the summed loss times ``world_size / N``, N the world's count of the
   step (:func:`ddp_exp.train.steps.element_step`); DistributedSampler's repeats count zero
   (:func:`ddp_exp.train.steps.padded_step`). With ``trainer.gradient_clip_val``, the global
   L2 norm of the (all-reduced, hence identical on every rank; unscaled under ``16-mixed``)
   gradients is clipped. Then ``optimizer.step()`` (:class:`ddp_exp.train.optimizer.OptimizerStep`)
   and, with a per-step schedule, ``scheduler.step()``: once per optimizer step, never per
   micro-batch. Losses stay on the device: no host sync per step (:mod:`ddp_exp.train.steps`).
3. Every ``trainer.log_every_n_steps`` global steps: one all-reduce of (loss sum, sample count)
   (:class:`ddp_exp.metrics.train_loss.LossWindow`); rank 0 writes ``train/loss`` (mean over the
   interval's samples), ``train/lr`` (the rate the step used), ``train/samples_per_sec`` and
   ``train/grad_norm`` (the global norm of the step's all-reduced gradients, before clipping)
   at x = global step. An interval may span an epoch boundary, so the points are evenly
   spaced; at the end of each epoch one more all-reduce gives the epoch's mean,
   ``train/epoch_loss`` (x = the epoch's last step). A logging step's all-reduce is started
   without waiting and finished at the next check (the next logging step or the epoch's end),
   so the host never waits for it between steps; its scalars go into one TensorBoard event,
   encoded after the epoch's loop (``MetricsWriter.queue_scalars``). A non-finite sum stops
   every rank at once, at that next check, naming the first bad step. The same all-reduce
   carries the step checkpoints' decisions (``trainer.checkpoint_every_n_minutes`` on rank 0's
   clock, a preemption on any rank); a step checkpoint writes ``checkpoints/last.pt`` inside
   the epoch with its position, and an epoch resumed from one starts there
   (:mod:`ddp_exp.train.step_checkpoint`).
4. Evaluation of the whole validation set through the unwrapped model
   (:mod:`ddp_exp.train.evaluation`): one all-reduce of (loss sum, correct, count), and rank 0
   writes ``val/loss`` and ``val/accuracy``; with ``trainer.val_every_n_steps``, after every
   N-th global step instead, inside the epoch (:mod:`ddp_exp.train.step_validation`).
5. The monitored metric (:mod:`ddp_exp.train.monitor`): a new best writes ``checkpoints/best.pt``;
   ``trainer.early_stopping_patience`` epochs without one stop every rank after the same epoch.
   A per-epoch schedule steps; ``checkpoints/last.pt`` is written (:mod:`ddp_exp.train.state`).
   At the end, the test split is evaluated once like validation, with the best or the last
   weights (``trainer.test_weights``).

Uses the loop's helpers, none of which imports this module: :mod:`ddp_exp.train.steps` (one
optimizer step), :mod:`ddp_exp.train.log_interval` (the logging checks' scalars),
:mod:`ddp_exp.train.epochs` (the epochs and each one's end), :mod:`ddp_exp.train.step_checkpoint`,
:mod:`ddp_exp.train.optimizer`, :mod:`ddp_exp.metrics.train_loss`, :mod:`ddp_exp.train.evaluation`,
:mod:`ddp_exp.train.state`, :mod:`ddp_exp.train.schedule`, :mod:`ddp_exp.train.monitor`,
:mod:`ddp_exp.data.loaders`, :mod:`ddp_exp.metrics.writer`, :mod:`ddp_exp.metrics.perf`,
:mod:`ddp_exp.metrics.dashboard`, :mod:`ddp_exp.metrics.progress`,
:mod:`ddp_exp.distributed.sync_batchnorm`. :mod:`ddp_exp.rank.worker` runs it on each rank.
"""

from __future__ import annotations

import _thread
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ddp_exp.config.view import RankConfig
from ddp_exp.data import Datasets
from ddp_exp.data.loaders import RankData
from ddp_exp.distributed.process_group import SideGroup, World
from ddp_exp.io.files import BackgroundWriter
from ddp_exp.job import pruning
from ddp_exp.metrics.lm import LanguageModelReport
from ddp_exp.metrics.perf import StepTimer
from ddp_exp.metrics.progress import EpochResult, Progress, resolve_mode, steps_in_epoch
from ddp_exp.metrics.train_loss import LossWindow
from ddp_exp.metrics.warmup import Warmup
from ddp_exp.metrics.writer import MetricsWriter, mean
from ddp_exp.train import schedule, step_checkpoint, step_validation, steps
from ddp_exp.train.epochs import final_metrics, run_epochs
from ddp_exp.train.evaluation import Evaluator
from ddp_exp.train.log_interval import lr_used, settle
from ddp_exp.train.monitor import Monitor
from ddp_exp.train.objective import Objective
from ddp_exp.train.optimizer import autocast, build_optimizer, grad_scaler
from ddp_exp.train.step_checkpoint import Cadence, Preempted, decided
from ddp_exp.train.strategies import build_strategy
from ddp_exp.train.strategy import startup_line

log = logging.getLogger("ddp_exp.train")


class Trainer:
    """The loop of one rank: built from the resolved config, the data and the seeded model.

    Args:
        cfg: the run's typed config (:class:`ddp_exp.config.view.RankConfig`, the view
            :func:`ddp_exp.config.view.rank_config` makes of the resolved dict).
        world: this rank's place; the default process group is initialised.
        datasets: the train/validation split, identical on every rank.
        model: the seeded, unwrapped model (DDP broadcasts rank 0's parameters at wrap time).
        objective: the loss and validation metrics.
        device: this rank's device.
        writer: rank 0's TensorBoard/metrics writer (a no-op elsewhere).
        preempt_requested: called at every logging check: True once this rank was told of a
            preemption (``ddp_exp.rank.preemption.requested``, handed down by the rank); then
            every rank writes a step checkpoint at the same step and :meth:`fit` raises
            :class:`ddp_exp.train.step_checkpoint.Preempted`. None: never.
    """

    def __init__(self, cfg: RankConfig, world: World, datasets: Datasets,
                 model: nn.Module, objective: Objective, device: torch.device,
                 writer: MetricsWriter, preempt_requested: Callable[[], bool] | None = None):
        self.cfg, self.world, self.datasets, self.device, self.writer = (
            cfg, world, datasets, device, writer)
        trainer = cfg.trainer
        self.precision = trainer.precision
        self.accumulate = trainer.accumulate_grad_batches
        self.objective = objective
        # The data path (ddp_exp.data.loaders): in-memory batches are cut on the device from one
        # copy of the set; DataLoader workers and lazy datasets serve host batches, pinned on CUDA
        # so that each step's copy is asynchronous (non_blocking=True in _step).
        self.data = RankData(datasets, cfg.data, cfg.seed, world.rank, world.world_size, device)
        self.loader = self.data.train
        self.move_batches = self.data.move_batches
        # In-memory arrays: one float tensor in, one tensor out (the fast path, no dispatch).
        self.plain_batches = datasets.in_memory
        # The strategy (ddp_exp.train.strategy): DDP over the replicated model, or FSDP2 over
        # its shards; self.model is the unwrapped module, self.ddp what the forward calls.
        self.strategy = build_strategy(cfg, model, device, datasets.train.input_shape,
                                       datasets.train.num_outputs)
        self.model, self.ddp = self.strategy.module, self.strategy.wrapped
        # torch.compile wraps the DDP module (DDPOptimizer splits graphs at bucket boundaries).
        self.forward = torch.compile(self.ddp) if trainer.compile else self.ddp
        self.optimizer = build_optimizer(cfg, self.ddp.parameters())
        if world.is_main:
            log.info("%s", startup_line(self.strategy, getattr(self.strategy, "section", None),
                                        self.optimizer))
        self.scaler = grad_scaler(self.precision, device)  # 16-mixed only: loss scaling
        self.autocast = autocast(device, self.precision)
        # The recipe (issue 15). Each feature that is off costs the hot path nothing: no
        # scheduler object is called, no norm is computed.
        self.run_steps = schedule.total_steps(trainer.epochs, trainer.max_steps,
                                              self.steps_per_epoch)
        self.scheduler, interval = schedule.build_scheduler(
            cfg.targets.scheduler, self.optimizer, self.run_steps, self.steps_per_epoch)
        self.step_scheduler = self.scheduler if interval == "step" else None
        self.step_lr = self.optimizer.param_groups[0]["lr"]  # the lr the last step used
        # Unscaling, clipping or the train/grad_norm measure, optimizer.step()
        # (ddp_exp.train.optimizer).
        self.optim_step = self.strategy.optimizer_step(self.optimizer, self.scaler,
                                                       trainer.gradient_clip_val)
        self.grad_norm: torch.Tensor | None = None  # the last step's norm, before clipping
        self.log_every = trainer.log_every_n_steps
        self.monitor = Monitor(trainer.monitor, trainer.monitor_mode,
                               trainer.early_stopping_patience)
        self.monitor.trial = pruning.link_trial(world.is_main, device)  # hydra/sweeper=ddp_optuna
        torch.manual_seed(cfg.seed + world.rank)  # dropout and other randomness per rank
        # Dashboards (ddp_exp.metrics.perf, ddp_exp.metrics.dashboard): the step timer exists only
        # with trainer.perf_metrics, so that without it the step does no extra work at all.
        self.perf = StepTimer(world, device) if trainer.perf_metrics else None
        if self.perf is not None:
            self.perf.attach(self.model)  # stamps the end of each backward graph
        # Validation and the test split (ddp_exp.train.evaluation), through the unwrapped model.
        self.evaluator = Evaluator(self.model, self.data, datasets, objective, world, device,
                                   self.precision, writer, self.strategy)
        self.layout_written = False
        # data=tokens: tokens/s, model FLOP/s, MFU and text samples (ddp_exp.metrics.lm).
        self.lm = LanguageModelReport(trainer, cfg.seed, datasets, self.model, world.world_size,
                                      world.is_main, writer)
        # Rank 0's checkpoint files, written on a background thread (ddp_exp.io.files): the loop
        # does not wait for the disk.
        self.checkpoint_files = BackgroundWriter()
        # strategy.checkpoint=sharded: the gloo side group every rank's writer saves its shard
        # over (made at the first sharded checkpoint, every rank at the same point), and the
        # sharded checkpoints taken (each one's temporary folder is named by the count).
        self.checkpoint_group: SideGroup | None = None
        self.sharded_taken = 0
        # Held while the writer's thread snapshots a checkpoint's weights; the next optimizer
        # step acquires it (ddp_exp.train.checkpointing.take). None: no snapshot pending.
        self.snapshot_gate: _thread.LockType | None = None
        self.epoch = 0  # the next epoch to run
        # Step checkpoints (ddp_exp.train.step_checkpoint): the cadence, and the position in
        # the epoch in progress (global samples consumed) with its sums, set while a step
        # checkpoint is taken and by a resume from one.
        self.cadence = Cadence(trainer, world.is_main, preempt_requested)
        self.position, self.epoch_sums = 0, None
        self.preempted = self.checkpoint_due = False  # decided at the epoch's last check
        self.global_step = 0
        self.window = LossWindow(device)  # train/loss intervals, across epochs
        # The first step and compiling steps: timed, left out of every rate (metrics.warmup).
        self.warmup = Warmup(trainer.compile, device, world.world_size)
        self.last_train: tuple[float | None, int] = (None, 0)  # last epoch's train loss, samples
        # trainer.val_every_n_steps (ddp_exp.train.step_validation): the last validation's
        # results and global step, and the validations this process ran.
        self.last_val: dict[str, Any] | None = None
        self.last_val_step: int | None = None
        self.validations = 0

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch: ``ceil(batches per rank / accumulate_grad_batches)``."""
        return math.ceil(len(self.loader) / self.accumulate)

    def train_epoch(self) -> tuple[float, int, float]:
        """Run one epoch (or up to ``trainer.max_steps``); returns the world's (loss sum,
        samples, seconds in the loop) and writes their mean as ``train/epoch_loss`` at x = the
        epoch's last global step.

        ``train/loss``, ``train/lr`` and ``train/samples_per_sec`` are written at every global
        step that is a multiple of ``trainer.log_every_n_steps`` and nowhere else: the interval
        that is open when an epoch ends continues into the next one (validation and checkpoint
        time excluded from its samples/s).

        An epoch a step checkpoint interrupted (``self.position`` samples consumed, loaded by
        :func:`ddp_exp.train.state.load_state_dict`) continues at that position: the sampler
        starts there (nothing replayed) and the epoch's sums start from the checkpoint's.
        Step checkpoints and preemption: :mod:`ddp_exp.train.step_checkpoint`.

        Raises:
            Preempted: a rank was told of a preemption; the step checkpoint is written.
        """
        trainer = self.cfg.trainer
        max_steps, log_every = trainer.max_steps, trainer.log_every_n_steps
        self.loader.set_epoch(self.epoch)
        first, (loss_sum, samples, seconds_before) = step_checkpoint.enter_position(self)
        self.ddp.train()
        window = self.window
        progress = Progress(resolve_mode(trainer.progress.value, self.world.is_main), self.epoch,
                            trainer.epochs, steps_in_epoch(self.steps_per_epoch, first,
                                                           self.global_step, max_steps),
                            self.lm.unit)
        progress.done = first  # a resumed epoch's steps done
        if progress.bar is not None:
            progress.bar.update(first)
        t_epoch = t_mark = time.perf_counter()
        try:
            batches = self.loader if self.perf is None else self.perf.timed(self.loader)
            if self.data.duplicate_last:
                batches = steps.duplicate_ignored(self, batches, first * self.accumulate)
            # A training set the world does not divide: the epoch's last step holds
            # DistributedSampler's duplicates, which count zero (steps.padded_step).
            padded_step = self.steps_per_epoch - 1 if self.data.padded else -1
            deferred = None  # a cadence step checkpoint begun at the step before
            for k, group in enumerate(steps.groups(batches, self.accumulate), start=first):
                self.warmup.begin(window.sizes)
                if k == padded_step:
                    steps.padded_step(self, group, window)
                else:
                    steps.train_step(self, group, window)
                warm_s = self.warmup.end(window.sizes)  # 0.0 for a steady step
                t_mark, t_epoch = t_mark + warm_s, t_epoch + warm_s  # not in any rate
                progress.step()
                carried = False  # a preemption the completed checkpoint's check carried
                if deferred is not None:
                    t_checkpoint = time.perf_counter()
                    loss_sum, samples, carried = step_checkpoint.complete(
                        self, window, lambda: settle(self, window, progress), deferred,
                        loss_sum, samples)
                    deferred = None
                    t_mark += time.perf_counter() - t_checkpoint  # not training time
                if step_validation.due(self):  # trainer.val_every_n_steps: before any checkpoint
                    t_val = time.perf_counter()
                    step_validation.validate(self, final=max_steps is not None
                                             and self.global_step >= max_steps)
                    t_mark += time.perf_counter() - t_val  # not training time
                stop = ((max_steps is not None and self.global_step >= max_steps)
                        or self.monitor.stopped_early)  # early stopping by validation steps
                log_now = self.global_step % log_every == 0
                # A logging step or the epoch's last: one all-reduce of (loss sum, count).
                last = stop or progress.done == progress.steps
                clock, preempt = False, carried
                if log_now or last:
                    # The logging step before: its all-reduce has run during the steps since.
                    s, n = settle(self, window, progress)
                    loss_sum, samples = loss_sum + s, samples + n
                    self.warmup.checked()  # warm-up samples: the interval reduced next
                    clock, preempt = decided(window.flags)
                    preempt = preempt or carried
                    now = time.perf_counter()
                    window.interval_s += now - t_mark
                    t_mark = now
                    # The perf timer's table rides in the same all-reduce, and the flags.
                    timing = self.perf.row() if log_now and self.perf is not None else None
                    window.start(self.world, timing, (self.global_step, self.grad_norm,
                                                      lr_used(self)) if log_now else None,
                                 self.cadence.flags())
                    if last:  # the epoch's sums are needed now
                        s, n = settle(self, window, progress)
                        loss_sum, samples = loss_sum + s, samples + n
                        end_clock, end_preempt = decided(window.flags)
                        self.preempted = preempt or end_preempt
                        self.checkpoint_due = (clock or end_clock
                                               or self.cadence.step_due(self.global_step))
                    elif self.cadence.decide_now:  # a preemption stops within one interval
                        s, n = settle(self, window, progress)
                        loss_sum, samples = loss_sum + s, samples + n
                        now_clock, now_preempt = decided(window.flags)
                        clock, preempt = clock or now_clock, preempt or now_preempt
                if not (last or clock or preempt) and self.cadence.step_due(self.global_step):
                    # The cadence's checkpoint waits for no collective here: the next step
                    # completes it (step_checkpoint.begin), unless a preemption says stop now.
                    t_checkpoint = time.perf_counter()
                    loss_sum, samples, preempt, deferred = step_checkpoint.begin(
                        self, window, lambda: settle(self, window, progress), log_now, k + 1,
                        loss_sum, samples, seconds_before + t_checkpoint - t_epoch)
                    if preempt:
                        loss_sum, samples, _ = step_checkpoint.complete(
                            self, window, lambda: settle(self, window, progress), deferred,
                            loss_sum, samples)
                        raise Preempted(f"preempted at step {self.global_step} (epoch "
                                        f"{self.epoch + 1}): checkpoints/last.pt holds it")
                    t_mark += time.perf_counter() - t_checkpoint  # not training time
                elif not last and (clock or preempt):
                    sums = step_checkpoint.take(
                        self, window, lambda: settle(self, window, progress), k + 1, loss_sum,
                        samples, seconds_before + time.perf_counter() - t_epoch)
                    (loss_sum, samples), preempt = sums[:2], preempt or sums[2]
                    t_mark = time.perf_counter()  # checkpoint time is not training time
                    if preempt:
                        raise Preempted(f"preempted at step {self.global_step} (epoch "
                                        f"{self.epoch + 1}): checkpoints/last.pt holds it")
                if stop:
                    break
            if deferred is not None:  # the loader ended after a due step (a user loader)
                loss_sum, samples, _ = step_checkpoint.complete(
                    self, window, lambda: settle(self, window, progress), deferred, loss_sum,
                    samples)
            if len(window):  # steps_per_epoch was off (a user loader): count the rest
                s, n = settle(self, window, progress)
                loss_sum, samples = loss_sum + s, samples + n
                s, n = window.check(self.world)
                loss_sum, samples = loss_sum + s, samples + n
            s, n = settle(self, window, progress)
            loss_sum, samples = loss_sum + s, samples + n
        finally:
            progress.close()
        now = time.perf_counter()
        window.interval_s += now - t_mark
        self.writer.write_queued()
        self.writer.scalars(self.global_step, {"train/epoch_loss": mean(loss_sum, samples)})
        return loss_sum, samples, seconds_before + now - t_epoch

    def fit(self) -> dict[str, Any]:
        """Train until ``trainer.epochs`` or ``trainer.max_steps``; returns the final global
        metrics (``metrics.json``: docs/metrics-and-tensorboard.md). The checkpoints submitted
        to the background writer are on disk when it returns or raises."""
        trainer = self.cfg.trainer
        try:
            last, train_s, run_samples = run_epochs(self)
        except BaseException as stopped:
            # A failing or interrupted run still leaves its last complete checkpoint on disk;
            # the original error is the one that propagates, but for a preemption, whose
            # checkpoint the requeued job needs: it is not preempted without it.
            try:
                self.checkpoint_files.close()
            except Exception as exc:  # e.g. the disk filled up too
                if isinstance(stopped, Preempted):
                    raise exc from stopped
                log.error("checkpoint not written: %s: %s", type(exc).__name__, exc)
            raise
        self.checkpoint_files.close()  # every file on disk before best.pt is read back
        if last is None:  # resumed from a checkpoint of the final epoch: nothing left to train
            last = EpochResult(self.epoch - 1, self.global_step, *self.last_train, 0.0,
                               self.evaluator.validate(self.epoch, self.global_step))
        self.evaluator.report_confusion(self.global_step)
        final = final_metrics(self, last, run_samples, train_s)
        final.update(self.monitor.results())
        if self.datasets.test is not None and len(self.datasets.test):
            final.update(self.evaluator.evaluate_split(
                "test", str(trainer.test_weights or "last"), self.monitor))
        return final
