"""What a run minimises and measures: the training loss and the validation metrics.

Both are **per-sample** functions ``(output [batch, k], target [batch] or [batch, k]) ->
values [batch]``, which is what makes every reported number exact for any world size: the batch
loss is their mean (the quantity whose gradient DDP averages), and a validation metric is the sum
over the whole validation set divided by its size, reduced across ranks as (sum, count).

Defaults: cross-entropy for class labels, mean squared error for regression targets, and
``val/accuracy`` for classification. Plug in your own with ``_target_`` (a function, or a class
instance, taking ``(output, target)`` and returning per-sample values):

    loss:
      _target_: my_project.losses.focal_loss
      _partial_: true
      gamma: 2.0
    metrics:
      top3:
        _target_: my_project.metrics.top_k_correct
        _partial_: true
        k: 3

and they are reported as ``train/loss``/``val/loss`` and ``val/top3``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ddp_exp.config import ConfigError, instantiate_node

PerSample = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy ``[batch]`` of logits ``[batch, C]`` and labels ``[batch]``."""
    return F.cross_entropy(output.float(), target, reduction="none")


def squared_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample mean squared error ``[batch]`` of ``[batch, k]`` outputs and targets."""
    return (output.float() - target).pow(2).mean(dim=1)


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample correctness ``[batch]`` (1.0 where ``argmax(output) == target``)."""
    return (output.argmax(dim=1) == target).float()


class Objective:
    """The loss and metrics of one run (see the module docstring).

    Args:
        num_classes: classes of the dataset, or 0 for regression.
        loss: a ``_target_`` node for a per-sample loss, or None for the default.
        metrics: name -> ``_target_`` node of a per-sample metric (added to the defaults).

    Raises:
        ConfigError: a target that cannot be built.
    """

    def __init__(self, num_classes: int, loss: Mapping[str, Any] | None = None,
                 metrics: Mapping[str, Mapping[str, Any]] | None = None):
        self.num_classes = num_classes
        self.custom_loss = loss is not None
        self.per_sample_loss: PerSample = (
            instantiate_node(loss, "loss") if loss is not None
            else cross_entropy if num_classes else squared_error)
        self.metrics: dict[str, PerSample] = {"accuracy": accuracy} if num_classes else {}
        for name, node in (metrics or {}).items():
            if not isinstance(node, Mapping) or "_target_" not in node:
                raise ConfigError(f"metrics.{name} needs a _target_ (a function of "
                                  "(output, target) returning per-sample values)")
            self.metrics[name] = instantiate_node(node, f"metrics.{name}")

    def batch_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean loss of a batch (a scalar); the built-in losses use torch's fused kernels."""
        if self.custom_loss:
            return self.per_sample_loss(output, target).mean()
        if self.num_classes:
            return F.cross_entropy(output, target)
        return F.mse_loss(output.float(), target)
