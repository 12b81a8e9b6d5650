"""What a run minimises and measures: the training loss and the validation metrics.

Both are **per-sample** functions ``(output [batch, k], target [batch] or [batch, k]) ->
values [batch]``, which is what makes every reported number exact for any world size: the batch
loss is their mean (the quantity whose gradient DDP averages), and a validation metric is the sum
over the whole validation set divided by its size, reduced across ranks as (sum, count).

Defaults: cross-entropy for class labels, mean squared error for regression targets, and
``val/accuracy`` for classification. Plug in your own with ``_target_`` (a function, or a class
instance, taking ``(output, target)`` and returning per-sample values; a function's options
are bound to it, ``_partial_: true`` being implied):

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

from ddp_exp.config import ConfigError, find_target, instantiate_node

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


def build_function(node: Mapping[str, Any], key: str) -> PerSample:
    """Build a loss/metric node: a function ``_target_`` is taken as it is, with the node's
    options bound (``_partial_: true`` implied, so a bare function needs no flag); a class is
    instantiated with them (e.g. ``torch.nn.CrossEntropyLoss`` with ``reduction: none``).

    Raises:
        ConfigError: the target cannot be imported or rejects its options.
    """
    import inspect

    node = dict(node)
    if "_partial_" not in node:
        target = find_target(str(node.get("_target_")))  # None: instantiate_node reports it
        if target is not None and not inspect.isclass(target):
            node["_partial_"] = True
    return instantiate_node(node, key)


def _per_sample(fn: PerSample, key: str) -> PerSample:
    """Wrap a user function so that a result that is not one value per sample fails loudly:
    a batch-mean loss (PyTorch's default ``reduction='mean'``) would silently make every
    reported mean wrong. A shape check on the host: no device sync."""
    if not callable(fn):
        raise ConfigError(f"{key}._target_ built a {type(fn).__name__}, not a function of "
                          "(output, target); add _partial_: true for a function with options")

    def checked(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        values = fn(output, target)
        if not isinstance(values, torch.Tensor) or values.shape != (len(output),):
            shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values)
            raise ConfigError(f"{key} must return one value per sample, shape [{len(output)}]; "
                              f"got {shape} (for a torch loss pass reduction='none')")
        return values

    return checked


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
            _per_sample(build_function(loss, "loss"), "loss") if loss is not None
            else cross_entropy if num_classes else squared_error)
        self.metrics: dict[str, PerSample] = {"accuracy": accuracy} if num_classes else {}
        for name, node in (metrics or {}).items():
            if not isinstance(node, Mapping) or "_target_" not in node:
                raise ConfigError(f"metrics.{name} needs a _target_ (a function of "
                                  "(output, target) returning per-sample values)")
            self.metrics[name] = _per_sample(build_function(node, f"metrics.{name}"),
                                             f"metrics.{name}")

    def batch_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean loss of a batch (a scalar); the built-in losses use torch's fused kernels."""
        if self.custom_loss:
            return self.per_sample_loss(output, target).mean()
        if self.num_classes:
            return F.cross_entropy(output, target)
        return F.mse_loss(output.float(), target)

    @torch.no_grad()
    def check(self, model: torch.nn.Module, features: torch.Tensor, targets: torch.Tensor
              ) -> None:
        """One forward of ``model`` on a few samples through the loss and every metric, in the
        launching process, so that a model or objective that cannot work fails before any rank
        starts.

        Raises:
            ConfigError: a wrong output shape, or a loss or metric that is not per-sample.
        """
        was_training = model.training
        model.eval()
        try:
            output = model(features)
        except Exception as exc:
            raise ConfigError(f"model: a forward pass on samples of shape "
                              f"{list(features.shape[1:])} failed: {exc}") from None
        finally:
            model.train(was_training)
        self.per_sample_loss(output, targets)
        for metric in self.metrics.values():
            metric(output, targets)
