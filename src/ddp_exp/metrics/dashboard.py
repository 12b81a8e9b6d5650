"""What rank 0 adds to TensorBoard beyond the scalars: the one-glance custom-scalars layout and
parameter/gradient histograms.

The layout (``SummaryWriter.add_custom_scalars``, TensorBoard's "Custom Scalars" tab) puts
related curves on one chart. It is built from the tags the run actually writes, so it never
shows an empty chart: a run without ``perf/*`` (``trainer.perf_metrics=false``) has no "ranks"
chart, a CPU run no CUDA memory, a run without ``train/grad_norm`` no gradient chart.

Uses torch only; the loop uses it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

# category -> chart title -> the tags it draws together (in this order).
CHARTS: dict[str, dict[str, tuple[str, ...]]] = {
    "training": {
        "loss": ("train/loss", "val/loss"),
        "learning rate": ("train/lr",),
        "gradient norm": ("train/grad_norm",),
    },
    "distributed": {
        "throughput": ("train/samples_per_sec",),
        "ranks": ("perf/step_ms", "perf/compute_ms_min", "perf/compute_ms_max",
                  "perf/sync_wait_ms_max"),
        "data wait": ("perf/data_wait_fraction",),
        "straggler rank": ("perf/straggler_rank",),
        "memory": ("perf/max_rss_mb", "perf/cuda_max_allocated_mb"),
    },
}


def layout(tags: Iterable[str]) -> dict[str, dict[str, list]]:
    """The custom-scalars layout for a run that writes ``tags``: :data:`CHARTS` without the
    tags the run does not write, and without charts left empty.

    Returns:
        ``{category: {chart title: ["Multiline", [regex, ...]]}}`` as
        ``SummaryWriter.add_custom_scalars`` takes it; each regex matches exactly one tag
        (``^tag$``).
    """
    present = set(tags)
    out: dict[str, dict[str, list]] = {}
    for category, charts in CHARTS.items():
        chosen = {title: ["Multiline", [f"^{re.escape(t)}$" for t in wanted if t in present]]
                  for title, wanted in charts.items() if any(t in present for t in wanted)}
        if chosen:
            out[category] = chosen
    return out


def write_histograms(writer: Any, model: nn.Module, epoch: int, step: int, every: int) -> None:
    """Every ``trainer.log_histograms_every_n_epochs`` (``every``; 0: never) epochs, rank 0's
    ``writer`` (:class:`ddp_exp.metrics.writer.MetricsWriter`) adds :func:`histograms` of ``model``
    after (0-based) ``epoch`` at x = ``step``."""
    if every and (epoch + 1) % every == 0 and writer.enabled:
        writer.histograms(step, histograms(model))


def histograms(model: nn.Module) -> dict[str, torch.Tensor]:
    """``parameters/<name>`` and ``gradients/<name>`` of every parameter, on the CPU: the
    weights and the last step's gradients (after DDP's all-reduce, so the same on every rank;
    a parameter without a gradient gets no ``gradients/`` entry)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[f"parameters/{name}"] = p.detach().float().cpu()
        if p.grad is not None:
            out[f"gradients/{name}"] = p.grad.detach().float().cpu()
    return out
