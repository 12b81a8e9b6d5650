"""The split every rank receives: :class:`Datasets` (training, validation, test), the seeded
hold-out that makes it from one dataset (:func:`build_datasets`) and ``data.standardize``.

Both kinds of split it holds offer the same interface (``len``, ``input_shape``,
``num_classes``, ``num_outputs``, ``batch(positions)``, ``subset``): an
:class:`ddp_exp.data.arrays.ArrayDataset` or a :class:`ddp_exp.data.lazy.TorchSplit`.

May use: :mod:`ddp_exp.data.arrays`, :mod:`ddp_exp.config` (``ConfigError``), NumPy.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ddp_exp.config.errors import ConfigError
from ddp_exp.data.arrays import ArrayDataset


@dataclass
class Datasets:
    """The training, validation and test split handed to every rank: :class:`ArrayDataset` or
    :class:`ddp_exp.data.lazy.TorchSplit` (the training one carrying the augmentation); ``test`` is
    empty unless ``data.test_size`` > 0 or the data comes with a test split."""

    train: Any
    val: Any
    test: Any | None = None
    standardization: dict[str, Any] | None = None  # data.standardize's statistics, if used
    # Training items the launching process has read while loading (dataset index -> the item
    # as the dataset returned it): item 0 of a lazy dataset, read to learn the shapes. The
    # checks before the ranks start take it from here instead of reading it again
    # (ddp_exp.launch.build); emptied before the ranks start, which read every item themselves.
    items_read: dict[int, Any] = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return self.train.num_classes

    @property
    def in_memory(self) -> bool:
        """True for arrays held whole in memory (the fast path of :mod:`ddp_exp.data.loaders`)."""
        return isinstance(self.train, ArrayDataset)

    def fingerprint(self) -> dict[str, int]:
        """Sizes and a CRC-32 of the data (arrays: their bytes; lazy data: indices and the file
        list): what the nodes of a multi-node world compare, since each builds its own copy."""
        parts = (self.train, self.val, *([self.test] if self.test is not None else []))
        crc = zlib.crc32(str(tuple(part.fingerprint() for part in parts)).encode())
        return {"data.train_samples": len(self.train), "data.val_samples": len(self.val),
                "data.test_samples": len(self.test) if self.test is not None else 0,
                "data.crc32": crc}


def build_datasets(dataset, val_size: int, seed: int, world_size: int,
                   test_size: int = 0) -> Datasets:
    """Hold out ``val_size`` validation and ``test_size`` test samples, chosen by ``seed``
    alone (never by ``world_size``).

    ``dataset``: an :class:`ArrayDataset` or a :class:`ddp_exp.data.lazy.TorchSplit` of all samples.
    One seeded permutation of the samples: validation takes its first ``val_size`` entries,
    test its last ``test_size``, training the rest. So changing ``test_size`` never changes
    which samples are validation (nor ``val_size`` which are test); only training shrinks.
    Every part keeps the dataset's order (sorted indices); shuffling happens per epoch in the
    sampler.

    Raises:
        ConfigError: ``val_size`` + ``test_size`` leave fewer training samples than ranks.
    """
    n = len(dataset)
    if world_size > n:
        raise ConfigError(f"world_size={world_size} is invalid: the dataset has only {n} samples "
                          "and every rank needs a training sample")
    if val_size > n - world_size:
        raise ConfigError(f"data.val_size={val_size} is invalid: the dataset has {n} samples, so "
                          f"it must be at most {n - world_size} (every one of the {world_size} "
                          "ranks needs a training sample)")
    if test_size > n - world_size - val_size:
        raise ConfigError(f"data.test_size={test_size} is invalid: the dataset has {n} samples "
                          f"and data.val_size={val_size}, so it must be at most "
                          f"{n - world_size - val_size} (every one of the {world_size} ranks "
                          "needs a training sample)")
    perm = np.random.default_rng(seed).permutation(n)
    val_idx = np.sort(perm[:val_size])
    test_idx = np.sort(perm[n - test_size:]) if test_size else perm[:0]
    train_idx = np.sort(perm[val_size:n - test_size])
    return Datasets(train=dataset.subset(train_idx), val=dataset.subset(val_idx),
                    test=dataset.subset(test_idx))


def standardize(datasets: Datasets) -> Datasets:
    """``data.standardize=true``: every feature minus its mean, over its standard deviation,
    both computed on the training split alone (validation samples must not leak into training)
    in float64 and applied to both splits. A constant feature is only centred (std taken as 1).

    Returns:
        New datasets whose ``standardization`` holds ``mean`` and ``std`` (nested lists of the
        input shape), which rank 0 writes to ``standardization.json`` in the job folder.
    """
    features = datasets.train.features.astype(np.float64)
    mean = features.mean(axis=0)
    std = features.std(axis=0)
    std[std == 0] = 1.0

    def scaled(part: ArrayDataset) -> ArrayDataset:
        x = ((part.features.astype(np.float64) - mean) / std).astype(np.float32)
        return ArrayDataset(x, part.targets, part.num_classes, part.classes)

    stats = {"mean": mean.tolist(), "std": std.tolist(),
             "rule": "x_scaled = (x - mean) / std, statistics of the training split"}
    return Datasets(scaled(datasets.train), scaled(datasets.val), scaled(datasets.test), stats)
