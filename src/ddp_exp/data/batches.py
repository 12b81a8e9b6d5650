"""What a batch's inputs may be and how a model is called on them: a tensor (``model(x)``), a
tuple (positional arguments), a mapping (keyword arguments, a Hugging Face tokenized item) or a
:class:`Call` (a padded batch with its ``attention_mask``); :func:`to_device` moves any of them.

Uses torch only; :mod:`ddp_exp.train.objective`, :mod:`ddp_exp.train.loop`,
:mod:`ddp_exp.train.evaluation` and
:mod:`ddp_exp.data.lazy` use it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ddp_exp.compat.tensors import compiled_original


def call_model(model: Callable[..., Any], x: Any) -> Any:
    """``model(x)`` for a tensor, ``model(*x)`` for a tuple, ``model(**x)`` for a mapping, and
    ``model(*x.args, **x.kwargs)`` for :class:`Call` (a padded batch with its attention mask,
    the mask dropped for a model whose ``forward`` takes none)."""
    if isinstance(x, torch.Tensor):
        return model(x)
    if isinstance(x, Call):
        kwargs = x.kwargs if _takes_mask(model) else {}
        return model(*x.args, **kwargs)
    if isinstance(x, Mapping):
        return model(**x)
    return model(*x)


class Call:
    """Positional and keyword arguments of a model call: a padded batch of tensor inputs with
    ``attention_mask`` (:func:`call_model` passes the mask where ``forward`` accepts one)."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple, kwargs: dict):
        self.args, self.kwargs = args, kwargs


_MASK_TAKERS: dict[type, bool] = {}


def _takes_mask(model: Any) -> bool:
    """Whether ``model``'s forward (the wrapped module's, under DDP / compile) accepts
    ``attention_mask`` (or ``**kwargs``); looked up once per class."""
    import inspect

    inner = model
    while hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):
        inner = inner.module
    inner = compiled_original(inner)  # a model its _target_ returned compiled
    kind = type(inner)
    if kind not in _MASK_TAKERS:
        try:
            params = inspect.signature(inner.forward).parameters.values()
            _MASK_TAKERS[kind] = any(p.name == "attention_mask" or p.kind is p.VAR_KEYWORD
                                     for p in params)
        except (TypeError, ValueError):
            _MASK_TAKERS[kind] = False
    return _MASK_TAKERS[kind]


def to_device(x: Any, device: torch.device) -> Any:
    """A batch's inputs or targets (a tensor, tuple, mapping or :class:`Call`) on ``device``
    (``non_blocking``: pinned host batches copy asynchronously)."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, Call):
        return Call(to_device(x.args, device), to_device(x.kwargs, device))
    if isinstance(x, Mapping):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return tuple(to_device(v, device) for v in x)
    return x
