"""Global metrics: reduction of per-rank sums and counts, and what rank 0 writes.

:class:`Accumulator` keeps float64 sums on the rank's device and reduces them across the world in
one all-reduce when asked, so the training loop never synchronises with the host per step.
:class:`MetricsWriter` is rank 0's TensorBoard run (scalars + HParams summaries in the run's own
event stream, never a stray sub-run) and ``metrics.json``; every other rank gets a writer that
does nothing, so the loop has no ``if rank == 0`` around its logging.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import torch

from ddp_exp.distributed import all_reduce_sum
from ddp_exp.files import atomic_write

# Final metrics paired with each run's scalars in TensorBoard's HParams dashboard.
HPARAM_METRICS = ("val/loss", "val/accuracy", "train/loss")


def recipe_hparam_metrics(monitor: str | None, test_metrics: list[str]) -> list[str]:
    """The recipe's final values (issue 15) shown in the HParams dashboard besides
    :data:`HPARAM_METRICS`: ``best/<monitor>``, ``best/epoch``, ``stopped_early`` (0/1) when a
    metric is monitored, and ``test/<name>`` for each name of ``test_metrics`` (``loss``,
    ``accuracy``, user metrics; empty without a test split). :meth:`MetricsWriter.finish`
    writes each as a scalar at the final step, so the dashboard shows metrics.json's value."""
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

    def reduce(self) -> dict[str, float]:
        host = torch.tensor(self.host_sums, dtype=torch.float64, device=self.device_sums.device)
        totals = all_reduce_sum(self.device_sums + host).tolist()
        self.device_sums.zero_()
        self.host_sums = [0.0] * len(self.names)
        return dict(zip(self.names, totals, strict=True))


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
    """

    def __init__(self, job_dir: str, hparams: Mapping[str, float | str], enabled: bool,
                 purge_step: int | None = None, recipe_metrics: list[str] | tuple = ()):
        self.job_dir = job_dir
        self.recipe_metrics = list(recipe_metrics)
        self.writer = None
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        self.writer = SummaryWriter(log_dir=os.path.join(job_dir, "tensorboard"),
                                    purge_step=purge_step)
        # The three HParams summaries go into this run's own writer; SummaryWriter.add_hparams
        # would open a new timestamped sub-run (pytorch #32651).
        metrics = {m: 0.0 for m in (*HPARAM_METRICS, *self.recipe_metrics)}
        for summary in hparams_summaries(dict(hparams), metrics):
            self.writer.file_writer.add_summary(summary)

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        """Add each non-None value as a scalar at x = ``step`` (the global optimizer step)."""
        if self.writer is None:
            return
        for tag, value in values.items():
            if value is not None:
                self.writer.add_scalar(tag, value, step)

    def finish(self, final: Mapping[str, Any], model: torch.nn.Module) -> None:
        """Flush TensorBoard, write ``metrics.json`` and the trained weights ``model.pt``
        (the unwrapped model's ``state_dict``, loadable with ``weights_only=True``)."""
        if self.writer is None:
            return
        recipe = {tag: final.get(tag) for tag in self.recipe_metrics}
        self.scalars(final.get("global_step", 0), {  # the HParams values (stopped_early: 0/1)
            k: float(v) if isinstance(v, bool) else v for k, v in recipe.items()})
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        atomic_write(os.path.join(self.job_dir, "model.pt"), lambda fh: torch.save(state, fh))
        self.writer.flush()
        self.writer.close()
        self.writer = None
        write_json_atomic(os.path.join(self.job_dir, "metrics.json"),
                          {k: finite_or_none(v) if isinstance(v, float) else v
                           for k, v in final.items()})

    def close(self) -> None:
        """Close the event stream without writing metrics.json (on failure)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
