"""Collating a lazy split's items into a batch: inputs stacked, padded to the longest item
when lengths differ (``data.pad_value``, with an attention mask), tuples element by element,
mappings key by key, then the split's batch transform run with each sample's key of its draws.

:class:`ddp_exp.data.lazy.TorchSplit` reads the items and calls :func:`collate_inputs`; its
per-element targets are padded by :func:`pad_stack` too.

May use: :mod:`ddp_exp.data.batches` (``Call``), :mod:`ddp_exp.data.seeds` (a sample's seed),
:mod:`ddp_exp.config` (``ConfigError``), torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ddp_exp.config.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Padding:
    """How items of different lengths are collated (``data.pad_value``, ``data.ignore_index``,
    ``data.shift_labels``)."""

    pad_value: float = 0
    ignore_index: int = -100
    shift_labels: bool = False


def pad_stack(values: list, fill: float, where: str) -> tuple[Any, Any]:
    """Stack tensors of one rank, padded at the end of every dimension to the longest with
    ``fill``; returns ``(batch, mask)``, ``mask`` being None when nothing was padded, else a
    bool ``[B, L]`` over the first dimension (True where an item has a value).

    Raises:
        ConfigError: items of different numbers of dimensions.
    """
    import torch

    first = values[0].shape
    if all(v.shape == first for v in values):
        return torch.stack(values), None
    if any(v.dim() != len(first) or v.dim() == 0 for v in values):
        raise ConfigError(f"data: {where} have different numbers of dimensions "
                          f"({sorted({v.dim() for v in values})}); items may differ in length, "
                          "not in rank")
    size = [max(v.shape[d] for v in values) for d in range(len(first))]
    out = torch.full((len(values), *size), fill, dtype=values[0].dtype)
    mask = torch.zeros(len(values), size[0], dtype=torch.bool)
    for i, v in enumerate(values):
        out[(i, *(slice(0, n) for n in v.shape))] = v
        mask[i, :v.shape[0]] = True
    return out, mask


def _float_input(x):
    """Floating inputs (and bytes: images) as float32; integer ids keep their dtype."""
    import torch

    return x.to(torch.float32) if x.is_floating_point() or x.dtype == torch.uint8 else x


def collate_inputs(xs: list, padding: Padding, transform, keys=None) -> Any:
    """Inputs of a batch: tensors stacked (a :class:`ddp_exp.train.objective.Call` with an
    ``attention_mask`` when items were padded), tuples element by element, mappings key by
    key (``attention_mask`` padded with 0). ``keys``: each sample's key of its draws
    (:func:`ddp_exp.data.seeds.sample_keys`), handed to a ``keyed`` transform, else the
    transform runs per sample under its key (:func:`_per_sample`)."""
    from ddp_exp.data.batches import Call

    first = xs[0]
    if isinstance(first, Mapping):
        out = {}
        for key in first:
            fill = 0 if key == "attention_mask" else padding.pad_value
            out[key] = _float_input(pad_stack([x[key] for x in xs], fill,
                                              f"dataset items' input {key!r}")[0])
        return out
    if isinstance(first, tuple):
        return tuple(_float_input(pad_stack([x[i] for x in xs], padding.pad_value,
                                            f"dataset items' input {i}")[0])
                     for i in range(len(first)))
    try:
        x, mask = pad_stack(xs, padding.pad_value, "dataset items' inputs")
    except ConfigError:
        raise ConfigError("data: dataset items have different input shapes; resize them in the "
                          "dataset (data.image_size for image folders)") from None
    if mask is not None and transform is None:
        return Call((_float_input(x),), {"attention_mask": mask.long()})
    if transform is None:
        return _float_input(x)
    if keys is None:
        return transform(x)
    return transform(x, keys=keys) if getattr(transform, "keyed", False) else \
        _per_sample(transform, x, keys)


TRANSFORM_SALT = 0x5DEECE66D  # a sample's transform draws from its key mixed with this


def _per_sample(transform, x, keys) -> Any:
    """A batch transform run on each sample ``x[i:i+1]`` with the global RNGs seeded from its
    key, so that its draws follow the sample, not the batch (the caller puts the RNGs back)."""
    import torch

    from ddp_exp.data.seeds import reseed

    rows = []
    for i, key in enumerate(keys):
        reseed(int(key) ^ TRANSFORM_SALT)  # not the stream the item's read drew from
        rows.append(transform(x[i:i + 1]))
    return torch.cat(rows)
