"""Lazy map-style datasets for the tests of ``data=dataset`` and ``data=image_folder``, plugged in
through the public entry (``data._target_=lazy_data.<name>`` with this folder on PYTHONPATH).

Every item is computed or read when indexed; none of these classes holds its samples.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset


class DigitsDataset(Dataset):
    """scikit-learn's digits, one item at a time: ``(float32 [1, 8, 8], label)``, the same values
    as ``data=digits``; ``classes`` says there are 10."""

    classes = [str(d) for d in range(10)]

    def __init__(self, start: int = 0, stop: int | None = None):
        from ddp_exp.data import load_digits

        arrays = load_digits()
        stop = len(arrays) if stop is None else stop
        self.features, self.targets = arrays.features[start:stop], arrays.targets[start:stop]

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, i: int):
        return torch.from_numpy(self.features[i]), int(self.targets[i])


def digits_pair(split: int = 1500):
    """A ``(train, val)`` pair: the first ``split`` digits, then the rest."""
    return DigitsDataset(0, split), DigitsDataset(split)


class Computed(Dataset):
    """``num_samples`` items computed from their index alone: ``x = randn(shape)`` from a
    generator seeded by the index, label ``argmax`` of a fixed linear teacher over
    ``num_classes`` classes. ``num_samples * prod(shape) * 4`` bytes if materialised."""

    def __init__(self, num_samples: int = 1000, shape: tuple[int, ...] = (16,),
                 num_classes: int = 3, sleep_s: float = 0.0):
        self.num_samples, self.shape = num_samples, tuple(shape)
        self.num_classes, self.sleep_s = num_classes, sleep_s
        self.classes = list(range(num_classes))
        teacher = torch.Generator().manual_seed(12345)
        self.teacher = torch.randn(int(np.prod(self.shape)), num_classes, generator=teacher)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        x = torch.randn(self.shape, generator=torch.Generator().manual_seed(int(i)))
        return x, int((x.reshape(1, -1) @ self.teacher).argmax())


class MappingItems(DigitsDataset):
    """Digits as mappings ``{"image": ..., "label": ...}`` (a Hugging Face dataset's shape);
    no ``classes``: ``data.num_classes`` must say."""

    classes = None

    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        return {"image": x, "label": torch.tensor(y)}


class SingleTensors(DigitsDataset):
    """Items that are bare inputs, not (input, target) pairs."""

    def __getitem__(self, i: int):
        return super().__getitem__(i)[0]


def not_a_dataset():
    return 42


def write_digits_folder(root: Path, split: bool = False, size_of: dict | None = None,
                        limit: int | None = None) -> Path:
    """:func:`ddp_exp.data.images.write_digits`, then ``size_of``: index -> (w, h) rewrites those
    images at another size. Returns ``root``."""
    from PIL import Image

    from ddp_exp.data.images import write_digits

    write_digits(str(root), split, limit)
    for i, size in (size_of or {}).items():
        for path in Path(root).rglob(f"{i:04d}.png"):
            with Image.open(path) as image:
                resized = image.resize(size)
            resized.save(path)
    return Path(root)


def computed_pair(num_train: int = 600, num_val: int = 101, num_features: int = 16,
                  num_classes: int = 3):
    """A ``(train, val)`` pair of :class:`Computed` data; validation items are indices
    ``num_train..num_train+num_val-1`` of the same generator (disjoint from training)."""
    full = Computed(num_train + num_val, (num_features,), num_classes)
    return Subrange(full, 0, num_train), Subrange(full, num_train, num_train + num_val)


class Subrange(Dataset):
    def __init__(self, base: Dataset, start: int, stop: int):
        self.base, self.start, self.stop = base, start, stop
        self.classes = getattr(base, "classes", None)

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.base[self.start + i]


class Counted(Computed):
    """:class:`Computed` items that log every index read (``reads``): how often building the
    splits reads item 0."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads: list[int] = []

    def __getitem__(self, i: int):
        self.reads.append(int(i))
        return super().__getitem__(i)


def counted_splits(num_train: int = 200, num_val: int = 50, num_test: int = 40):
    """What split folders return, from a user's target: ``{"train", "val", "test"}`` of
    :class:`Counted` data (one ``classes`` list)."""
    return {"train": Counted(num_train), "val": Counted(num_val), "test": Counted(num_test)}


class CountedTransform:
    """An identity per-sample transform that counts how many were built (``built``)."""

    built = 0

    def __init__(self):
        CountedTransform.built += 1

    def __call__(self, x):
        return x


def pair_with_other_classes():
    """A ``(train, val)`` pair whose validation set lacks a class, so it numbers the others
    differently (as torchvision's ImageFolder does for a val/ folder without ``dog/``)."""
    train, val = computed_pair()
    train.classes, val.classes = ["cat", "dog", "fox"], ["cat", "fox"]
    return train, val


class DrawProbe:
    """A batch transform that replaces each input ``[B, 3]`` by three draws per sample: torch's
    ``rand``, NumPy's ``random.rand`` and Python's ``random.random``, from the global RNGs the
    loader seeds per batch."""

    def __call__(self, x):
        import random

        out = torch.empty(len(x), 3)
        out[:, 0] = torch.rand(len(x))
        out[:, 1] = torch.from_numpy(np.random.rand(len(x)))
        out[:, 2] = torch.tensor([random.random() for _ in range(len(x))])
        return out


class FailsOnce(DigitsDataset):
    """Rank 1 raises once, at its 50th item read, then never again (a marker file remembers)."""

    def __init__(self, marker: str):
        super().__init__()
        self.marker, self.reads = marker, 0

    def __getitem__(self, index: int):
        self.reads += 1
        if os.environ.get("RANK") == "1" and self.reads > 50 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            raise RuntimeError("transient failure on rank 1")
        return super().__getitem__(index)


class LabelOutOfRange(DigitsDataset):
    """Digits whose sample 1000 carries label 11 of 10 classes."""

    def __getitem__(self, index: int):
        x, y = super().__getitem__(index)
        return x, (11 if index == 1000 else y)
