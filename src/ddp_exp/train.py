"""The per-rank training loop: DDP, the optimizer step, evaluation and the metrics of one world.

One epoch, on every rank (nanoGPT / torchtitan idiom, top to bottom):

1. ``sampler.set_epoch(epoch)``: a new permutation per epoch, the same on every rank, strided
   into shards (``DistributedSampler``).
2. Per optimizer step: ``zero_grad`` (autograd accumulates into ``.grad``), then for each of the
   ``trainer.accumulate_grad_batches`` micro-batches a forward through the DDP wrapper and
   ``backward()``; DDP all-reduces gradient buckets while the last micro-batch's backward runs,
   and the earlier ones run forward *and* backward inside ``no_sync()`` (a ``no_sync`` around
   backward alone still syncs: DDP docstring). Each micro-batch loss is weighted by its share of
   the step's samples, so ``accumulate_grad_batches=2, batch_size=b`` steps exactly like
   ``batch_size=2b``. With ``trainer.gradient_clip_val``, the global L2 norm of the (all-reduced,
   hence identical on every rank; unscaled under ``16-mixed``) gradients is clipped. Then
   ``optimizer.step()`` and, with a per-step schedule, ``scheduler.step()``: once per optimizer
   step, never per micro-batch. Losses stay on the device: no host sync per step.
3. Every ``trainer.log_every_n_steps`` global steps: one all-reduce of (loss sum, sample count);
   rank 0 writes ``train/loss`` (mean over the interval's samples), ``train/lr`` (the rate the
   step used), ``train/samples_per_sec`` and ``train/grad_norm`` (the global norm of the step's
   all-reduced gradients, before clipping) at x = global step. An interval may span an epoch
   boundary, so the points are evenly spaced; at the end of each epoch one more all-reduce gives
   the epoch's mean, ``train/epoch_loss`` (x = the epoch's last step). A logging step's
   all-reduce is started without waiting and finished at the next check (the next logging step
   or the epoch's end), so the host never waits for it between steps; its scalars go into one
   TensorBoard event, encoded after the epoch's loop (``MetricsWriter.queue_scalars``). A
   non-finite sum stops every rank at once, at that next check, naming the first bad step.
4. Evaluation of the whole validation set through the unwrapped model (no DDP collectives in the
   forward, so uneven shards cannot hang), one all-reduce of (loss sum, correct, count), and
   rank 0 writes ``val/loss`` and ``val/accuracy``.
5. The monitored metric (:mod:`ddp_exp.monitor`): a new best writes ``checkpoints/best.pt``;
   ``trainer.early_stopping_patience`` epochs without one stop every rank after the same epoch.
   A per-epoch schedule steps. At the end, the test split is evaluated once like validation,
   with the best or the last weights (``trainer.test_weights``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_exp import checkpoint, confusion, dashboard, schedule
from ddp_exp.config import OPTIM_OWN_KEYS, ConfigError, effective_lr, instantiate_node
from ddp_exp.data import Datasets
from ddp_exp.data.loaders import RankData
from ddp_exp.distributed import World, broadcast_from_main
from ddp_exp.metrics import Accumulator, MetricsWriter, mean
from ddp_exp.monitor import Monitor
from ddp_exp.objective import Objective
from ddp_exp.perf import StepTimer
from ddp_exp.progress import Progress, resolve_mode
from ddp_exp.sync_batchnorm import convert_sync_batchnorm

log = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
NO_CONTEXT = contextlib.nullcontext()  # reusable: entering it does nothing


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite on some rank; every rank raises it together."""


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``bf16-mixed`` / ``16-mixed``, a no-op for ``32-true``."""
    dtype = AUTOCAST_DTYPES[precision]
    if dtype is None:
        return NO_CONTEXT
    return torch.autocast(device_type=device.type, dtype=dtype)


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


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable, objective: Objective, world: World,
             device: torch.device, precision: str = "32-true",
             num_classes: int = 0) -> dict[str, Any]:
    """Loss and metrics of ``model`` on the whole validation set, exact for any world size.

    Each rank evaluates its shard, samples ``rank, rank + world_size, ...`` (no padding; a shard
    may be empty), sums per-sample values in float64, then one all-reduce sums (loss, metrics,
    count, and with ``num_classes`` the confusion counts). Every rank must call it.

    Args:
        batches: this rank's shard as ``(x [B, ...], y [B] or [B, k])`` batches, on ``device``
            or the host (:meth:`ddp_exp.loaders.RankData.val_batches`).
        num_classes: ``C`` > 0 to count the confusion matrix in the same pass.

    Returns:
        ``val/loss`` (mean per-sample loss), ``val/<metric>`` for each metric (e.g.
        ``val/accuracy``; None when it does not apply) and ``val/num_samples``; means are None
        for an empty set. With ``num_classes``, also ``confusion``: int64 ``[C, C]`` on the CPU
        (row = true class, column = predicted class).
    """
    was_training = model.training
    model.eval()
    names = tuple(objective.metrics)
    sums = Accumulator(("loss", *names, "num_samples"), device)
    pairs = (torch.zeros(num_classes * num_classes, dtype=torch.float64, device=device)
             if num_classes else None)
    for xb, yb in batches:
        xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
        with autocast(device, precision):
            out = model(xb)
        sums.add("loss", objective.per_sample_loss(out, yb).double().sum())
        for name in names:
            sums.add(name, objective.metrics[name](out, yb).double().sum())
        sums.add("num_samples", len(xb))
        if pairs is not None:
            pairs += confusion.pair_counts(out, yb, num_classes)
    if pairs is None:
        totals = sums.reduce()
    else:
        totals, pairs = sums.reduce(extra=pairs)
    model.train(was_training)
    count = int(totals["num_samples"])
    result: dict[str, Any] = {"val/loss": mean(totals["loss"], count)}
    if "accuracy" not in names:
        result["val/accuracy"] = None  # regression: reported as null
    result.update({f"val/{name}": mean(totals[name], count) for name in names})
    result["val/num_samples"] = count
    if pairs is not None:
        result["confusion"] = pairs.round().long().view(num_classes, num_classes).cpu()
    return result


def grad_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
    """The global L2 norm of the parameters' gradients (a scalar tensor on their device, no
    host sync), as ``torch.nn.utils.clip_grad_norm_`` computes it; None if none has a gradient.
    Called after DDP's all-reduce, it is the same on every rank."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return None
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def build_optimizer(cfg: dict[str, Any], params: Iterable[torch.nn.Parameter]
                    ) -> torch.optim.Optimizer:
    """``cfg.optim``'s ``_target_`` over ``params``, at the effective (scaled) learning rate.

    Raises:
        ConfigError: the optimizer cannot be imported or rejects its arguments.
    """
    args = {k: v for k, v in cfg["optim"].items() if k not in OPTIM_OWN_KEYS}
    args["lr"] = effective_lr(cfg)
    factory = instantiate_node(args, "optim")
    try:
        return factory(params)
    except Exception as exc:  # an unknown keyword, a value out of range, a list too short
        options = {k: v for k, v in args.items() if not k.startswith("_") and k != "lr"}
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"optim ({args['_target_']}) rejects its options {options}: "
                          f"{first}") from None


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
    every rank raises :class:`NonFiniteLossError`.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.losses: list[torch.Tensor] = []
        self.sizes: list[int] = []
        self.steps: list[int] = []
        # The interval so far, over the whole world (host floats: the checkpoint carries them,
        # so that a resumed run logs the interval it was in like an uninterrupted one).
        self.interval_sum, self.interval_count, self.interval_s = 0.0, 0, 0.0
        self.pending: tuple | None = None  # a check started and not finished (see start)

    def add(self, loss: torch.Tensor, size: int, step: int) -> None:
        """One micro-batch's mean loss (a device scalar), its sample count and global step."""
        self.losses.append(loss.detach())
        self.sizes.append(size)
        self.steps.append(step)

    def __len__(self) -> int:
        return len(self.losses)

    def start(self, world: World, extra: torch.Tensor | None = None,
              context: Any = None) -> None:
        """Every rank calls it at the same step: start one all-reduce of the pending steps'
        (loss sum, sample count) without waiting for it (``async_op``), and empty the pending
        list; :meth:`finish` waits for it. A check started before must be finished first.

        ``extra`` (float64 on the device, any shape) is summed over the world in the same
        collective (the perf timer's table at logging steps); ``context`` is handed back by
        :meth:`finish` as it was (what the logging step wrote down).
        """
        import torch.distributed as dist

        assert self.pending is None, "finish() the check started before"
        if self.losses:
            losses = torch.stack(self.losses).double()
            sizes = torch.tensor(self.sizes, dtype=torch.float64, device=self.device)
            totals = torch.stack([(losses * sizes).sum(), sizes.sum()])
        else:  # a rank must still join the collective
            losses = torch.zeros(0, dtype=torch.float64, device=self.device)
            totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        if extra is not None:
            totals = torch.cat([totals, extra.reshape(-1)])
        work = (dist.all_reduce(totals, async_op=True)
                if dist.is_initialized() and world.world_size > 1 else None)
        self.pending = (work, totals, losses, self.steps, extra is not None, context)
        self.losses, self.sizes, self.steps = [], [], []

    def finish(self, world: World) -> tuple[float, int, torch.Tensor | None, Any] | None:
        """Wait for the check :meth:`start` began (None if there is none) and add its sums to
        the interval; returns the world's (loss sum, sample count), the reduced ``extra`` as a
        flat vector (None without it) and the ``context``.

        Raises:
            NonFiniteLossError: the sum is NaN or infinite (on every rank).
        """
        if self.pending is None:
            return None
        work, totals, losses, steps, has_extra, context = self.pending
        self.pending = None
        if work is not None:
            work.wait()
        loss_sum, count = totals[:2].tolist()
        if not math.isfinite(loss_sum):
            self._raise_nonfinite(losses, steps, world)
        self.interval_sum += loss_sum
        self.interval_count += int(count)
        return loss_sum, int(count), totals[2:] if has_extra else None, context

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

    def _raise_nonfinite(self, losses: torch.Tensor, steps: list[int], world: World) -> None:
        import torch.distributed as dist

        bad = (~torch.isfinite(losses)).nonzero()
        # Encode (step, rank) in one number so one MIN all-reduce finds the earliest.
        mine = steps[int(bad[0])] * world.world_size + world.rank if len(bad) else math.inf
        code = torch.tensor([float(mine)], dtype=torch.float64, device=self.device)
        if dist.is_initialized() and world.world_size > 1:
            dist.all_reduce(code, op=dist.ReduceOp.MIN)
        step, rank = divmod(int(code.item()), world.world_size)
        raise NonFiniteLossError(f"non-finite training loss at step {step} (first seen on rank "
                                 f"{rank}); all {world.world_size} rank(s) stopped. Lower optim.lr"
                                 " or check the data for NaN/inf")


@dataclass
class EpochResult:
    """What one epoch measured, reduced over the world."""

    epoch: int
    global_step: int
    train_loss: float | None
    train_samples: int
    train_s: float
    val: dict[str, Any]


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
    """

    def __init__(self, cfg: dict[str, Any], world: World, datasets: Datasets, model: nn.Module,
                 objective: Objective, device: torch.device, writer: MetricsWriter):
        self.cfg, self.world, self.datasets, self.device, self.writer = (
            cfg, world, datasets, device, writer)
        trainer, data_cfg, ddp_cfg = cfg["trainer"], cfg["data"], cfg["ddp"]
        self.precision = trainer["precision"]
        self.accumulate = trainer["accumulate_grad_batches"]
        self.objective = objective
        # The data path (ddp_exp.loaders): in-memory batches are cut on the device from one copy
        # of the set; DataLoader workers and lazy datasets serve host batches, pinned on CUDA
        # so that each step's copy is asynchronous (non_blocking=True in _step).
        self.data = RankData(datasets, data_cfg, cfg["seed"], world.rank, world.world_size,
                             device)
        self.sampler, self.loader = self.data.sampler, self.data.train
        self.move_batches = self.data.move_batches
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
        # fp16 needs loss scaling; bf16 and fp32 do not (and skip the scaler's calls per step).
        self.scaler = (torch.amp.GradScaler(device.type) if self.precision == "16-mixed"
                       else None)
        self.autocast = autocast(device, self.precision)
        # The recipe (issue 15). Each feature that is off costs the hot path nothing: no
        # scheduler object is called, no norm is computed.
        self.run_steps = schedule.total_steps(trainer["epochs"], trainer["max_steps"],
                                              self.steps_per_epoch)
        self.scheduler, interval = schedule.build_scheduler(
            cfg.get("scheduler"), self.optimizer, self.run_steps, self.steps_per_epoch)
        self.step_scheduler = self.scheduler if interval == "step" else None
        self.step_lr = self.optimizer.param_groups[0]["lr"]  # the lr the last step used
        self.clip = trainer.get("gradient_clip_val")
        self.clip_params = ([p for p in self.model.parameters() if p.requires_grad]
                            if self.clip is not None else [])
        self.grad_norm: torch.Tensor | None = None  # the last step's norm, before clipping
        self.log_every = trainer["log_every_n_steps"]
        self.norm_params = [p for p in self.model.parameters() if p.requires_grad]
        self.monitor = Monitor(trainer.get("monitor"), trainer.get("monitor_mode"),
                               trainer.get("early_stopping_patience"))
        torch.manual_seed(cfg["seed"] + world.rank)  # dropout and other randomness per rank
        # Dashboards (ddp_exp.perf, ddp_exp.dashboard): the step timer exists only
        # with trainer.perf_metrics, so that without it the step does no extra work at all.
        self.perf = StepTimer(world, device) if trainer["perf_metrics"] else None
        if self.perf is not None:
            self.perf.attach(self.model)  # stamps the end of each backward graph
        self.val_tags = (("val/loss", *(f"val/{m}" for m in objective.metrics))
                         if len(datasets.val) else ())
        self.layout_written = False
        self.last_confusion: torch.Tensor | None = None  # of the last validation
        self.epoch = 0  # the next epoch to run
        self.global_step = 0
        self.window = LossWindow(device)  # train/loss intervals, across epochs

    # ------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly; a collective (gathers every rank's RNG)."""
        import torch.distributed as dist

        rng = {"torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda"
               else None}
        ranks_rng: list[Any] = [None] * self.world.world_size
        if dist.is_initialized() and self.world.world_size > 1:
            dist.all_gather_object(ranks_rng, rng)
        else:
            ranks_rng = [rng]
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "monitor": self.monitor.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "epoch": self.epoch - 1,  # the last completed epoch, 0-based
            "global_step": self.global_step,
            "world_size": self.world.world_size,
            # The open train/loss interval (world sums): a resumed run logs it like one never
            # interrupted.
            "train_interval": [self.window.interval_sum, self.window.interval_count,
                               self.window.interval_s],
            "rng": ranks_rng,
            "config": self.cfg,
        }

    def load_state_dict(self, state: dict[str, Any], source: str) -> None:
        """Continue from a checkpoint written by :meth:`state_dict` (same model and optimizer).

        Raises:
            ConfigError: the checkpoint's model or optimizer does not fit this run.
        """
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise ConfigError(f"trainer.resume={source!r}: the checkpoint does not fit this "
                              f"model/optimizer ({str(exc).splitlines()[0][:200]})") from None
        if state.get("scaler") and self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        if state.get("scheduler") and self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.monitor.load_state_dict(state.get("monitor"))
        self.epoch = state["epoch"] + 1
        self.global_step = state["global_step"]
        if state.get("train_interval"):
            total, count, seconds = state["train_interval"]
            self.window.interval_sum, self.window.interval_count = float(total), int(count)
            self.window.interval_s = float(seconds)
        ranks_rng = state.get("rng") or []
        if len(ranks_rng) == self.world.world_size:  # same world: continue every rank's stream
            mine = ranks_rng[self.world.rank]
            # RNG states are CPU byte tensors, whatever map_location moved them to.
            torch.set_rng_state(mine["torch"].cpu())
            if mine.get("cuda") is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state(mine["cuda"].cpu(), self.device)
        log.info("resumed from %s: epoch %d done, step %d", source, state["epoch"] + 1,
                 self.global_step)

    def save_checkpoint(self) -> None:
        """Every rank calls it after an epoch; rank 0 writes (see :mod:`ddp_exp.checkpoint`)."""
        trainer = self.cfg["trainer"]
        every = trainer["checkpoint_every_n_epochs"]
        keep_epoch_file = every > 0 and self.epoch % every == 0
        if not (trainer["save_last"] or keep_epoch_file):
            return
        state = self.state_dict()
        if self.world.is_main:
            checkpoint.save(self.writer.job_dir, state, keep_epoch_file,
                            trainer["keep_checkpoints"])

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch: ``ceil(batches per rank / accumulate_grad_batches)``."""
        return math.ceil(len(self.loader) / self.accumulate)

    def _step(self, group: list, window: LossWindow) -> None:
        """One optimizer step over a group of micro-batches (see the module docstring). The
        hot path: no device sync, and nothing done per step that can be done once."""
        last = len(group) - 1
        step_samples = len(group[0][0]) if last == 0 else sum(len(xb) for xb, _ in group)
        perf = self.perf  # None unless trainer.perf_metrics
        self.optimizer.zero_grad(set_to_none=True)
        for i, (xb, yb) in enumerate(group):
            if self.move_batches:  # host batches (DataLoader workers) to the device
                xb = xb.to(self.device, non_blocking=True)
                yb = yb.to(self.device, non_blocking=True)
            with self.ddp.no_sync() if i < last else NO_CONTEXT:
                with self.autocast:
                    loss = self.objective.batch_loss(self.forward(xb), yb)
                scaled = loss if last == 0 else loss * (len(xb) / step_samples)
                (scaled if self.scaler is None else self.scaler.scale(scaled)).backward()
            window.add(loss, len(xb), self.global_step + 1)
        if perf is not None:
            perf.backward_done()
        if self.clip is not None:  # after DDP's all-reduce: the same norm on every rank
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            self.grad_norm = torch.nn.utils.clip_grad_norm_(self.clip_params, self.clip)
        elif (self.global_step + 1) % self.log_every == 0:  # train/grad_norm, logging steps only
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            self.grad_norm = grad_norm(self.norm_params)
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
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
        time excluded from its samples/s)."""
        trainer = self.cfg["trainer"]
        max_steps, log_every = trainer["max_steps"], trainer["log_every_n_steps"]
        self.loader.set_epoch(self.epoch)
        self.ddp.train()
        window = self.window
        progress = Progress(resolve_mode(trainer["progress"], self.world.is_main), self.epoch,
                            trainer["epochs"], self.steps_per_epoch)
        loss_sum, samples = 0.0, 0
        t_epoch = t_mark = time.perf_counter()
        try:
            batches = self.loader if self.perf is None else self.perf.timed(self.loader)
            for group in groups(batches, self.accumulate):
                self._step(group, window)
                progress.step()
                stop = max_steps is not None and self.global_step >= max_steps
                log_now = self.global_step % log_every == 0
                # A logging step or the epoch's last: one all-reduce of (loss sum, count).
                last = stop or progress.done == progress.steps
                if log_now or last:
                    # The logging step before: its all-reduce has run during the steps since.
                    s, n = self._settle(window, progress)
                    loss_sum, samples = loss_sum + s, samples + n
                    now = time.perf_counter()
                    window.interval_s += now - t_mark
                    t_mark = now
                    # The perf timer's table rides in the same all-reduce.
                    timing = self.perf.row() if log_now and self.perf is not None else None
                    window.start(self.world, timing, (self.global_step, self.grad_norm,
                                                      self._lr_used()) if log_now else None)
                    if last:  # the epoch's sums are needed now
                        s, n = self._settle(window, progress)
                        loss_sum, samples = loss_sum + s, samples + n
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
        return loss_sum, samples, now - t_epoch

    def _settle(self, window: LossWindow, progress: Progress) -> tuple[float, int]:
        """Finish the window's started check, if any; a logging step's check writes its
        interval (:meth:`_log`). Returns the check's world (loss sum, samples), (0, 0) if
        none."""
        done = window.finish(self.world)
        if done is None:
            return 0.0, 0
        loss_sum, samples, timing, context = done
        if context is not None:
            self._log(window, progress, timing, *context)
        return loss_sum, samples

    def _log(self, window: LossWindow, progress: Progress, timing: torch.Tensor | None,
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
        }
        if timing is not None:  # every rank's step timing, reduced with the losses
            scalars.update(self.perf.take(timing))
        # One TensorBoard event, encoded after the epoch's loop (MetricsWriter.queue_scalars).
        self.writer.queue_scalars(step, scalars)
        if not self.layout_written:  # the Custom Scalars layout, once per run
            self.writer.custom_scalars(dashboard.layout(self.writer.tags | set(self.val_tags)))
            self.layout_written = True
        progress.interval(loss, rate)

    def _epoch_dashboards(self) -> None:
        """End of an epoch: the straggler line (``trainer.perf_metrics``) and, every
        ``trainer.log_histograms_every_n_epochs``, parameter and gradient histograms."""
        if self.perf is not None:
            self.perf.end_epoch(self.epoch)
        every = self.cfg["trainer"]["log_histograms_every_n_epochs"]
        if every and (self.epoch + 1) % every == 0 and self.writer.enabled:
            self.writer.histograms(self.global_step, dashboard.histograms(self.model))

    def report_confusion(self) -> None:
        """Classification: the last validation's confusion matrix (of the final weights, counted
        and reduced exactly in that pass); rank 0 writes ``confusion_matrix.csv`` and the
        ``val/confusion_matrix`` picture (:mod:`ddp_exp.confusion`)."""
        matrix = self.last_confusion
        if matrix is None:
            return
        num_classes = self.objective.num_classes
        if self.writer.enabled:
            names = confusion.class_names(self.datasets.val, num_classes)
            self.writer.write_text("confusion_matrix.csv", confusion.to_csv(matrix, names))
            self.writer.image("val/confusion_matrix", confusion.image(matrix, names),
                               self.global_step)

    def _lr_used(self) -> float:
        """The learning rate of the last optimizer step (a per-step scheduler has already set
        the next one)."""
        if self.step_scheduler is not None:
            return self.step_lr
        return self.optimizer.param_groups[0]["lr"]

    def validate(self) -> dict[str, Any]:
        if not len(self.datasets.val):
            return {"val/loss": None, "val/accuracy": None, "val/num_samples": 0}
        val = evaluate(self.model, self.data.val_batches(self.epoch), self.objective, self.world,
                       self.device, self.precision, self.objective.num_classes)
        self.last_confusion = val.pop("confusion", None)
        self.writer.scalars(self.global_step,
                            {k: v for k, v in val.items() if k != "val/num_samples"})
        return val

    def fit(self) -> dict[str, Any]:
        """Train until ``trainer.epochs`` or ``trainer.max_steps``; returns the final global
        metrics (see ``metrics.json`` in the README)."""
        trainer = self.cfg["trainer"]
        max_steps = trainer["max_steps"]
        last: EpochResult | None = None
        train_s, run_samples = 0.0, 0
        while self.epoch < trainer["epochs"]:
            loss_sum, samples, seconds = self.train_epoch()
            train_s, run_samples = train_s + seconds, run_samples + samples
            last = EpochResult(self.epoch, self.global_step, mean(loss_sum, samples), samples,
                               seconds, self.validate())
            log.info(_epoch_line(last, trainer["epochs"]))
            self._epoch_dashboards()
            improved = self.monitor.update(last.val, self.epoch)  # the reduced value: all agree
            self._epoch_schedule(last.val)
            self.epoch += 1
            if improved:
                self.save_best()
            if self.monitor.stopped_early:
                log.info(self.monitor.stop_line(trainer["epochs"]))
            if max_steps is not None and self.global_step >= max_steps:
                break  # a partial epoch: resuming it could not be exact, so no checkpoint
            self.save_checkpoint()
            if self.monitor.stopped_early:
                break
        if last is None:  # resumed from a checkpoint of the final epoch: nothing left to train
            last = EpochResult(self.epoch - 1, self.global_step, None, 0, 0.0, self.validate())
        self.report_confusion()
        final = self._final(last, run_samples, train_s)
        final.update(self.monitor.results())
        if self.datasets.test is not None and len(self.datasets.test):
            final.update(self.evaluate_split("test", trainer["test_weights"] or "last"))
        return final

    def _epoch_schedule(self, val: dict[str, Any]) -> None:
        """Step a per-epoch scheduler (``ReduceLROnPlateau`` with the monitored value)."""
        if self.scheduler is None or self.step_scheduler is not None:
            return
        if schedule.is_plateau(self.scheduler):
            value = val.get(self.monitor.metric)
            if value is not None:
                self.scheduler.step(value)
        else:
            self.scheduler.step()

    def save_best(self) -> None:
        """Rank 0 writes the new best epoch's weights to ``checkpoints/best.pt`` (atomically;
        model, completed ``epoch``, ``global_step``, the monitor's state and the config)."""
        if self.world.is_main:
            checkpoint.save_best(self.writer.job_dir, {
                "model": self.model.state_dict(), "epoch": self.epoch - 1,
                "global_step": self.global_step, "monitor": self.monitor.state_dict(),
                "config": self.cfg})

    def evaluate_split(self, split: str, weights: str) -> dict[str, Any]:
        """Evaluate a held-out split (``test``) once, exactly reduced like validation, with
        the ``best`` weights (``checkpoints/best.pt``, read by rank 0 and broadcast) or the
        ``last`` ones; every rank must call it. The model keeps its last weights afterwards.

        Returns:
            ``<split>/loss``, ``<split>/<metric>`` and ``<split>/num_samples``.
        """
        data = getattr(self.datasets, split)
        use_best = weights == "best" and self.monitor.best_epoch is not None
        if weights == "best" and not use_best:
            log.warning("%s: no best epoch was recorded (%s never finite): using the last "
                        "weights", split, self.monitor.metric)
        last_weights = None
        if use_best:
            last_weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            if self.world.is_main:
                best = checkpoint.load(checkpoint.best_path(self.writer.job_dir),
                                       key="trainer.test_weights")
                self.model.load_state_dict(best["model"])
            broadcast_from_main(list(self.model.state_dict().values()))
        result = evaluate(self.model, self.data.eval_batches(data), self.objective, self.world,
                          self.device, self.precision)
        if last_weights is not None:
            self.model.load_state_dict(last_weights)
        out = {f"{split}/{key.split('/', 1)[1]}": value for key, value in result.items()}
        shown = ", ".join(f"{k} {v:.4f}" for k, v in out.items()
                          if v is not None and not k.endswith("num_samples"))
        which = (f"best weights, epoch {self.monitor.best_epoch + 1}" if use_best
                 else "last weights")
        log.info("%s (%s, %d samples): %s", split, which, out[f"{split}/num_samples"], shown)
        return out

    def _final(self, last: EpochResult, run_samples: int, train_s: float) -> dict[str, Any]:
        """The final global metrics of the last epoch (see ``metrics.json`` in the README)."""
        return {
            **last.val,
            "train/loss": last.train_loss,
            "train/num_samples": last.train_samples,
            "train/samples_per_sec": mean(run_samples, train_s),
            "time/train_s": train_s,
            "epoch": last.epoch + 1,
            "global_step": self.global_step,
            "steps_per_epoch": self.steps_per_epoch,
        }


def _epoch_line(r: EpochResult, epochs: int) -> str:
    parts = [f"epoch {r.epoch + 1}/{epochs}", f"step {r.global_step}"]
    if r.train_loss is not None:
        parts.append(f"train/loss {r.train_loss:.4f}")
    if r.val["val/loss"] is not None:
        parts.append(f"val/loss {r.val['val/loss']:.4f}")
    if r.val["val/accuracy"] is not None:
        correct = round(r.val["val/accuracy"] * r.val["val/num_samples"])
        parts.append(f"val/accuracy {r.val['val/accuracy']:.4f} "
                     f"({correct}/{r.val['val/num_samples']})")
    for key, value in r.val.items():
        if key not in ("val/loss", "val/accuracy", "val/num_samples") and value is not None:
            parts.append(f"{key} {value:.4f}")
    rate = mean(r.train_samples, r.train_s)
    if rate is not None:
        parts.append(f"{rate:,.0f} samples/s")
    return " | ".join(parts)
