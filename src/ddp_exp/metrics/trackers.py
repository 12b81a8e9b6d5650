"""Trackers: sinks of the stream rank 0's :class:`ddp_exp.metrics.writer.MetricsWriter` writes.

Every scalar the writer puts into TensorBoard (globally reduced, rank 0 only, at the global
optimizer step) goes, with the same value and step, to each tracker of the ``logger`` group
(:mod:`ddp_exp.config.loggers`): ``metrics.csv`` (:mod:`ddp_exp.metrics.csv_sink`), an MLflow
run (:mod:`ddp_exp.metrics.mlflow_sink`), a W&B run (:mod:`ddp_exp.metrics.wandb_sink`). Each
also gets the flattened config as parameters when it opens and the final metrics (as
``metrics.json``) when the run ends.

Three rules, the field's usual failures (Lightning #11380, wandb #5979, PufferDrive PR #468):

* **One writer.** Only rank 0 builds :class:`Trackers`; the values are those TensorBoard gets
  (each rounded to float32 as TensorBoard's ``simple_value`` holds it, so a tracker's curve
  equals the event file's), the final metrics in float64 as ``metrics.json`` holds them.
* **One run per job, continued by a resume.** A tracker's run id is kept in the job folder
  (``trackers.json``); a resume of any kind reopens that run, and a step a tracker already holds
  for a metric (logged past the checkpoint by the attempt that was killed) is not logged again:
  the steps of each metric strictly increase.
* **A tracker never stops training.** Each tracker runs on one background thread (the loop only
  queues), and a tracker that raises (server down, disk full, a library that fails at import)
  is one ``warning:`` line and is dropped; TensorBoard and ``metrics.json`` hold everything.

Uses :mod:`ddp_exp.config.loggers` and :mod:`ddp_exp.io.files`; the writer and the rank use it.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ddp_exp.config.errors import described
from ddp_exp.metrics.tracker_ids import RECORD, read_record, write_record  # noqa: F401

log = logging.getLogger("ddp_exp")

FINISH_TIMEOUT_S = 120.0  # longest wait for the trackers at the run's end
CLOSE_TIMEOUT_S = 10.0  # ... after a failure or a preemption: the job's exit comes first
SYNC_TIMEOUT_S = 30.0  # longest wait of a checkpoint for the trackers' rows before its step
_STOP = object()
_SYNCED = object()  # a marker job: its Event is set once every job before it is done


class Sink(Protocol):
    """One tracker. Every method runs on the trackers' thread; any exception drops the sink."""

    name: str  # the config key, ``logger.<name>``

    def open(self, params: Mapping[str, float | str], purge_step: int | None
             ) -> Mapping[str, int]:
        """Start or reopen the run; returns, for each metric the run already holds, its last
        step (those steps are not logged again). ``purge_step``: a resume's first step (None:
        a fresh run)."""

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Log ``values`` (metric name -> number) at the global optimizer step ``step``."""

    def flush(self) -> None:
        """Make what was logged durable (after each epoch)."""

    def finish(self, step: int, final: Mapping[str, float]) -> None:
        """Log the final metrics (``metrics.json``'s numbers) and end the run as finished."""

    def close(self) -> None:
        """End a run that did not finish (a failure, a preemption): it stays resumable."""


@dataclass
class TrackerPlan:
    """What rank 0 needs to open the trackers, decided by the launching process
    (:func:`ddp_exp.launch.build.prepare`): picklable, for any start method.

    Attributes:
        job_dir: the job folder (absolute).
        csv: ``metrics.csv``'s file name, or None (off).
        mlflow: the MLflow run's settings (:class:`ddp_exp.metrics.mlflow_sink.MLflowSink`'s
            keyword arguments), or None (off).
        wandb: the W&B run's settings (:class:`ddp_exp.metrics.wandb_sink.WandbSink`'s), or None.
    """

    job_dir: str
    csv: str | None = None
    mlflow: dict[str, Any] | None = None
    wandb: dict[str, Any] | None = None

    @property
    def empty(self) -> bool:
        """True when no tracker but TensorBoard is on."""
        return self.csv is None and self.mlflow is None and self.wandb is None


def build_sinks(plan: TrackerPlan) -> list[Sink]:
    """The sinks of ``plan`` (imports each tracker's module only when it is on)."""
    sinks: list[Sink] = []
    if plan.csv is not None:
        from ddp_exp.metrics.csv_sink import CSVSink

        sinks.append(CSVSink(os.path.join(plan.job_dir, plan.csv)))
    if plan.mlflow is not None:
        from ddp_exp.metrics.mlflow_sink import MLflowSink

        sinks.append(MLflowSink(job_dir=plan.job_dir, **plan.mlflow))
    if plan.wandb is not None:
        from ddp_exp.metrics.wandb_sink import WandbSink

        sinks.append(WandbSink(job_dir=plan.job_dir, **plan.wandb))
    return sinks


def open_trackers(plan: TrackerPlan | None, params: Mapping[str, float | str], is_main: bool,
                  purge_step: int | None) -> Trackers | None:
    """Rank 0's :class:`Trackers` for ``plan`` (opened on their thread); None on other ranks
    and where no tracker but TensorBoard is on."""
    if not is_main or plan is None or plan.empty:
        return None
    return Trackers(build_sinks(plan), params, purge_step)


class Trackers:
    """Rank 0's trackers, fed from one background thread in the order of the calls.

    Args:
        sinks: the trackers (:func:`build_sinks`).
        params: the flattened config (:func:`ddp_exp.metrics.writer.flatten_hparams`).
        purge_step: a resume's first step (the checkpoint's global step + 1), None when fresh.
    """

    def __init__(self, sinks: list[Sink], params: Mapping[str, float | str],
                 purge_step: int | None):
        self.sinks = list(sinks)
        self.done: dict[str, Mapping[str, int]] = {}  # sink -> metric -> last step it holds
        self.jobs: queue.Queue = queue.Queue()
        self.finished = False
        self.lagging: threading.Event | None = None  # a sync that timed out, until it is done
        self.thread = threading.Thread(target=self._run, name="ddp_exp-trackers", daemon=True)
        self.thread.start()
        self.jobs.put(("open", (dict(params), purge_step)))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Queue ``values`` at ``step`` for every tracker (returns at once)."""
        if values:
            self.jobs.put(("log", (step, dict(values))))

    def flush(self) -> None:
        """Queue a flush of every tracker (after each epoch)."""
        self.jobs.put(("flush", ()))

    def sync(self, timeout_s: float = SYNC_TIMEOUT_S) -> bool:
        """Flush every tracker and wait until their thread has done it, and every log queued
        before it (``timeout_s`` at most: a tracker's server that does not answer delays one
        checkpoint that long, and it lands without it). Safe on another
        thread than the one that logs: the checkpoint writer's, before a checkpoint lands, so
        that a resume from it finds every row before its step (``metrics.csv`` kept its last
        row in memory until the epoch's flush; a kill after a step checkpoint lost it).
        Returns whether it was done in time; True at once after :meth:`finish` or
        :meth:`close`. While an earlier sync that timed out is still not done, False at once
        (a tracker's server that hangs must not hold every later checkpoint, nor pile up
        their snapshots in the writer's queue)."""
        if self.finished or not self.thread.is_alive():
            return True
        if self.lagging is not None and not self.lagging.is_set():
            return False
        done = threading.Event()
        self.jobs.put(("flush", ()))
        self.jobs.put((_SYNCED, (done,)))
        if done.wait(timeout_s):
            return True
        self.lagging = done
        log.warning("warning: %s did not write its rows within %.0f s: checkpoints land "
                    "without waiting for them until it catches up",
                    ", ".join(f"logger.{s.name}" for s in self.sinks), timeout_s)
        return False

    def finish(self, step: int, final: Mapping[str, Any]) -> None:
        """Queue the final metrics (the numbers of ``final``; True/False as 1/0) and the end of
        every run, then wait for the trackers (:data:`FINISH_TIMEOUT_S` at most)."""
        numbers = {k: float(v) for k, v in final.items()
                   if isinstance(v, (int, float)) and math.isfinite(v)}
        self.jobs.put(("finish", (step, numbers)))
        self.finished = True
        self._stop(FINISH_TIMEOUT_S)

    def close(self) -> None:
        """End the trackers after a failure or a preemption (their runs stay resumable;
        :data:`CLOSE_TIMEOUT_S` at most); a no-op after :meth:`finish`."""
        if not self.finished:
            self.finished = True
            self.jobs.put(("close", ()))
            self._stop(CLOSE_TIMEOUT_S)

    def _stop(self, timeout_s: float) -> None:
        self.jobs.put((_STOP, ()))
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            names = ", ".join(f"logger.{s.name}" for s in self.sinks)
            log.warning("warning: %s did not finish within %.0f s: its run may lack the last "
                        "values (the job folder has them all)", names, timeout_s)

    def _run(self) -> None:
        held = None
        while True:
            op, args = held or self.jobs.get()
            held = None
            if op is _STOP:
                return
            if op is _SYNCED:  # every job queued before it is done
                args[0].set()
                continue
            if op == "log":  # every log queued meanwhile, in one call (one MLflow batch)
                op, args = "logs", [args]
                while held is None:
                    try:
                        job = self.jobs.get_nowait()
                    except queue.Empty:
                        break
                    if job[0] == "log":
                        args.append(job[1])
                    else:
                        held = job
            for sink in list(self.sinks):
                try:
                    self._apply(sink, op, args)
                except Exception as exc:  # a tracker never stops training: drop it
                    self.sinks.remove(sink)
                    log.warning("warning: logger.%s failed and is off for the rest of this run "
                                "(%s); training goes on, the job folder holds every "
                                "metric (tensorboard/, metrics.json)", sink.name,
                                described(exc))

    def _apply(self, sink: Sink, op: str, args: tuple) -> None:
        if op == "open":
            self.done[sink.name] = dict(sink.open(*args))
        elif op == "logs":
            done = self.done.get(sink.name) or {}
            fresh = [(step, kept) for step, values in args
                     if (kept := {k: v for k, v in values.items() if step > done.get(k, -1)})]
            if hasattr(sink, "log_steps"):
                if fresh:
                    sink.log_steps(fresh)
            else:
                for step, values in fresh:
                    sink.log(step, values)
        elif op == "flush":
            sink.flush()
        elif op == "finish":
            sink.finish(*args)
        elif op == "close":
            sink.close()
