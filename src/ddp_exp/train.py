"""The per-rank training loop: DDP, the optimizer step, evaluation and the metrics of one world.

One epoch, on every rank (nanoGPT / torchtitan idiom, top to bottom):

1. ``sampler.set_epoch(epoch)``: a new permutation per epoch, the same on every rank, strided
   into shards (``DistributedSampler``).
2. Per step: forward through the DDP wrapper, ``loss.backward()`` (DDP all-reduces gradient
   buckets while backward runs, so every rank ends with the mean gradient of the global batch),
   ``optimizer.step()``, and ``zero_grad`` before the next backward, since autograd accumulates
   into ``.grad``. The loss is summed on the device; nothing waits on the host.
3. Every ``trainer.log_every_n_steps``: one all-reduce of (loss sum, sample count), and rank 0
   writes ``train/loss`` (mean over the interval's samples), ``train/lr`` and
   ``train/samples_per_sec`` at x = global step.
4. Evaluation of the whole validation set through ``model.module`` (the unwrapped model: no DDP
   collectives in the forward, so uneven shards cannot hang), one all-reduce of (loss sum,
   correct, count), and rank 0 writes ``val/loss`` and ``val/accuracy``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from ddp_exp.config import instantiate_node
from ddp_exp.data import Datasets, TrainLoader, val_batches
from ddp_exp.distributed import World
from ddp_exp.metrics import Accumulator, MetricsWriter, mean

log = logging.getLogger(__name__)

EVAL_BATCH_SIZE = 512  # evaluation only: larger batches, same per-sample losses


@dataclass
class Summary:
    """What one epoch measured, reduced over the world."""

    epoch: int
    global_step: int
    train_loss: float | None
    train_samples: int
    train_s: float
    val: dict[str, Any]


def loss_per_sample(output: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Per-sample loss ``[batch]``: cross-entropy for classes (``target [batch]`` int64), else the
    mean squared error over the ``[batch, k]`` outputs."""
    if num_classes:
        return F.cross_entropy(output, target, reduction="none")
    return (output - target).pow(2).mean(dim=1)


def batch_loss(output: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Mean loss of a batch (a scalar), the quantity whose gradient DDP averages across ranks."""
    if num_classes:
        return F.cross_entropy(output, target)
    return F.mse_loss(output, target)


@torch.no_grad()
def evaluate(model: nn.Module, datasets: Datasets, world: World,
             device: torch.device) -> dict[str, Any]:
    """Loss and accuracy of ``model`` on the whole validation set, exact for any world size.

    Each rank evaluates samples ``rank, rank + world_size, ...`` (no padding, a shard may be
    empty), then one all-reduce sums (loss, correct, count) in float64.

    Returns:
        ``val/loss`` (mean per-sample loss), ``val/accuracy`` (correct / count, None for
        regression) and ``val/num_samples``; losses are None when the set is empty.
    """
    was_training = model.training
    model.eval()
    x = torch.from_numpy(datasets.val.features)
    y = torch.from_numpy(datasets.val.targets)
    sums = Accumulator(("loss_sum", "correct", "num_samples"), device)
    for xb, yb in val_batches(x, y, world.rank, world.world_size, EVAL_BATCH_SIZE):
        xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
        out = model(xb)
        sums.add("loss_sum", loss_per_sample(out, yb, datasets.num_classes).double().sum())
        if datasets.num_classes:
            sums.add("correct", (out.argmax(dim=1) == yb).sum())
        sums.add("num_samples", len(xb))
    totals = sums.reduce()
    model.train(was_training)
    count = int(totals["num_samples"])
    return {
        "val/loss": mean(totals["loss_sum"], count),
        "val/accuracy": mean(totals["correct"], count) if datasets.num_classes else None,
        "val/num_samples": count,
    }


def fit(cfg: dict[str, Any], world: World, datasets: Datasets, model: nn.Module,
        device: torch.device, writer: MetricsWriter) -> dict[str, Any]:
    """Train ``model`` for ``trainer.epochs`` (or ``trainer.max_steps``) on this rank.

    Args:
        cfg: the resolved config as plain data (see ``conf/config.yaml``).
        world: this rank's place in the world; the default process group is initialised.
        datasets: the train/validation split, identical on every rank.
        model: the seeded, unwrapped model (identical on every rank; DDP broadcasts rank 0's
            parameters anyway).
        writer: rank 0's TensorBoard/metrics writer (a no-op elsewhere).

    Returns:
        The final global metrics (see ``metrics.json`` in the README).
    """
    data_cfg, trainer = cfg["data"], cfg["trainer"]
    batch_size, num_classes = data_cfg["batch_size"], datasets.num_classes
    x = torch.from_numpy(datasets.train.features).to(device)
    y = torch.from_numpy(datasets.train.targets).to(device)
    sampler = DistributedSampler(range(len(x)), num_replicas=world.world_size, rank=world.rank,
                                 shuffle=data_cfg["shuffle"], seed=cfg["seed"], drop_last=False)
    loader = TrainLoader(x, y, sampler, batch_size, data_cfg["num_workers"])

    model = model.to(device)
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cfg["ddp"]["bucket_cap_mb"],
        gradient_as_bucket_view=cfg["ddp"]["gradient_as_bucket_view"],
        static_graph=cfg["ddp"]["static_graph"],
        find_unused_parameters=cfg["ddp"]["find_unused_parameters"])
    optimizer = instantiate_node(cfg["optim"], "optim")(ddp.parameters())
    torch.manual_seed(cfg["seed"] + world.rank)  # dropout and other randomness differ per rank

    max_steps = trainer["max_steps"]
    log_every = trainer["log_every_n_steps"]
    interval = Accumulator(("loss_sum", "num_samples"), device)
    global_step, last = 0, None
    train_s, run_samples = 0.0, 0
    for epoch in range(trainer["epochs"]):
        sampler.set_epoch(epoch)
        ddp.train()
        epoch_loss, epoch_samples, epoch_s = 0.0, 0, 0.0
        t_interval = time.perf_counter()
        pending = 0
        for xb, yb in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            loss = batch_loss(ddp(xb), yb, num_classes)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            global_step += 1
            pending += 1
            interval.add("loss_sum", loss, weight=len(xb))
            interval.add("num_samples", len(xb))
            stop = max_steps is not None and global_step >= max_steps
            if pending == log_every or stop:
                t_interval, seconds, totals = _log_interval(interval, t_interval, global_step,
                                                            optimizer, writer)
                epoch_loss += totals["loss_sum"]
                epoch_samples += int(totals["num_samples"])
                epoch_s += seconds
                pending = 0
            if stop:
                break
        if pending:
            t_interval, seconds, totals = _log_interval(interval, t_interval, global_step,
                                                        optimizer, writer)
            epoch_loss += totals["loss_sum"]
            epoch_samples += int(totals["num_samples"])
            epoch_s += seconds
        train_s += epoch_s
        run_samples += epoch_samples
        val = evaluate(ddp.module, datasets, world, device) if len(datasets.val) else {
            "val/loss": None, "val/accuracy": None, "val/num_samples": 0}
        writer.scalars(global_step, {k: v for k, v in val.items() if k != "val/num_samples"})
        last = Summary(epoch, global_step, mean(epoch_loss, epoch_samples), epoch_samples,
                       epoch_s, val)
        log.info(_epoch_line(last, trainer["epochs"]))
        if max_steps is not None and global_step >= max_steps:
            break

    assert last is not None  # epochs >= 1 is validated
    return {
        **last.val,
        "train/loss": last.train_loss,
        "train/num_samples": last.train_samples,
        "train/samples_per_sec": mean(run_samples, train_s),
        "time/train_s": train_s,
        "epoch": last.epoch + 1,
        "global_step": global_step,
        "steps_per_epoch": len(loader),
    }


def _log_interval(interval: Accumulator, t_start: float, step: int, optimizer,
                  writer: MetricsWriter) -> tuple[float, float, dict[str, float]]:
    """Reduce the interval's sums (one all-reduce) and write its scalars; returns the new
    interval start, the interval's seconds and the reduced totals."""
    totals = interval.reduce()
    now = time.perf_counter()
    seconds = now - t_start
    writer.scalars(step, {
        "train/loss": mean(totals["loss_sum"], totals["num_samples"]),
        "train/lr": optimizer.param_groups[0]["lr"],
        "train/samples_per_sec": mean(totals["num_samples"], seconds),
    })
    return now, seconds, totals


def _epoch_line(s: Summary, epochs: int) -> str:
    parts = [f"epoch {s.epoch + 1}/{epochs}", f"step {s.global_step}"]
    if s.train_loss is not None:
        parts.append(f"train/loss {s.train_loss:.4f}")
    if s.val["val/loss"] is not None:
        parts.append(f"val/loss {s.val['val/loss']:.4f}")
    if s.val["val/accuracy"] is not None:
        correct = round(s.val["val/accuracy"] * s.val["val/num_samples"])
        parts.append(f"val/accuracy {s.val['val/accuracy']:.4f} "
                     f"({correct}/{s.val['val/num_samples']})")
    rate = mean(s.train_samples, s.train_s)
    if rate is not None:
        parts.append(f"{rate:,.0f} samples/s")
    return " | ".join(parts)
