"""Progress on rank 0: a tqdm bar per epoch on a terminal, plain log lines elsewhere.

``trainer.progress``: ``auto`` (bar when stderr is a terminal, else log), ``bar``, ``log`` or
``off``. The bar advances every optimizer step (a counter, no device sync); its loss and
samples/s are the reduced values of each logging interval, so progress costs no extra
all-reduce. In ``log`` mode an interval line is written at most every ``LOG_EVERY_S`` seconds,
so a file or CI log gets a heartbeat without a line per step. The epoch's summary line
(:func:`epoch_line`: its reduced train and validation values) is logged by the loop in every mode.

Uses :mod:`ddp_exp.metrics.warmup` (rates without warm-up) and tqdm; the loop
(:mod:`ddp_exp.train.loop`)
uses it.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

from ddp_exp.metrics import warmup

log = logging.getLogger("ddp_exp.train")

LOG_EVERY_S = 10.0


def resolve_mode(mode: str, enabled: bool) -> str:
    """``off`` on ranks other than 0; ``auto`` becomes ``bar`` on a terminal, else ``log``."""
    if not enabled:
        return "off"
    if mode == "auto":
        return "bar" if sys.stderr.isatty() else "log"
    return mode


def steps_in_epoch(steps_per_epoch: int, done: int, global_step: int,
                   max_steps: int | None) -> int:
    """The optimizer steps the epoch will run, the total its progress shows: all of
    ``steps_per_epoch``, unless ``trainer.max_steps`` stops the run part-way through it
    (``done`` of its steps taken, ``global_step`` of the run's). A run of 547 steps an epoch
    stopped at ``max_steps=300`` showed ``step 240/547`` (a fresh user's find)."""
    if max_steps is None:
        return steps_per_epoch
    return min(steps_per_epoch, done + max(0, max_steps - global_step))


class Progress:
    """One epoch's progress. ``step()`` per optimizer step, ``interval(loss, rate)`` per
    logging interval, ``close()`` at the end of the epoch."""

    def __init__(self, mode: str, epoch: int, epochs: int, steps: int, unit: str = "samples"):
        self.mode, self.epoch, self.epochs, self.steps = mode, epoch, epochs, steps
        self.unit = unit  # what the rate counts: samples, or tokens (data=tokens)
        self.done = 0
        self.last_line = time.monotonic()
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=steps, desc=f"epoch {epoch + 1}/{epochs}", unit="step",
                            leave=False, dynamic_ncols=True, file=sys.stderr)

    def step(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    def interval(self, loss: float | None, samples_per_sec: float | None) -> None:
        if self.bar is not None:
            rate = f"{samples_per_sec:,.0f}" if samples_per_sec else "-"
            self.bar.set_postfix({"loss": f"{loss:.4f}" if loss is not None else "-",
                                  f"{self.unit}_s": rate}, refresh=False)  # tokens_s, samples_s
        elif self.mode == "log" and time.monotonic() - self.last_line >= LOG_EVERY_S:
            self.last_line = time.monotonic()
            log.info("progress: epoch %d/%d, step %d/%d | train/loss %s | %s %s/s",
                     self.epoch + 1, self.epochs, self.done, self.steps,
                     f"{loss:.4f}" if loss is not None else "-",
                     f"{samples_per_sec:,.0f}" if samples_per_sec else "-", self.unit)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@dataclass
class EpochResult:
    """What one epoch measured, reduced over the world."""

    epoch: int
    global_step: int
    train_loss: float | None
    train_samples: int
    train_s: float
    val: dict[str, Any]
    unit: str = "samples"  # what train_samples counts: samples, or tokens (data=tokens)
    timed_samples: int | None = None  # of train_samples, those in train_s (warm-up left out)
    val_step: int | None = None  # the step ``val`` was measured at, where not global_step


def epoch_line(r: EpochResult, epochs: int) -> str:
    """The line rank 0 logs after each epoch: ``epoch e/E | step s | train/epoch_loss ... |
    val/... | N samples/s`` (``tokens/s`` for token data: the unit ``r.unit`` the loss counts;
    a value that does not apply is left out; the rate leaves warm-up out). Validation values
    of an earlier step (``trainer.val_every_n_steps``: the last validation before the epoch's
    end) are preceded by ``val at step N``."""
    parts = [f"epoch {r.epoch + 1}/{epochs}", f"step {r.global_step}"]
    if r.train_loss is not None:
        parts.append(f"train/epoch_loss {r.train_loss:.4f}")
    if r.val_step is not None and r.val_step != r.global_step and r.val["val/loss"] is not None:
        parts.append(f"val at step {r.val_step}")
    if r.val["val/loss"] is not None:
        parts.append(f"val/loss {r.val['val/loss']:.4f}")
    if r.val["val/accuracy"] is not None:
        correct = round(r.val["val/accuracy"] * r.val["val/num_samples"])
        parts.append(f"val/accuracy {r.val['val/accuracy']:.4f} "
                     f"({correct}/{r.val['val/num_samples']})")
    for key, value in r.val.items():
        if key not in ("val/loss", "val/accuracy", "val/num_samples") and value is not None:
            parts.append(f"{key} {value:.4f}")
    rate = warmup.rate(r.train_samples if r.timed_samples is None else r.timed_samples,
                       r.train_s)
    if rate is not None:
        parts.append(f"{rate:,.0f} {r.unit}/s")
    return " | ".join(parts)
