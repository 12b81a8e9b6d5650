"""Warm-up left out of throughput: the first optimizer step of every run (the allocator's first
blocks, thread pools, DDP's first bucket rebuild, lazy imports) and, with ``trainer.compile``,
every step during which ``torch.compile`` compiled (the first steps, and a recompile at a new
input shape), measured by :func:`ddp_exp.compat.dynamo.compile_seconds`.

The loop times only those steps (on CUDA with a synchronize around the first and after a
compiling one; the other steps stay free of host syncs) and moves their seconds and samples out
of the rates: ``train/samples_per_sec``, ``train/tokens_per_sec``, ``perf/model_flops_per_sec``
and ``perf/mfu`` (each logging interval's, each epoch's and ``metrics.json``'s) count the steps
after warm-up alone. ``perf/compile_s`` (compile seconds) and ``perf/warmup_s`` (the warm-up
steps' whole time, compilation included) are reported on their own. The seconds are rank 0's
clock, like every rate; a warm-up step's samples are this rank's times the world's size (every
rank steps the same batches at the first step).

Uses :mod:`ddp_exp.compat.dynamo` and torch; the loop uses it.
"""

from __future__ import annotations

import logging
import time

import torch

from ddp_exp.compat.dynamo import compile_seconds

log = logging.getLogger("ddp_exp.train")


class Warmup:
    """The warm-up steps of one rank's run, left out of its rates.

    Per step: :meth:`begin` before it, :meth:`end` after it (returns the seconds to leave out
    of the clocks, 0.0 for a steady step); at each logging check :meth:`checked` hands the
    samples left out to the interval being reduced, and :meth:`take_interval_samples` /
    :meth:`take_epoch_samples` give them to the rate being computed.

    Args:
        compile: ``trainer.compile``: steps that compile are warm-up too.
        device: this rank's device (CUDA: synchronized around warm-up steps).
        world_size: ranks stepping the same batches.
    """

    def __init__(self, compile: bool, device: torch.device, world_size: int):
        self.compile, self.world_size = compile, world_size
        self.sync = device.type == "cuda"
        self.first = True  # the next step is the process's first
        self.compile_s = 0.0  # seconds compiling in this run's steps
        self.warmup_s = 0.0  # the warm-up steps' whole time (compilation included)
        self.steps = 0  # warm-up steps
        self.reported_s = 0.0  # compile seconds the log has told
        self.epoch_samples = 0  # left out of the epoch in progress
        self.pending_samples = 0  # left out, until the next logging check
        self.interval_samples = 0  # left out of the interval the next write takes
        self._start: tuple[float, float, int] | None = None

    def begin(self, sizes: list[int]) -> None:
        """Before a step; ``sizes``: the loss window's per-micro-batch counts so far."""
        if not (self.first or self.compile):
            return
        if self.sync and self.first:  # no sync per step: a compiling step's host time is
            torch.cuda.synchronize()  # its compilation, whatever the device still runs
        self._start = (time.perf_counter(), compile_seconds() if self.compile else 0.0,
                       len(sizes))

    def end(self, sizes: list[int]) -> float:
        """After the step begun: the seconds it took when it was warm-up (its samples, the
        counts ``sizes`` gained, noted), else 0.0."""
        if self._start is None:
            return 0.0
        t0, c0, n0 = self._start
        self._start = None
        compiled = compile_seconds() - c0 if self.compile else 0.0
        if not (self.first or compiled > 0):
            return 0.0
        self.first = False
        if self.sync:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        samples = sum(sizes[n0:]) * self.world_size
        self.compile_s += compiled
        self.warmup_s += seconds
        self.steps += 1
        self.epoch_samples += samples
        self.pending_samples += samples
        return seconds

    def checked(self) -> None:
        """A logging check starts reducing the steps since the last: their warm-up samples
        belong to the interval it reduces."""
        self.interval_samples += self.pending_samples
        self.pending_samples = 0

    def take_interval_samples(self) -> int:
        """The samples to leave out of the interval being written (then 0)."""
        samples, self.interval_samples = self.interval_samples, 0
        return samples

    def take_epoch_samples(self) -> int:
        """The samples to leave out of the epoch that ended (then 0)."""
        samples, self.epoch_samples = self.epoch_samples, 0
        return samples


def rate(samples: float, seconds: float) -> float | None:
    """``samples / seconds`` (per second), None when no steady step counted (a span of warm-up
    alone: no rate, rather than 0)."""
    return samples / seconds if samples > 0 and seconds > 0 else None


def report(warmup: Warmup, writer, step: int) -> None:
    """After an epoch, with ``trainer.compile``: rank 0's ``writer`` adds ``perf/compile_s``
    (seconds compiling so far) at x = ``step``, and the log says once per new compilation how
    long it took and that it is left out of the rates."""
    if not warmup.compile:
        return
    writer.scalars(step, {"perf/compile_s": warmup.compile_s})
    if warmup.compile_s > warmup.reported_s and writer.enabled:
        log.info("torch.compile: %.1f s compiling in %d warm-up step(s) (%.1f s in all), "
                 "left out of samples/s, tokens/s and MFU", warmup.compile_s, warmup.steps,
                 warmup.warmup_s)
    warmup.reported_s = warmup.compile_s


def final_metrics(warmup: Warmup) -> dict[str, float]:
    """``metrics.json``'s ``perf/warmup_s`` (the warm-up steps' seconds, left out of
    ``time/train_s`` and every rate) and, with ``trainer.compile``, ``perf/compile_s``."""
    out = {"perf/warmup_s": warmup.warmup_s}
    if warmup.compile:
        out["perf/compile_s"] = warmup.compile_s
    return out
