"""Datasets of the user's own: a function returning ddp_exp's ArrayDataset (in memory), a
map-style torch Dataset class (lazy), and a Hugging Face dataset."""

import numpy as np
import torch
from sklearn.datasets import load_digits as sklearn_digits
from sklearn.datasets import load_wine as sklearn_wine

from ddp_exp.data import ArrayDataset


def load_wine(standardize: bool = True) -> ArrayDataset:
    """scikit-learn's bundled wine recognition data: 178 samples, 13 features, 3 classes.

    ``standardize`` uses the statistics of the whole file, validation samples included, which
    is enough for an example; a real project would compute them on its training split.
    """
    bunch = sklearn_wine()
    x = bunch.data.astype(np.float64)
    if standardize:
        x = (x - x.mean(axis=0)) / x.std(axis=0)
    return ArrayDataset(x.astype(np.float32), bunch.target.astype(np.int64), num_classes=3)


class DigitsImages(torch.utils.data.Dataset):
    """The map-style ``Dataset`` every DDP tutorial starts with: ``__len__`` and ``__getitem__``
    returning ``(input, target)``, here the 8x8 digits as ``float32 [1, 8, 8]`` and their label.
    Anything lazy works the same way (open a file, decode an image in ``__getitem__``); ddp_exp
    shards it with a DistributedSampler and reads it in DataLoader workers
    (``data.num_workers``).

    ``classes`` tells ddp_exp the number of classes (else set ``data.num_classes``).
    """

    classes = [str(d) for d in range(10)]

    def __init__(self, noise_std: float = 0.0):
        bunch = sklearn_digits()
        self.images = (bunch.images / 16.0).astype(np.float32)
        self.labels = bunch.target.astype(np.int64)
        self.noise_std = noise_std

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        x = torch.from_numpy(self.images[i])[None]
        if self.noise_std:  # random per item: seeded per batch by ddp_exp's loaders
            x = x + self.noise_std * torch.randn_like(x)
        return x, int(self.labels[i])


def hf_digits():
    """The digits as a Hugging Face ``datasets.Dataset`` (``pip install datasets``): items are
    mappings ``{"image": tensor [8, 8], "label": tensor}`` once ``.with_format("torch")``; the
    ``ClassLabel`` feature tells ddp_exp the 10 classes. Returns a (train, val) pair."""
    import datasets

    bunch = sklearn_digits()
    table = datasets.Dataset.from_dict(
        {"image": (bunch.images / 16.0).astype(np.float32), "label": bunch.target},
        features=datasets.Features({
            "image": datasets.Array2D(shape=(8, 8), dtype="float32"),
            "label": datasets.ClassLabel(num_classes=10)}))
    parts = table.train_test_split(test_size=297, seed=0)
    return parts["train"].with_format("torch"), parts["test"].with_format("torch")
