"""Global metrics: reduction of per-rank sums and counts, and what rank 0 writes.

:class:`Accumulator` keeps float64 sums on the rank's device and reduces them across the world in
one all-reduce when asked, so the training loop never synchronises with the host per step.
:class:`MetricsWriter` is rank 0's TensorBoard run (scalars + HParams summaries in the run's own
event stream, never a stray sub-run) and ``metrics.json``; every other rank gets a writer that
does nothing, so the loop has no ``if rank == 0`` around its logging.

Uses :mod:`ddp_exp.distributed.process_group` (the all-reduce) and :mod:`ddp_exp.io.files` (atomic
writes); the
loop, its helpers and the rank use it.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ddp_exp.distributed.process_group import all_reduce_sum
from ddp_exp.io.files import atomic_write
from ddp_exp.metrics.trackers import Trackers

# Final metrics (metrics.json keys) paired with each run's hyper-parameters in TensorBoard's
# HParams dashboard. The dashboard shows, for each metric, the last point of the scalar with its
# tag; ``train/loss`` is the last logging interval's mean and ``train/epoch_loss`` the last
# epoch's mean (metrics.json's). Each is written once more, at the end, from the very
# value that goes into metrics.json, under its own tag ``final/<key>`` (float64), and the
# dashboard shows it under the metrics.json name.
HPARAM_METRICS = ("val/loss", "val/accuracy", "train/epoch_loss")
FINAL_PREFIX = "final/"
QUEUE_S = 10.0  # MetricsWriter.queue_scalars writes at least this often


def hparams_summaries(hparams: Mapping[str, float | str], metrics: tuple[str, ...]) -> list:
    """TensorBoard's three HParams summaries (experiment, session start, session end) for
    ``hparams`` and the final ``metrics``: each metric's tag is ``final/<name>``, its display
    name ``<name>`` (torch's ``hparams()`` sets no display name: its experiment summary is
    rewritten here)."""
    from tensorboard.plugins.hparams import plugin_data_pb2
    from torch.utils.tensorboard.summary import hparams as torch_hparams

    summaries = torch_hparams(dict(hparams), {FINAL_PREFIX + m: 0.0 for m in metrics})
    value = summaries[0].value[0]
    data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
    for info in data.experiment.metric_infos:
        info.display_name = info.name.tag.removeprefix(FINAL_PREFIX)
    value.metadata.plugin_data.content = data.SerializeToString()
    return list(summaries)


def recipe_hparam_metrics(monitor: str | None, test_metrics: list[str]) -> list[str]:
    """The recipe's final values (issue 15) shown in the HParams dashboard besides
    :data:`HPARAM_METRICS`: ``best/<monitor>``, ``best/epoch``, ``stopped_early`` (0/1) when a
    metric is monitored, and ``test/<name>`` for each name of ``test_metrics`` (``loss``,
    ``accuracy``, user metrics; empty without a test split). :meth:`MetricsWriter.finish`
    writes each as ``final/<name>`` like the others, so the dashboard shows metrics.json's
    value."""
    tags = [f"best/{monitor}", "best/epoch", "stopped_early"] if monitor else []
    return tags + [f"test/{name}" for name in test_metrics]


class Accumulator:
    """Named float64 sums (e.g. ``loss_sum``, ``correct``, ``num_samples``) of one rank.

    Tensor values are added on ``device`` (no host synchronisation); Python numbers, such as
    batch sizes the host already knows, are added on the host. ``reduce`` all-reduces every sum
    with SUM in a single collective, returns them as Python floats and resets them to zero.
    """

    def __init__(self, names: tuple[str, ...], device: torch.device):
        self.names = names
        self.index = {name: i for i, name in enumerate(names)}
        self.device_sums = torch.zeros(len(names), dtype=torch.float64, device=device)
        self.host_sums = [0.0] * len(names)

    def add(self, name: str, value: torch.Tensor | float, weight: float = 1.0) -> None:
        """Add ``weight * value`` (a scalar tensor or a number) to the sum ``name``."""
        i = self.index[name]
        if isinstance(value, torch.Tensor):
            self.device_sums[i].add_(value.detach(), alpha=weight)
        else:
            self.host_sums[i] += weight * value

    def reduce(self, extra: torch.Tensor | None = None
               ) -> dict[str, float] | tuple[dict[str, float], torch.Tensor]:
        """All-reduce the sums (and ``extra``, a float64 vector on the same device, in the same
        collective); returns the sums, or ``(sums, reduced extra)`` when ``extra`` is given."""
        host = torch.tensor(self.host_sums, dtype=torch.float64, device=self.device_sums.device)
        n = len(self.names)
        packed = self.device_sums + host if extra is None else torch.cat(
            [self.device_sums + host, extra])
        packed = all_reduce_sum(packed)
        totals = packed[:n].tolist()
        self.device_sums.zero_()
        self.host_sums = [0.0] * n
        sums = dict(zip(self.names, totals, strict=True))
        return sums if extra is None else (sums, packed[n:])


def mean(total: float, count: float) -> float | None:
    """``total / count``, or None for an empty count (e.g. no validation samples)."""
    return total / count if count else None


def flatten_hparams(cfg: Mapping[str, Any], prefix: str = "") -> dict[str, float | str]:
    """Flatten a resolved config into TensorBoard hparams: dotted keys, numbers as numbers,
    bools, lists and None as strings (the HParams plugin takes numbers, strings and bools only)."""
    out: dict[str, float | str] = {}
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_hparams(value, f"{name}."))
        elif isinstance(value, bool) or value is None or not isinstance(value, (int, float, str)):
            out[name] = str(value)
        else:
            out[name] = value
    return out


def write_json_atomic(path: str, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` as JSON (no NaN: see :func:`finite_or_none`) with :func:`atomic_write`."""
    text = json.dumps(payload, indent=2, sort_keys=True, allow_nan=False) + "\n"
    atomic_write(path, lambda fh: fh.write(text.encode()))


def finite_or_none(value: float | None) -> float | None:
    """JSON has no NaN: non-finite values are written as null."""
    return value if value is not None and math.isfinite(value) else None


class MetricsWriter:
    """Rank 0's outputs: ``<job_dir>/tensorboard/`` (one event stream), ``metrics.json`` and
    ``model.pt``.

    Args:
        job_dir: the job's output folder (Hydra's output dir), absolute.
        hparams: flat hyper-parameters for the HParams dashboard (see :func:`flatten_hparams`).
        enabled: False on every rank but 0: all methods then do nothing.
        purge_step: on resume, the checkpoint's global step + 1: TensorBoard hides what an
            earlier attempt logged after the checkpoint (steps >= purge_step).
        recipe_metrics: extra final metrics for HParams (:func:`recipe_hparam_metrics`).
        trackers: the ``logger`` group's other trackers (:mod:`ddp_exp.metrics.trackers`),
            fed every scalar written here (as TensorBoard holds it, float32) and the final
            metrics; None: TensorBoard only.
    """

    def __init__(self, job_dir: str, hparams: Mapping[str, float | str], enabled: bool,
                 purge_step: int | None = None, recipe_metrics: list[str] | tuple = (),
                 trackers: Trackers | None = None):
        self.job_dir = job_dir
        self.trackers = trackers
        self.recipe_metrics = list(recipe_metrics)
        self.writer = None
        self.tags: set[str] = set()  # scalar tags written so far (the dashboard layout's)
        self.queued: list[tuple[int, Mapping[str, Any], Any]] = []  # see queue_scalars
        self.queued_since = 0.0
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(job_dir, "tensorboard"),
                                    purge_step=purge_step)
        # The three HParams summaries go into this run's own writer; SummaryWriter.add_hparams
        # would open a new timestamped sub-run (pytorch #32651).
        metrics = (*HPARAM_METRICS, *self.recipe_metrics)
        for summary in hparams_summaries(hparams, metrics):
            self.writer.file_writer.add_summary(summary)

    def scalars(self, step: int, values: Mapping[str, float | torch.Tensor | None]) -> None:
        """Add each non-None value (a number or a one-element tensor) as a scalar at x =
        ``step`` (the global optimizer step).

        All of them go into one event (one ``Summary`` with a value per tag, what
        ``SummaryWriter.add_scalar`` writes one event each for): ~8 us per scalar instead of
        ~65 us, which matters at every logging step of the training loop (issue 13).
        """
        if self.writer is None:
            return
        from tensorboard.compat.proto.summary_pb2 import Summary

        entries = [Summary.Value(tag=tag, simple_value=float(value))
                   for tag, value in values.items() if value is not None]
        if entries:
            self.writer.file_writer.add_summary(Summary(value=entries), step)
            self.tags.update(entry.tag for entry in entries)
            if self.trackers is not None:  # the float32 values the event holds
                self.trackers.log(step, {e.tag: e.simple_value for e in entries})

    def queue_scalars(self, step: int, values: Mapping[str, float | torch.Tensor | None],
                      more: Callable[[], Mapping[str, float]] | None = None,
                      more_tags: Iterable[str] = ()) -> None:
        """:meth:`scalars`, later: keep ``values`` (numbers or one-element tensors, read when
        written) and write everything queued at :meth:`write_queued` or once the oldest entry
        is :data:`QUEUE_S` seconds old. The training loop's logging steps use it, so that
        TensorBoard's event encoding (a pure-Python CRC-32C per event, in the writer's
        thread, holding the GIL) runs after the epoch's loop, not between its steps (issue 13).
        The event file is flushed every 120 s anyway, so TensorBoard shows the same.

        ``more``: called when written, its scalars join ``values`` in the same event (work
        that can wait, such as the perf table's summary); ``more_tags``: the tags it returns,
        known now for the dashboard layout. Not called where nothing is written (ranks other
        than 0)."""
        if self.writer is None:
            return
        now = time.monotonic()
        if not self.queued:
            self.queued_since = now
        self.queued.append((step, values, more))
        self.tags.update(tag for tag, value in values.items() if value is not None)
        self.tags.update(more_tags)
        if now - self.queued_since >= QUEUE_S:
            self.write_queued()

    def write_queued(self) -> None:
        """Write what :meth:`queue_scalars` kept, in order."""
        queued, self.queued = self.queued, []
        for step, values, more in queued:
            self.scalars(step, values if more is None else {**values, **more()})

    def flush(self) -> None:
        """Write what is queued and wait until TensorBoard's writer thread has written every
        event to the file (rank 0). Called after each epoch's validation and checkpoint: the
        writer thread's work (a pure-Python CRC-32C per event, holding the GIL) is then done
        there, not during the next epoch's steps, and the event file is current after every
        epoch instead of every 120 s."""
        if self.writer is not None:
            self.write_queued()
            self.flush_events()
            if self.trackers is not None:
                self.trackers.flush()

    def flush_events(self) -> None:
        """Wait until every event added so far is in the event file (not what
        :meth:`write_queued` still holds). Safe on another thread than the one adding events
        (TensorBoard's ``AsyncWriter`` locks both): a step checkpoint's job on the background
        writer calls it before the checkpoint file lands, so the loop does not wait for it.
        A no-op off rank 0."""
        writer = self.writer
        if writer is not None:
            # a snapshot: add_hparams may add a writer on the loop's thread meanwhile
            for file_writer in list(writer.all_writers.values()):
                file_writer.flush()

    def records_on_disk(self) -> None:
        """Wait until every record added so far is written: TensorBoard's events
        (:meth:`flush_events`) and every tracker's rows
        (:meth:`ddp_exp.metrics.trackers.Trackers.sync`).
        A checkpoint's job on the background writer calls it before the checkpoint lands
        (:func:`ddp_exp.train.checkpointing.land`): a resume keeps the records before its step and
        writes the rest again, so none before it may be missing. A no-op off rank 0."""
        self.flush_events()
        if self.trackers is not None:
            self.trackers.sync()

    @property
    def enabled(self) -> bool:
        """True on rank 0 while the event stream is open."""
        return self.writer is not None

    def custom_scalars(self, layout: Mapping[str, Any]) -> None:
        """Write the Custom Scalars tab's layout (see :func:`ddp_exp.metrics.dashboard.layout`)."""
        if self.writer is not None:
            self.writer.add_custom_scalars(dict(layout))

    def histograms(self, step: int, values: Mapping[str, torch.Tensor]) -> None:
        """Add each tensor as a histogram at x = ``step``."""
        if self.writer is not None:
            for tag, tensor in values.items():
                self.writer.add_histogram(tag, tensor, step)

    def image(self, tag: str, picture: Any, step: int) -> None:
        """Add an RGB picture, ``uint8 [H, W, 3]`` (numpy), as an image at x = ``step``."""
        if self.writer is not None:
            self.writer.add_image(tag, picture, step, dataformats="HWC")

    def write_text(self, name: str, text: str) -> None:
        """Write ``<job_dir>/<name>`` atomically (rank 0 only)."""
        if self.writer is not None:
            atomic_write(os.path.join(self.job_dir, name), lambda fh: fh.write(text.encode()))

    def write_json(self, name: str, payload: Mapping[str, Any]) -> None:
        """Write ``<job_dir>/<name>`` atomically (rank 0 only)."""
        if self.writer is not None:
            write_json_atomic(os.path.join(self.job_dir, name), payload)

    def finish(self, final: Mapping[str, Any],
               model: torch.nn.Module | Mapping[str, torch.Tensor]) -> None:
        """Write the HParams metrics (``final/<key>``, float64, at x = ``final["global_step"]``),
        flush TensorBoard, write ``metrics.json`` and the trained weights ``model.pt`` (the
        unwrapped model's ``state_dict``, or that state dict itself, loadable with
        ``weights_only=True``)."""
        self.write_queued()
        if self.writer is None:
            return
        for key in (*HPARAM_METRICS, *self.recipe_metrics):
            value = final.get(key)
            if isinstance(value, bool):  # stopped_early: 0/1
                value = float(value)
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(FINAL_PREFIX + key, value, final.get("global_step"),
                                       new_style=True, double_precision=True)
        weights = model.state_dict() if isinstance(model, torch.nn.Module) else model
        state = {k: v.detach().cpu() for k, v in weights.items()}
        atomic_write(os.path.join(self.job_dir, "model.pt"), lambda fh: torch.save(state, fh))
        self.writer.flush()
        self.writer.close()
        self.writer = None
        write_json_atomic(os.path.join(self.job_dir, "metrics.json"),
                          {k: finite_or_none(v) if isinstance(v, float) else v
                           for k, v in final.items()})
        if self.trackers is not None:  # after metrics.json: a slow tracker delays nothing else
            self.trackers.finish(final.get("global_step") or 0, final)

    def close(self) -> None:
        """Close the event stream without writing metrics.json (on failure); what was queued
        is written first."""
        if self.writer is not None:
            self.write_queued()
            self.writer.close()
            self.writer = None
        if self.trackers is not None:
            self.trackers.close()
