"""Evaluation: validation after every epoch and the test split once, exact for any world size.

Each rank evaluates its unpadded strided shard of a held-out split (samples ``rank, rank +
world_size, ...``) through the unwrapped model, so the forward runs no DDP collective and
uneven shards cannot hang; per-sample values are summed in float64 and one all-reduce sums
them over the world (with the confusion counts of :mod:`ddp_exp.metrics.confusion` in the same
collective). The result is the single-process one: the mean of every sample once.

The model evaluated is rank 0's, the one rank 0 saves (``model.pt``, ``checkpoints/*.pt``):
its buffers are broadcast to every rank first. Without ``ddp.sync_batchnorm`` each rank's
BatchNorm keeps running statistics of its own shard (DDP copies rank 0's only before the next
training forward), so each rank would otherwise score a different model and the reduced
metrics would describe none of them (issue 26, N02).

Uses :mod:`ddp_exp.io.checkpoint` (``best.pt`` for the test split),
:mod:`ddp_exp.metrics.confusion`,
:mod:`ddp_exp.metrics.writer`, :mod:`ddp_exp.distributed.process_group`,
:mod:`ddp_exp.train.optimizer` (the forward's
autocast), :mod:`ddp_exp.data.loaders` and :mod:`ddp_exp.data` (the batches and splits),
:mod:`ddp_exp.train.monitor` (the best epoch) and :mod:`ddp_exp.train.objective`; the loop
(:mod:`ddp_exp.train.loop`) uses it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ddp_exp.data import Datasets
from ddp_exp.data.batches import call_model, to_device
from ddp_exp.data.loaders import RankData
from ddp_exp.distributed.process_group import (
    World,
    broadcast_buffers_from_main,
    broadcast_from_main,
)
from ddp_exp.io import checkpoint
from ddp_exp.io.sharded import load_model
from ddp_exp.metrics import confusion, lm
from ddp_exp.metrics.writer import Accumulator, MetricsWriter, mean
from ddp_exp.train.monitor import Monitor
from ddp_exp.train.objective import Objective
from ddp_exp.train.optimizer import autocast

log = logging.getLogger("ddp_exp.train")  # the loop's lines, under one name


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable, objective: Objective, world: World,
             device: torch.device, precision: str = "32-true",
             num_classes: int = 0, token_bytes: torch.Tensor | None = None) -> dict[str, Any]:
    """Loss and metrics of ``model`` on the whole validation set, exact for any world size.

    Each rank evaluates its shard, samples ``rank, rank + world_size, ...`` (no padding; a shard
    may be empty), sums per-sample values in float64, then one all-reduce sums (loss, metrics,
    count, and with ``num_classes`` the confusion counts). Every rank must call it. The model
    scored is rank 0's: every rank first takes rank 0's buffers (BatchNorm's running statistics;
    :func:`ddp_exp.distributed.process_group.broadcast_buffers_from_main`), as DDP's next training
    forward
    would, so the metrics are those of the weights rank 0 saves.

    Args:
        batches: this rank's shard as ``(x [B, ...], y [B] or [B, k])`` batches, on ``device``
            or the host (:meth:`ddp_exp.data.loaders.RankData.val_batches`).
        num_classes: ``C`` > 0 to count the confusion matrix in the same pass.
        token_bytes: token data: UTF-8 bytes per token id, float64 ``[vocab]``
            (:func:`ddp_exp.metrics.lm.token_byte_lengths`); the bytes of the counted targets
            are summed in the same all-reduce (``val/num_bytes``).

    Returns:
        ``val/loss`` (mean per-sample loss; per counted element for per-element targets:
        the sums over the world's elements divided by their count), ``val/<metric>`` for each
        metric (e.g. ``val/accuracy``; None when it does not apply) and ``val/num_samples``
        (samples, or counted elements); means are None for an empty set. With
        ``num_classes``, also ``confusion``: int64 ``[C, C]`` on the CPU (row = true class,
        column = predicted class).
    """
    broadcast_buffers_from_main(model)
    was_training = model.training
    model.eval()
    names = tuple(objective.metrics)
    extra = ("num_bytes",) if token_bytes is not None else ()
    sums = Accumulator(("loss", *names, "num_samples", *extra), device)
    if token_bytes is not None:
        token_bytes = token_bytes.to(device)
    pairs = (torch.zeros(num_classes * num_classes, dtype=torch.float64, device=device)
             if num_classes else None)
    for xb, yb in batches:
        xb, yb = to_device(xb, device), yb.to(device, non_blocking=True)
        with autocast(device, precision):
            out = objective.output(call_model(model, xb))
        loss, metric_sums, count = objective.metric_sums(out, yb)
        sums.add("loss", loss)
        for name in names:
            sums.add(name, metric_sums[name])
        sums.add("num_samples", count)
        if token_bytes is not None:
            kept = yb[yb != objective.ignore_index]
            sums.add("num_bytes", token_bytes[kept].sum())
        if pairs is not None:
            if objective.elementwise(yb):  # counted elements, class dimension last
                kept = yb != objective.ignore_index
                logits = out if objective.class_last else out.movedim(1, -1)
                pairs += confusion.pair_counts(logits[kept], yb[kept], num_classes)
            else:
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
    if token_bytes is not None:
        result["val/num_bytes"] = float(totals["num_bytes"])
    if pairs is not None:
        result["confusion"] = pairs.round().long().view(num_classes, num_classes).cpu()
    return result


CONFUSION_MAX_CLASSES = 100  # more classes (a vocabulary): no confusion matrix, it means nothing


def confusion_classes(num_classes: int) -> int:
    """The classes to count a confusion matrix for: ``num_classes``, or 0 (none) above
    :data:`CONFUSION_MAX_CLASSES` (a 256-byte or 50k-token vocabulary)."""
    return num_classes if num_classes <= CONFUSION_MAX_CLASSES else 0


class Evaluator:
    """The held-out splits of one rank's loop: validation after each epoch (``val/*`` scalars,
    the last confusion matrix) and the test split at the end.

    Args:
        model: the unwrapped model (the DDP wrapper's module: the same parameters).
        data: this rank's batches (:class:`ddp_exp.data.loaders.RankData`).
        datasets: the splits, identical on every rank.
        objective: the loss and validation metrics.
        world: this rank's place; every rank calls every method (one all-reduce each).
        device: this rank's device.
        precision: ``trainer.precision`` (the forward's autocast).
        writer: rank 0's writer (a no-op elsewhere).
        strategy: the run's :class:`ddp_exp.train.strategy.Strategy` (its ``evaluation()``
            context: FSDP gathers the shards once per pass); None: the model is whole.
    """

    def __init__(self, model: nn.Module, data: RankData, datasets: Datasets,
                 objective: Objective, world: World, device: torch.device, precision: str,
                 writer: MetricsWriter, strategy: Any = None):
        self.strategy = strategy
        self.model, self.data, self.datasets, self.objective = model, data, datasets, objective
        self.world, self.device, self.precision, self.writer = world, device, precision, writer
        # The validation tags the run writes (for the dashboard layout), none without samples.
        self.tags = (("val/loss", *(f"val/{m}" for m in objective.metrics))
                     if len(datasets.val) else ())
        self.last_confusion: torch.Tensor | None = None  # of the last validation
        self.token_bytes = lm.token_byte_lengths(datasets.val, world.is_main)  # bits/byte

    def validate(self, epoch: int, global_step: int) -> dict[str, Any]:
        """Evaluate the validation split after (0-based) ``epoch``; rank 0 writes the ``val/*``
        scalars at x = ``global_step``. Returns :func:`evaluate`'s results without the
        confusion matrix, which is kept for :meth:`report_confusion`."""
        if not len(self.datasets.val):
            return {"val/loss": None, "val/accuracy": None, "val/num_samples": 0}
        with self._whole():
            val = evaluate(self.model, self.data.val_batches(epoch), self.objective,
                           self.world, self.device, self.precision,
                           confusion_classes(self.objective.num_classes), self.token_bytes)
        self.last_confusion = val.pop("confusion", None)
        val.update(lm.val_scalars(val["val/loss"], self.datasets.val,  # data=tokens only
                                  val["val/num_samples"], val.pop("val/num_bytes", None)))
        self.writer.scalars(global_step,
                            {k: v for k, v in val.items() if k != "val/num_samples"})
        return val

    def _whole(self) -> Any:
        """The strategy's evaluation context (FSDP: parameters gathered for the pass)."""
        return self.strategy.evaluation() if self.strategy is not None else contextlib.nullcontext()

    def report_confusion(self, global_step: int) -> None:
        """Classification: the last validation's confusion matrix (of the final weights, counted
        and reduced exactly in that pass); rank 0 writes ``confusion_matrix.csv`` and the
        ``val/confusion_matrix`` picture (:mod:`ddp_exp.metrics.confusion`)."""
        matrix = self.last_confusion
        if matrix is None:
            return
        num_classes = self.objective.num_classes
        if self.writer.enabled:
            names = confusion.class_names(self.datasets.val, num_classes)
            self.writer.write_text("confusion_matrix.csv", confusion.to_csv(matrix, names))
            self.writer.image("val/confusion_matrix", confusion.image(matrix, names),
                              global_step)

    def evaluate_split(self, split: str, weights: str, monitor: Monitor) -> dict[str, Any]:
        """Evaluate a held-out split (``test``) once, exactly reduced like validation, with
        the ``best`` weights (``checkpoints/best.pt``, read by rank 0 and broadcast) or the
        ``last`` ones; every rank must call it. The model keeps its last weights afterwards.
        ``monitor`` knows the best epoch (:mod:`ddp_exp.train.monitor`).

        Returns:
            ``<split>/loss``, ``<split>/<metric>`` and ``<split>/num_samples``.
        """
        data = getattr(self.datasets, split)
        use_best = weights == "best" and monitor.best_epoch is not None
        if weights == "best" and not use_best and self.world.is_main:  # said once
            log.warning("%s: no best epoch was recorded (%s never finite): using the last "
                        "weights", split, monitor.metric)
        last_weights = None
        sharded = getattr(self.strategy, "name", "ddp") == "fsdp"
        best_path = checkpoint.best_path(self.writer.job_dir)
        if use_best and sharded:  # gathered on rank 0, scattered back from rank 0
            last_weights = self.strategy.model_state()
            folder = checkpoint.shards_of(best_path)  # every rank reads the small file
            if folder:  # a sharded best.pt: every rank reads its own slices
                checkpoint.load(folder, key="trainer.test_weights")
                load_model(folder, self.strategy.module)
            else:
                self.strategy.load_from_main(checkpoint.load(
                    best_path, key="trainer.test_weights")["model"]
                    if self.world.is_main else {})
        elif use_best:
            last_weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            if self.world.is_main:
                best = checkpoint.load(best_path, key="trainer.test_weights")
                if best.get("shards"):  # an FSDP epoch's best, in a run DDP continued
                    load_model(best["shards"], self.model, no_dist=True)
                else:
                    self.model.load_state_dict(best["model"])
            broadcast_from_main(list(self.model.state_dict().values()))
        with self._whole():
            result = evaluate(self.model, self.data.eval_batches(data), self.objective,
                              self.world, self.device, self.precision)
        if last_weights is not None and sharded:
            self.strategy.load_from_main(last_weights)
        elif last_weights is not None:
            self.model.load_state_dict(last_weights)
        out = {f"{split}/{key.split('/', 1)[1]}": value for key, value in result.items()}
        shown = ", ".join(f"{k} {v:.4f}" for k, v in out.items()
                          if v is not None and not k.endswith("num_samples"))
        which = (f"best weights, epoch {monitor.best_epoch + 1}" if use_best
                 else "last weights")
        log.info("%s (%s, %d samples): %s", split, which, out[f"{split}/num_samples"], shown)
        return out
