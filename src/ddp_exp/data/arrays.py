"""In-memory arrays: a whole dataset held as NumPy arrays (:class:`ArrayDataset`), the fast
path for small data, and the built-in ones: scikit-learn's digits and seeded synthetic data.

May use: NumPy (torch only inside :meth:`ArrayDataset.batch`); nothing else of ddp_exp.
"""

from __future__ import annotations

import importlib.util
import math
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class ArrayDataset:
    """A whole dataset in memory.

    Attributes:
        features: float32 array ``[N, *input_shape]``.
        targets: int64 class labels ``[N]`` (classification) or float32 ``[N, num_outputs]``
            (regression).
        num_classes: number of classes, or 0 for regression.
        classes: the class names of labels ``0..C-1`` where the data named its classes (a
            file's string labels, sorted: :mod:`ddp_exp.data.user_file`), else None.
    """

    features: np.ndarray
    targets: np.ndarray
    num_classes: int
    classes: tuple[str, ...] | None = None

    def __len__(self) -> int:
        return len(self.features)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample, e.g. ``(1, 8, 8)`` for digits."""
        return tuple(self.features.shape[1:])

    @property
    def num_outputs(self) -> int:
        """Width of the model's output: classes, or regression targets."""
        return self.num_classes if self.num_classes else int(self.targets.shape[1])

    random = False  # batches never depend on random draws

    def subset(self, indices: np.ndarray) -> ArrayDataset:
        return ArrayDataset(self.features[indices], self.targets[indices], self.num_classes,
                            self.classes)

    def batch(self, positions: Sequence[int], items_read: Any = None):
        """Samples at ``positions`` as tensors ``(x [B, ...] float32, y [B] or [B, k])``.
        ``items_read`` is :meth:`ddp_exp.data.lazy.TorchSplit.batch`'s; arrays ignore it."""
        import torch

        del items_read

        idx = np.asarray(positions, dtype=np.int64)
        return torch.from_numpy(self.features[idx]), torch.from_numpy(self.targets[idx])

    def fingerprint(self) -> int:
        """CRC-32 of both arrays (zlib, ~1 GB/s)."""
        crc = zlib.crc32(np.ascontiguousarray(self.features))
        return zlib.crc32(np.ascontiguousarray(self.targets), crc)


def load_digits() -> ArrayDataset:
    """scikit-learn's 8x8 digits: features ``[1797, 1, 8, 8]`` scaled to [0, 1], 10 classes.

    Reads the CSV that scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``) directly,
    which skips importing scikit-learn (about 1 s); the values equal ``sklearn.datasets.
    load_digits()`` (tested). Falls back to that function if the file moves.
    """
    spec = importlib.util.find_spec("sklearn")
    path = None
    if spec is not None and spec.submodule_search_locations:
        candidate = os.path.join(spec.submodule_search_locations[0], "datasets", "data",
                                 "digits.csv.gz")
        path = candidate if os.path.exists(candidate) else None
    if path is not None:
        table = np.loadtxt(path, delimiter=",", dtype=np.float64)
        pixels, labels = table[:, :-1], table[:, -1].astype(np.int64)
    else:  # pragma: no cover - depends on scikit-learn's layout
        from sklearn.datasets import load_digits as sk_load_digits

        bunch = sk_load_digits()
        pixels, labels = bunch.data, bunch.target.astype(np.int64)
    features = (pixels / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    return ArrayDataset(features, labels, num_classes=10)


def make_synthetic(num_samples: int, num_features: int, num_classes: int = 0,
                   noise_std: float = 0.1, seed: int = 0) -> ArrayDataset:
    """Seeded synthetic data with standard-normal features ``[num_samples, num_features]``.

    ``num_classes == 0``: regression, ``y = x @ w / sqrt(num_features) + noise_std * e``,
    targets ``[N, 1]``. ``num_classes = k``: labels ``argmax(x @ W + noise_std * e)`` of a random
    linear teacher ``W: [num_features, k]``.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_samples, num_features), dtype=np.float32)
    width = num_classes if num_classes else 1
    teacher = rng.standard_normal((num_features, width), dtype=np.float32) / math.sqrt(num_features)
    scores = x @ teacher + noise_std * rng.standard_normal((num_samples, width), dtype=np.float32)
    if num_classes:
        return ArrayDataset(x, scores.argmax(axis=1).astype(np.int64), num_classes)
    return ArrayDataset(x, scores.astype(np.float32), 0)
