"""Built-in models, and :func:`build_model` which instantiates ``cfg.model`` for a dataset.

Every model takes ``input_shape`` (one sample's shape, e.g. ``(1, 8, 8)``) and ``num_outputs``
(classes, or regression targets) from the dataset, so ``model=mlp`` works on any data without
extra overrides. A user's own ``nn.Module`` plugs in with ``model._target_=pkg.Class``; it
receives ``input_shape`` and/or ``num_outputs`` only if its constructor accepts them (or
``**kwargs``) and the config does not already set them.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence

import torch
from omegaconf import DictConfig
from torch import nn

from ddp_exp.config.errors import ConfigError
from ddp_exp.config.targets import instantiate_node, locate


class MLP(nn.Module):
    """Flatten, then ``Linear -> ReLU [-> Dropout]`` per hidden size, then a linear head.

    Input ``[batch, *input_shape]``, output ``[batch, num_outputs]``.
    """

    def __init__(self, input_shape: Sequence[int], num_outputs: int,
                 hidden_sizes: Sequence[int] = (128,), dropout: float = 0.0):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for size in hidden_sizes:
            layers += [nn.Linear(width, size), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = size
        layers.append(nn.Linear(width, num_outputs))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """``Conv3x3 [-> BatchNorm2d] -> ReLU`` per channel count (2x2 max-pool after each while the
    image is at least 4 pixels wide), then ``Linear -> ReLU -> Linear``.

    Input ``[batch, C, H, W]`` (digits: ``[batch, 1, 8, 8]``), output ``[batch, num_outputs]``.

    Raises:
        ConfigError: the data is not image-shaped.
    """

    def __init__(self, input_shape: Sequence[int], num_outputs: int,
                 channels: Sequence[int] = (32, 64), hidden_size: int = 128,
                 batch_norm: bool = False):
        super().__init__()
        if len(input_shape) != 3:
            raise ConfigError(f"model=cnn needs image-shaped data [C, H, W]; this dataset gives "
                              f"samples of shape {list(input_shape)} (use model=mlp)")
        c, h, w = input_shape
        layers: list[nn.Module] = []
        for out in channels:
            layers.append(nn.Conv2d(c, out, kernel_size=3, padding=1))
            if batch_norm:  # see ddp.sync_batchnorm for BatchNorm over the global batch
                layers.append(nn.BatchNorm2d(out))
            layers.append(nn.ReLU())
            if min(h, w) >= 4:
                layers.append(nn.MaxPool2d(2))
                h, w = h // 2, w // 2
            c = out
        layers += [nn.Flatten(), nn.Linear(c * h * w, hidden_size), nn.ReLU(),
                   nn.Linear(hidden_size, num_outputs)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Linear(nn.Module):
    """One linear layer on the flattened input.

    Input ``[batch, *input_shape]``, output ``[batch, num_outputs]``.
    """

    def __init__(self, input_shape: Sequence[int], num_outputs: int):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_model(node: DictConfig | dict, input_shape: Sequence[int], num_outputs: int
                ) -> nn.Module:
    """Instantiate ``node`` (``cfg.model``, a ``_target_`` node as ``instantiate`` takes it;
    the launching process builds the model) with the dataset's sizes.

    Raises:
        ConfigError: the target cannot be imported or does not build an ``nn.Module``.
    """
    target = node["_target_"]
    factory = locate(target, "model._target_")
    try:
        params = inspect.signature(factory).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    except (TypeError, ValueError):
        params, takes_any = {}, True
    sizes = {"input_shape": tuple(input_shape), "num_outputs": int(num_outputs)}
    kwargs = {k: v for k, v in sizes.items() if k not in node and (takes_any or k in params)}
    model = instantiate_node(node, "model", **kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model._target_={target!r} built a {type(model).__name__}, "
                          "not a torch.nn.Module")
    return model
