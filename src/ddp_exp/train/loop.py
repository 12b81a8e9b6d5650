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
   step (:meth:`Trainer._element_step`); DistributedSampler's repeats count zero
   (:meth:`Trainer._padded_step`). With ``trainer.gradient_clip_val``, the global L2 norm of
   the (all-reduced, hence identical on every rank; unscaled under ``16-mixed``) gradients is
   clipped. Then ``optimizer.step()`` (:class:`ddp_exp.train.optimizer.OptimizerStep`) and, with a
   per-step schedule, ``scheduler.step()``: once per optimizer step, never per micro-batch.
   Losses stay on the device: no host sync per step.
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
   writes ``val/loss`` and ``val/accuracy``.
5. The monitored metric (:mod:`ddp_exp.train.monitor`): a new best writes ``checkpoints/best.pt``;
   ``trainer.early_stopping_patience`` epochs without one stop every rank after the same epoch.
   A per-epoch schedule steps; ``checkpoints/last.pt`` is written (:mod:`ddp_exp.train.state`).
   At the end, the test split is evaluated once like validation, with the best or the last
   weights (``trainer.test_weights``).

Uses the loop's helpers, none of which imports this module: :mod:`ddp_exp.train.optimizer`,
:mod:`ddp_exp.metrics.train_loss`, :mod:`ddp_exp.train.evaluation`, :mod:`ddp_exp.train.state`,
:mod:`ddp_exp.train.schedule`, :mod:`ddp_exp.train.monitor`, :mod:`ddp_exp.data.loaders`,
:mod:`ddp_exp.metrics.writer`, :mod:`ddp_exp.metrics.perf`, :mod:`ddp_exp.metrics.dashboard`,
:mod:`ddp_exp.metrics.progress`,
:mod:`ddp_exp.distributed.sync_batchnorm`. :mod:`ddp_exp.rank.worker` runs it on each rank.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_exp.data import Datasets
from ddp_exp.data.batches import call_model, to_device
from ddp_exp.data.loaders import RankData
from ddp_exp.distributed.process_group import World
from ddp_exp.distributed.sync_batchnorm import convert_sync_batchnorm
from ddp_exp.io.files import BackgroundWriter
from ddp_exp.job import pruning
from ddp_exp.metrics import dashboard
from ddp_exp.metrics.lm import LanguageModelReport
from ddp_exp.metrics.perf import StepTimer
from ddp_exp.metrics.progress import EpochResult, Progress, epoch_line, resolve_mode
from ddp_exp.metrics.train_loss import LossWindow
from ddp_exp.metrics.writer import MetricsWriter, mean
from ddp_exp.train import schedule, step_checkpoint
from ddp_exp.train import state as train_state
from ddp_exp.train.evaluation import Evaluator
from ddp_exp.train.monitor import Monitor
from ddp_exp.train.objective import Objective
from ddp_exp.train.optimizer import (
    NO_CONTEXT,
    OptimizerStep,
    autocast,
    build_optimizer,
    grad_scaler,
)
from ddp_exp.train.step_checkpoint import Cadence, Preempted, decided

log = logging.getLogger("ddp_exp.train")


def groups(batches: Iterable, size: int) -> Iterator[list]:
    """Consecutive groups of ``size`` items (the last one may be shorter)."""
    group: list = []
    for item in batches:
        group.append(item)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


class Trainer:
    """The loop of one rank: built from the resolved config, the data and the seeded model.

    Args:
        cfg: the resolved config as plain data (see ``conf/config.yaml``).
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

    def __init__(self, cfg: dict[str, Any], world: World, datasets: Datasets, model: nn.Module,
                 objective: Objective, device: torch.device, writer: MetricsWriter,
                 preempt_requested: Callable[[], bool] | None = None):
        self.cfg, self.world, self.datasets, self.device, self.writer = (
            cfg, world, datasets, device, writer)
        trainer, data_cfg, ddp_cfg = cfg["trainer"], cfg["data"], cfg["ddp"]
        self.precision = trainer["precision"]
        self.accumulate = trainer["accumulate_grad_batches"]
        self.objective = objective
        # The data path (ddp_exp.data.loaders): in-memory batches are cut on the device from one
        # copy of the set; DataLoader workers and lazy datasets serve host batches, pinned on CUDA
        # so that each step's copy is asynchronous (non_blocking=True in _step).
        self.data = RankData(datasets, data_cfg, cfg["seed"], world.rank, world.world_size,
                             device)
        self.loader = self.data.train
        self.move_batches = self.data.move_batches
        # In-memory arrays: one float tensor in, one tensor out (the fast path, no dispatch).
        self.plain_batches = datasets.in_memory
        if ddp_cfg.get("sync_batchnorm"):  # before DDP wraps it (torch's SyncBatchNorm docs)
            model = convert_sync_batchnorm(model, device.type)
        self.model = model.to(device)
        self.ddp = DistributedDataParallel(
            self.model, device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=ddp_cfg["bucket_cap_mb"],
            gradient_as_bucket_view=ddp_cfg["gradient_as_bucket_view"],
            static_graph=ddp_cfg["static_graph"],
            find_unused_parameters=ddp_cfg["find_unused_parameters"])
        # torch.compile wraps the DDP module (DDPOptimizer splits graphs at bucket boundaries).
        self.forward = torch.compile(self.ddp) if trainer["compile"] else self.ddp
        self.optimizer = build_optimizer(cfg, self.ddp.parameters())
        self.scaler = grad_scaler(self.precision, device)  # 16-mixed only: loss scaling
        self.autocast = autocast(device, self.precision)
        # The recipe (issue 15). Each feature that is off costs the hot path nothing: no
        # scheduler object is called, no norm is computed.
        self.run_steps = schedule.total_steps(trainer["epochs"], trainer["max_steps"],
                                              self.steps_per_epoch)
        self.scheduler, interval = schedule.build_scheduler(
            cfg.get("scheduler"), self.optimizer, self.run_steps, self.steps_per_epoch)
        self.step_scheduler = self.scheduler if interval == "step" else None
        self.step_lr = self.optimizer.param_groups[0]["lr"]  # the lr the last step used
        # Unscaling, clipping or the train/grad_norm measure, optimizer.step()
        # (ddp_exp.train.optimizer).
        self.optim_step = OptimizerStep(self.optimizer, self.scaler,
                                        trainer.get("gradient_clip_val"),
                                        [p for p in self.model.parameters() if p.requires_grad])
        self.grad_norm: torch.Tensor | None = None  # the last step's norm, before clipping
        self.log_every = trainer["log_every_n_steps"]
        self.monitor = Monitor(trainer.get("monitor"), trainer.get("monitor_mode"),
                               trainer.get("early_stopping_patience"))
        self.monitor.trial = pruning.link_trial(world.is_main, device)  # hydra/sweeper=ddp_optuna
        torch.manual_seed(cfg["seed"] + world.rank)  # dropout and other randomness per rank
        # Dashboards (ddp_exp.metrics.perf, ddp_exp.metrics.dashboard): the step timer exists only
        # with trainer.perf_metrics, so that without it the step does no extra work at all.
        self.perf = StepTimer(world, device) if trainer["perf_metrics"] else None
        if self.perf is not None:
            self.perf.attach(self.model)  # stamps the end of each backward graph
        # Validation and the test split (ddp_exp.train.evaluation), through the unwrapped model.
        self.evaluator = Evaluator(self.model, self.data, datasets, objective, world, device,
                                   self.precision, writer)
        self.layout_written = False
        # data=tokens: tokens/s, model FLOP/s, MFU and text samples (ddp_exp.metrics.lm).
        self.lm = LanguageModelReport(cfg, datasets, self.model, world.world_size, world.is_main,
                                      writer)
        # Rank 0's checkpoint files, written on a background thread (ddp_exp.io.files): the loop
        # does not wait for the disk.
        self.checkpoint_files = BackgroundWriter()
        self.epoch = 0  # the next epoch to run
        # Step checkpoints (ddp_exp.train.step_checkpoint): the cadence, and the position in
        # the epoch in progress (global samples consumed) with its sums, set while a step
        # checkpoint is taken and by a resume from one.
        self.cadence = Cadence(trainer, world.is_main, preempt_requested)
        self.position, self.epoch_sums = 0, None
        self.preempted = self.checkpoint_due = False  # decided at the epoch's last check
        self.global_step = 0
        self.window = LossWindow(device)  # train/loss intervals, across epochs
        self.last_train: tuple[float | None, int] = (None, 0)  # last epoch's train loss, samples

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch: ``ceil(batches per rank / accumulate_grad_batches)``."""
        return math.ceil(len(self.loader) / self.accumulate)

    def _step(self, group: list, window: LossWindow) -> None:
        """One optimizer step over a group of micro-batches (see the module docstring). The
        hot path: no device sync, and nothing done per step that can be done once."""
        if self.objective.elementwise(group[0][1]):
            return self._element_step(group, window)
        last = len(group) - 1
        # shape[0], not len(): Tensor.__len__ is Python (0.54 us a call against 0.17 us)
        step_samples = (group[0][1].shape[0] if last == 0
                        else sum(yb.shape[0] for _, yb in group))
        perf = self.perf  # None unless trainer.perf_metrics
        plain = self.plain_batches
        self.optimizer.zero_grad(set_to_none=True)
        for i, (xb, yb) in enumerate(group):
            if self.move_batches:  # host batches (DataLoader workers) to the device
                xb = to_device(xb, self.device)
                yb = yb.to(self.device, non_blocking=True)
            with self.ddp.no_sync() if i < last else NO_CONTEXT:
                with self.autocast:
                    out = self.forward(xb) if plain else call_model(self.forward, xb)
                    if type(out) is not torch.Tensor:  # a tuple or a mapping
                        out = self.objective.output(out)
                    loss = self.objective.batch_loss(out, yb)
                scaled = loss if last == 0 else loss * (yb.shape[0] / step_samples)
                (scaled if self.scaler is None else self.scaler.scale(scaled)).backward()
            window.add(loss, yb.shape[0], self.global_step + 1)
        self._finish_step(perf)

    def _element_step(self, group: list, window: LossWindow) -> None:
        """An optimizer step on per-element targets (tokens, pixels): the gradient of the
        world's element mean. The labels say how many elements count before any forward, so the
        world's count N of the step is all-reduced asynchronously while the first micro-batch's
        forward runs; each backward takes the rank's loss *sum* times ``world_size / N`` (DDP
        averages over ranks), so the gradients are those of the global mean before clipping
        and the step. A step whose world counts no element changes no weight (a warning says
        so); every rank still runs its backward, which DDP waits for."""
        import torch.distributed as dist

        last = len(group) - 1
        ws = self.world.world_size
        ignore = self.objective.ignore_index
        targets = [yb.to(self.device, non_blocking=True) if self.move_batches else yb
                   for _, yb in group]
        counts = [int((yb != ignore).sum()) for yb in targets]
        n, work = float(sum(counts)), None
        if ws > 1 and dist.is_initialized():
            world_count = torch.tensor([n], dtype=torch.float64, device=self.device)
            work = dist.all_reduce(world_count, async_op=True)
        self.optimizer.zero_grad(set_to_none=True)
        for i, ((xb, _), yb) in enumerate(zip(group, targets, strict=True)):
            if self.move_batches:
                xb = to_device(xb, self.device)
            with self.ddp.no_sync() if i < last else NO_CONTEXT:
                with self.autocast:
                    out = self.objective.output(call_model(self.forward, xb))
                    total, _ = self.objective.element_terms(out, yb)
                if work is not None:  # the count has travelled during the forward
                    work.wait()
                    n, work = float(world_count), None
                scaled = total * (ws / n if n else 0.0)
                (scaled if self.scaler is None else self.scaler.scale(scaled)).backward()
            window.add(total, counts[i], self.global_step + 1, summed=True)
        if n == 0:
            log.warning("step %d: no counted element on any rank (every target is "
                        "data.ignore_index): the step is skipped", self.global_step + 1)
            self.optimizer.zero_grad(set_to_none=True)
            self.global_step += 1
            return
        self._finish_step(self.perf)

    def _padded_step(self, group: list, window: LossWindow) -> None:
        """The epoch's last step when DistributedSampler repeated samples to fill the world
        (a training set ``world_size`` does not divide): each repeated sample (the last of its
        rank) counts zero, so the step's gradient is the mean over the world's real samples
        ``N``, known on every rank without communication (every rank's step holds as many
        samples; N is their world total minus the repeats). Per-element targets: the repeat's
        labels are ignored already (:meth:`_duplicate_ignored`)."""
        if self.objective.elementwise(group[0][1]):
            return self._element_step(group, window)
        ws, last = self.world.world_size, len(group) - 1
        step_samples = sum(yb.shape[0] for _, yb in group)
        world_n = ws * step_samples - self.data.padded
        self.optimizer.zero_grad(set_to_none=True)
        for i, (xb, yb) in enumerate(group):
            if self.move_batches:
                xb, yb = to_device(xb, self.device), yb.to(self.device, non_blocking=True)
            with self.ddp.no_sync() if i < last else NO_CONTEXT:
                with self.autocast:
                    out = self.objective.output(call_model(self.forward, xb))
                    values = self.objective.per_sample_loss(out, yb)
                    if i == last and self.data.duplicate_last:
                        values = values[:-1]
                    total = values.sum()
                scaled = total * (ws / world_n)
                (scaled if self.scaler is None else self.scaler.scale(scaled)).backward()
            window.add(total, values.shape[0], self.global_step + 1, summed=True)
        self._finish_step(self.perf)

    def _finish_step(self, perf) -> None:
        """Clipping or the logging step's norm, ``optimizer.step()``, the step's scheduler."""
        if perf is not None:
            perf.backward_done()
        # Clipped, or measured at logging steps only (train/grad_norm); then optimizer.step().
        self.grad_norm = self.optim_step.step((self.global_step + 1) % self.log_every == 0)
        if perf is not None:
            perf.step_done()
        self.global_step += 1
        if self.step_scheduler is not None:
            self.step_lr = self.optimizer.param_groups[0]["lr"]
            self.step_scheduler.step()

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
        trainer = self.cfg["trainer"]
        max_steps, log_every = trainer["max_steps"], trainer["log_every_n_steps"]
        self.loader.set_epoch(self.epoch)
        first, (loss_sum, samples, seconds_before) = step_checkpoint.enter_position(self)
        self.ddp.train()
        window = self.window
        progress = Progress(resolve_mode(trainer["progress"], self.world.is_main), self.epoch,
                            trainer["epochs"], self.steps_per_epoch)
        progress.done = first  # a resumed epoch's steps done
        if progress.bar is not None:
            progress.bar.update(first)
        t_epoch = t_mark = time.perf_counter()
        try:
            batches = self.loader if self.perf is None else self.perf.timed(self.loader)
            if self.data.duplicate_last:
                batches = self._duplicate_ignored(batches, first * self.accumulate)
            # A training set the world does not divide: the epoch's last step holds
            # DistributedSampler's duplicates, which count zero (:meth:`_padded_step`).
            padded_step = self.steps_per_epoch - 1 if self.data.padded else -1
            for k, group in enumerate(groups(batches, self.accumulate), start=first):
                if k == padded_step:
                    self._padded_step(group, window)
                else:
                    self._step(group, window)
                progress.step()
                stop = max_steps is not None and self.global_step >= max_steps
                log_now = self.global_step % log_every == 0
                # A logging step or the epoch's last: one all-reduce of (loss sum, count).
                last = stop or progress.done == progress.steps
                clock = preempt = False
                if log_now or last:
                    # The logging step before: its all-reduce has run during the steps since.
                    s, n = self._settle(window, progress)
                    loss_sum, samples = loss_sum + s, samples + n
                    clock, preempt = decided(window.flags)
                    now = time.perf_counter()
                    window.interval_s += now - t_mark
                    t_mark = now
                    # The perf timer's table rides in the same all-reduce, and the flags.
                    timing = self.perf.row() if log_now and self.perf is not None else None
                    window.start(self.world, timing, (self.global_step, self.grad_norm,
                                                      self._lr_used()) if log_now else None,
                                 self.cadence.flags())
                    if last:  # the epoch's sums are needed now
                        s, n = self._settle(window, progress)
                        loss_sum, samples = loss_sum + s, samples + n
                        end_clock, end_preempt = decided(window.flags)
                        self.preempted = preempt or end_preempt
                        self.checkpoint_due = (clock or end_clock
                                               or self.cadence.step_due(self.global_step))
                if not last and (clock or preempt or self.cadence.step_due(self.global_step)):
                    sums = step_checkpoint.take(
                        self, window, lambda: self._settle(window, progress), k + 1, loss_sum,
                        samples, seconds_before + time.perf_counter() - t_epoch)
                    (loss_sum, samples), preempt = sums[:2], preempt or sums[2]
                    t_mark = time.perf_counter()  # checkpoint time is not training time
                    if preempt:
                        raise Preempted(f"preempted at step {self.global_step} (epoch "
                                        f"{self.epoch + 1}): checkpoints/last.pt holds it")
                if stop:
                    break
            if len(window):  # steps_per_epoch was off (a user loader): count the rest
                s, n = self._settle(window, progress)
                loss_sum, samples = loss_sum + s, samples + n
                s, n = window.check(self.world)
                loss_sum, samples = loss_sum + s, samples + n
            s, n = self._settle(window, progress)
            loss_sum, samples = loss_sum + s, samples + n
        finally:
            progress.close()
        now = time.perf_counter()
        window.interval_s += now - t_mark
        self.writer.write_queued()
        self.writer.scalars(self.global_step, {"train/epoch_loss": mean(loss_sum, samples)})
        return loss_sum, samples, seconds_before + now - t_epoch

    def _duplicate_ignored(self, batches: Iterable, first: int = 0) -> Iterator:
        """The epoch's batches (from its ``first``-th), the last one's last sample
        (DistributedSampler's duplicate) made to count nowhere for per-element targets: its
        labels become ``ignore_index``."""
        last = len(self.loader) - 1
        for i, (xb, yb) in enumerate(batches, start=first):
            if i == last and self.objective.elementwise(yb):
                yb = yb.clone()
                yb[-1] = self.objective.ignore_index
            yield xb, yb

    def _settle(self, window: LossWindow, progress: Progress) -> tuple[float, int]:
        """Finish the window's started check, if any; a logging step's check writes its
        interval (:meth:`_log`). Returns the check's world (loss sum, samples), (0, 0) if
        none."""
        done = window.finish(self.world)
        if done is None:
            window.flags = []  # no check finished here: no decision either
            return 0.0, 0
        loss_sum, samples, timing, context = done
        if context is not None:
            self._log(window, progress, timing, *context)
        return loss_sum, samples

    def _log(self, window: LossWindow, progress: Progress, timing: list[float] | None,
             step: int, grad_norm: torch.Tensor | None, lr: float) -> None:
        """Write the interval's scalars at x = ``step``, the logging step (rank 0), and start
        the next interval; ``timing``: the world's perf table of the interval
        (``trainer.perf_metrics``); ``grad_norm`` and ``lr``: the logging step's."""
        loss_sum, samples, seconds = window.take_interval()
        rate = mean(samples, seconds)
        loss = mean(loss_sum, samples)
        scalars = {
            "train/loss": loss,
            "train/lr": lr,
            "train/samples_per_sec": rate,
            "train/grad_norm": grad_norm,
            **self.lm.train_scalars(rate),
        }
        # One TensorBoard event, encoded after the epoch's loop (MetricsWriter.queue_scalars);
        # every rank's step timing, reduced with the losses, is summarised then too.
        perf = self.perf if timing is not None else None
        self.writer.queue_scalars(step, scalars,
                                  None if perf is None else lambda: perf.take(timing),
                                  () if perf is None else perf.tags)
        if not self.layout_written:  # the Custom Scalars layout, once per run
            tags = self.writer.tags | set(self.evaluator.tags)
            self.writer.custom_scalars(dashboard.layout(tags))
            self.layout_written = True
        progress.interval(loss, rate)

    def _lr_used(self) -> float:
        """The learning rate of the last optimizer step (a per-step scheduler has already set
        the next one)."""
        if self.step_scheduler is not None:
            return self.step_lr
        return self.optimizer.param_groups[0]["lr"]

    def fit(self) -> dict[str, Any]:
        """Train until ``trainer.epochs`` or ``trainer.max_steps``; returns the final global
        metrics (``metrics.json``: docs/metrics-and-tensorboard.md). The checkpoints submitted
        to the background writer are on disk when it returns or raises."""
        trainer = self.cfg["trainer"]
        try:
            last, train_s, run_samples = self._epochs()
        except BaseException:
            # A failing or interrupted run still leaves its last complete checkpoint on disk;
            # the original error is the one that propagates.
            try:
                self.checkpoint_files.close()
            except Exception as exc:  # e.g. the disk filled up too
                log.error("checkpoint not written: %s: %s", type(exc).__name__, exc)
            raise
        self.checkpoint_files.close()  # every file on disk before best.pt is read back
        if last is None:  # resumed from a checkpoint of the final epoch: nothing left to train
            last = EpochResult(self.epoch - 1, self.global_step, *self.last_train, 0.0,
                               self.evaluator.validate(self.epoch, self.global_step))
        self.evaluator.report_confusion(self.global_step)
        final = self._final(last, run_samples, train_s)
        final.update(self.monitor.results())
        if self.datasets.test is not None and len(self.datasets.test):
            final.update(self.evaluator.evaluate_split(
                "test", trainer["test_weights"] or "last", self.monitor))
        return final

    def _epochs(self) -> tuple[EpochResult | None, float, int]:
        """The epochs of :meth:`fit`: returns the last epoch's result (None if none ran), the
        seconds in the training loops and the samples trained."""
        trainer = self.cfg["trainer"]
        max_steps = trainer["max_steps"]
        last: EpochResult | None = None
        train_s, run_samples = 0.0, 0
        while self.epoch < trainer["epochs"] and not self.monitor.stopped_early:
            loss_sum, samples, seconds = self.train_epoch()
            train_s, run_samples = train_s + seconds, run_samples + samples
            last = EpochResult(self.epoch, self.global_step, mean(loss_sum, samples), samples,
                               seconds, self.evaluator.validate(self.epoch, self.global_step))
            log.info(epoch_line(last, trainer["epochs"]))
            self.lm.sample(self.epoch, self.global_step)  # rank 0, its own generator
            self.last_train = (last.train_loss, last.train_samples)  # kept in checkpoints
            if self.perf is not None:  # the straggler line (trainer.perf_metrics)
                self.perf.end_epoch(self.epoch)
            dashboard.write_histograms(self.writer, self.model, self.epoch, self.global_step,
                                       trainer["log_histograms_every_n_epochs"])
            improved = self.monitor.update(last.val, self.epoch)  # the reduced value: all agree
            if self.scheduler is not None and self.step_scheduler is None:  # per epoch
                schedule.step_epoch(self.scheduler, last.val, self.monitor.metric)
            self.epoch += 1
            if self.monitor.stopped_early:
                log.info(self.monitor.stop_line(trainer["epochs"]))
            # A partial epoch (trainer.max_steps): resuming it could not be exact, so no
            # last.pt; a new best is still kept.
            partial = max_steps is not None and self.global_step >= max_steps
            train_state.save_checkpoint(self, best=improved, complete=not partial,
                                        force_last=self.preempted or self.checkpoint_due)
            self.cadence.written()
            if self.preempted:
                raise Preempted(f"preempted at the end of epoch {self.epoch} (step "
                                f"{self.global_step}): checkpoints/last.pt holds it")
            if partial:
                break
            self.writer.flush()  # the epoch's events on disk before the next epoch's loop
            if self.monitor.stopped_early:
                break
        return last, train_s, run_samples

    def _final(self, last: EpochResult, run_samples: int, train_s: float) -> dict[str, Any]:
        """The final global metrics of the last epoch (docs/metrics-and-tensorboard.md)."""
        return {
            **last.val,
            "train/loss": last.train_loss,
            "train/num_samples": last.train_samples,
            "train/samples_per_sec": mean(run_samples, train_s),
            **self.lm.train_scalars(mean(run_samples, train_s)),
            "time/train_s": train_s,
            "epoch": last.epoch + 1,
            "global_step": self.global_step,
            "steps_per_epoch": self.steps_per_epoch,
        }
