"""What a run minimises and measures: the training loss and the validation metrics.

Both are **per-sample** functions ``(output [batch, k], target [batch] or [batch, k]) ->
values [batch]``, which is what makes every reported number exact for any world size: the batch
loss is their mean (the quantity whose gradient DDP averages), and a validation metric is the sum
over the whole validation set divided by its size, reduced across ranks as (sum, count).
For class labels per element (``[batch, *dims]``: tokens, pixels) the unit is the counted element
instead (label != ``data.ignore_index``): :meth:`Objective.element_terms` gives a batch's (loss
sum, count), and functions may return values of the target's shape (docs/sequences.md).

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

from ddp_exp.config.errors import ConfigError, described
from ddp_exp.config.targets import find_target, instantiate_node
from ddp_exp.data.batches import Call, call_model

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
        wanted = target.shape if target.dim() > 1 and not target.is_floating_point() else (
            len(output),)
        if not isinstance(values, torch.Tensor) or values.shape != wanted:
            shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values)
            raise ConfigError(f"{key} must return one value per sample (per element for "
                              f"per-element labels), shape {list(wanted)}; got {shape} (for a "
                              "torch loss pass reduction='none')")
        return values

    return checked


class Objective:
    """The loss and metrics of one run (see the module docstring).

    Args:
        num_classes: classes of the dataset, or 0 for regression.
        loss: a ``_target_`` node for a per-sample loss, or None for the default.
        metrics: name -> ``_target_`` node of a per-sample metric (added to the defaults).
        output_key: the key of a model's mapping output (``trainer.output_key``).
        class_dim: ``"last"`` (logits ``[B, *dims, C]``, language models) or ``1``
            (``[B, C, *dims]``, segmentation) for per-element class labels ``[B, *dims]``
            (``trainer.class_dim``).
        ignore_index: the label of elements that count nowhere (``data.ignore_index``).

    Raises:
        ConfigError: a target that cannot be built.
    """

    def __init__(self, num_classes: int, loss: Mapping[str, Any] | None = None,
                 metrics: Mapping[str, Mapping[str, Any]] | None = None,
                 output_key: str = "logits", class_dim: str | int = "last",
                 ignore_index: int = -100):
        if str(class_dim) not in ("last", "1"):
            raise ConfigError(f"trainer.class_dim={class_dim!r} is invalid: last (logits "
                              "[batch, *dims, classes], language models) or 1 ([batch, classes, "
                              "*dims], segmentation models)")
        self.num_classes = num_classes
        self.output_key = output_key
        self.class_last = str(class_dim) != "1"
        self.ignore_index = ignore_index
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

    def output(self, out: Any) -> torch.Tensor:
        """The model's output tensor: ``out`` itself, a tuple's first element, or a mapping's
        ``trainer.output_key``."""
        if isinstance(out, torch.Tensor):
            return out
        if isinstance(out, Mapping):
            return out[self.output_key]
        return out[0]

    def elementwise(self, target: torch.Tensor) -> bool:
        """Whether ``target`` holds class labels per element (``[B, *dims]``, dims not
        empty): the unit of every loss and metric is then the counted element."""
        return bool(self.num_classes) and target.dim() > 1

    def _class_first(self, output: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, C, *dims]`` (torch's layout) from either ``trainer.class_dim``."""
        return output.movedim(-1, 1) if self.class_last else output

    def element_terms(self, output: torch.Tensor, target: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-element targets ``[B, *dims]``: the loss summed over the counted elements
        (label != ``ignore_index``; a scalar, 0 with a graph when none counts) and their count
        (an int64 scalar tensor), both on the output's device.

        Raises:
            ValueError: the output's shape does not fit the targets at this step, as
                :meth:`batch_loss`.
        """
        mask = target != self.ignore_index
        if self.custom_loss:
            values = self.per_sample_loss(output, target)
            total = torch.where(mask, values, torch.zeros((), dtype=values.dtype,
                                                          device=values.device)).sum()
        else:
            try:
                total = F.cross_entropy(self._class_first(output).float(), target,
                                        ignore_index=self.ignore_index, reduction="sum")
            except (IndexError, RuntimeError, ValueError) as exc:
                raise self._shape_failure(output, target, exc) from exc
        return total, mask.sum()

    def metric_sums(self, output: torch.Tensor, target: torch.Tensor
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | int]:
        """Validation terms of one batch: (loss sum, metric name -> sum, count), all over
        samples, or over counted elements for per-element targets."""
        if not self.elementwise(target):
            return (self.per_sample_loss(output, target).double().sum(),
                    {n: m(output, target).double().sum() for n, m in self.metrics.items()},
                    len(target))
        total, count = self.element_terms(output, target)
        mask = target != self.ignore_index
        sums = {}
        for name, fn in self.metrics.items():
            if fn is accuracy:
                values = (self._class_first(output).argmax(dim=1) == target)
            else:
                values = fn(output, target)
            sums[name] = (values.double() * mask).sum()
        return total.double(), sums, count

    def batch_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean loss of a batch (a scalar); the built-in losses use torch's fused kernels.

        Raises:
            ValueError: the output's shape does not fit the targets at this step (the model
                changed it after the check before the run, :meth:`check`), naming both
                shapes, where torch's own error named neither ("Target 7 is out of
                bounds").
        """
        if self.custom_loss:
            return self.per_sample_loss(output, target).mean()
        try:
            if self.num_classes:
                return F.cross_entropy(output, target)
            return F.mse_loss(output.float(), target)
        except (IndexError, RuntimeError, ValueError) as exc:
            raise self._shape_failure(output, target, exc) from exc

    def _shape_failure(self, output: torch.Tensor, target: torch.Tensor,
                       exc: Exception) -> Exception:
        """``exc`` (the built-in loss's failure), or a ValueError naming the output's and the
        targets' shapes where they do not fit (:func:`output_shape_error`)."""
        why = output_shape_error(tuple(output.shape), tuple(target.shape), self.num_classes,
                                 class_last=self.class_last)
        if why is None:
            return exc
        return ValueError(f"model: at this step {why}; the check before the run saw the "
                          "right shape, so the model's forward changed it")

    @torch.no_grad()
    def check(self, model: torch.nn.Module, features: Any, targets: torch.Tensor
              ) -> None:
        """One forward of ``model`` on a few samples through the loss and every metric, in the
        launching process, so that a model or objective that cannot work fails before any rank
        starts: the output (a tensor, a tuple's first element or a mapping's
        ``trainer.output_key``) must have the shape the data needs
        (:func:`output_shape_error`), and the loss and every metric must run on it and give one
        value per sample (or per element, for per-element targets).

        Args:
            features: ``[batch, *input_shape]`` (or a tuple / mapping / :class:`Call` of
                tensors); targets: ``[batch]`` labels, ``[batch, k]`` values or
                ``[batch, *dims]`` labels per element.

        Raises:
            ConfigError: the forward fails, the output is not a tensor, a tuple or a mapping
                holding ``trainer.output_key``, or has the wrong shape, or the loss or a metric
                fails on it or is not per-sample; every element of the batch is ignored; one
                line naming ``model``, ``loss`` or ``metrics.<name>``.
        """
        was_training = model.training
        model.eval()
        try:
            output = call_model(model, features)
        except Exception as exc:
            raise ConfigError(f"model: a forward pass on samples of shape "
                              f"{_input_shape(features)} failed: {described(exc)}") from None
        finally:
            model.train(was_training)
        batch = len(targets)
        if isinstance(output, Mapping) and self.output_key not in output:
            raise ConfigError(f"trainer.output_key={self.output_key!r} is not a key of the "
                              f"model's output, {_describe(output, batch)}; set "
                              "trainer.output_key=<key>")
        if isinstance(output, Mapping):
            output = output[self.output_key]
        elif isinstance(output, (tuple, list)) and output:
            output = output[0]
        if not isinstance(output, torch.Tensor):
            raise ConfigError(f"model: the forward returned {_describe(output, batch)}, "
                              "not a tensor: a model must return a tensor [batch, outputs], a "
                              "tuple whose first element is one, or a mapping holding "
                              "trainer.output_key")
        if self.elementwise(targets) and not bool((targets != self.ignore_index).any()):
            raise ConfigError(f"data: every target element of the first training samples is "
                              f"data.ignore_index={self.ignore_index}: there is nothing to learn"
                              " (check data.target_key, data.shift_labels and the labels)")
        problem = output_shape_error(tuple(output.shape), tuple(targets.shape),
                                     self.num_classes, builtin_loss=not self.custom_loss,
                                     class_last=self.class_last)
        if problem:
            raise ConfigError(f"model: {problem}")
        for key, fn in [("loss", self.per_sample_loss),
                        *((f"metrics.{name}", m) for name, m in self.metrics.items())]:
            try:
                if key == "loss" and self.elementwise(targets):
                    self.element_terms(output, targets)
                elif key != "loss" and self.elementwise(targets):
                    self.metric_sums(output, targets)
                else:
                    fn(output, targets)
            except ConfigError:
                raise
            except Exception as exc:  # a user's loss or metric that cannot take this output
                batch = len(targets)
                raise ConfigError(f"{key}: failed on the model's output "
                                  f"{_shape(tuple(output.shape), batch)} and targets "
                                  f"{_shape(tuple(targets.shape), batch)}: {described(exc)}"
                                  ) from None


def output_shape_error(output_shape: tuple[int, ...], target_shape: tuple[int, ...],
                       num_classes: int, builtin_loss: bool = True,
                       class_last: bool = False) -> str | None:
    """Why a model's output of ``output_shape`` does not fit targets of ``target_shape``, or
    None when it does. The one rule for every task (the shapes of ``torch.nn.functional``'s
    losses):

    * classification (``num_classes > 0``, the dataset's classes, not the labels a batch
      happens to hold): labels ``[batch]`` need logits ``[batch, num_classes]``; labels per
      element ``[batch, *rest]`` need ``[batch, *rest, num_classes]`` (``class_last``,
      ``trainer.class_dim=last``) or ``[batch, num_classes, *rest]`` (``class_dim=1``).
      Checked whatever the loss: ``val/accuracy`` takes the argmax over the class dimension.
    * regression (``num_classes == 0``): the output has the target's shape exactly
      (``[batch, k]``); broadcasting ``[batch, 3]`` or ``[batch]`` against ``[batch, 1]``
      would train on a wrong loss without an error. Checked for the built-in loss only
      (``builtin_loss``): a user's ``loss._target_`` decides what it takes (a mean and a
      variance per target, for instance).

    Args:
        output_shape, target_shape: full shapes, batch dimension first.
        num_classes: the dataset's number of classes, 0 for regression.
        builtin_loss: the run uses the default loss (no ``loss._target_``).
    """
    batch, rest = target_shape[0], tuple(target_shape[1:])
    if num_classes:
        wanted: tuple[int, ...] | None = ((batch, *rest, num_classes) if rest and class_last
                                           else (batch, num_classes, *rest))
        why = f"{num_classes} classes"
        if rest:
            why += (", trainer.class_dim=last" if class_last else ", trainer.class_dim=1")
    else:
        wanted = tuple(target_shape) if builtin_loss else None
        why = "regression: the target's shape"
    if wanted is None or tuple(output_shape) == wanted:
        return None
    return (f"the output has shape {_shape(output_shape, batch)} but the targets have shape "
            f"{_shape(target_shape, batch)}: the model must return {_shape(wanted, batch)} "
            f"({why})")


def _input_shape(features: Any) -> str:
    """The per-sample shape(s) of a batch's inputs, for a one-line message."""
    if isinstance(features, torch.Tensor):
        return str(list(features.shape[1:]))
    if isinstance(features, Call):
        features = features.args
    if isinstance(features, Mapping):
        return "{" + ", ".join(f"{k!r}: {list(v.shape[1:])}" for k, v in features.items()
                               if isinstance(v, torch.Tensor)) + "}"
    return str([list(v.shape[1:]) for v in features if isinstance(v, torch.Tensor)])


def _shape(shape: tuple[int, ...], batch: int) -> str:
    """``[batch, 5]`` for a shape whose first dimension is the batch's, else ``[1, 5]``."""
    dims = [str(d) for d in shape]
    if dims and shape[0] == batch:
        dims[0] = "batch"
    return f"[{', '.join(dims)}]"


def _describe(value: Any, batch: int) -> str:
    """What a model returned, for a one-line refusal: a dict with its keys, a tuple or list
    with its length and the types (and tensor shapes) of its items."""
    def one(v: Any) -> str:
        return (f"tensor {_shape(tuple(v.shape), batch)}" if isinstance(v, torch.Tensor)
                else type(v).__name__)

    if isinstance(value, Mapping):
        keys = ", ".join(f"{k!r}: {one(v)}" for k, v in list(value.items())[:5])
        return f"a {type(value).__name__} {{{keys}}}"
    if isinstance(value, (tuple, list)):
        items = ", ".join(one(v) for v in value[:5])
        return f"a {type(value).__name__} of {len(value)} ({items})"
    return f"a {type(value).__name__}"
