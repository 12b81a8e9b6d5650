"""Lazy map-style datasets: any ``torch.utils.data.Dataset`` (or object with ``__len__`` and
``__getitem__``: a Hugging Face dataset, an :class:`ddp_exp.data.images.ImageFolder`), split by
index and read item by item when a batch is asked for.

A :class:`TorchSplit` is one split of such a dataset: the dataset, the indices of its samples,
how to read an item as ``(input, target)`` (:class:`ItemReader`) and the batch transform
(:class:`ddp_exp.data.image_batch.ImageBatch` for image folders). Nothing is materialised: the
launching process reads one item to learn the input shape and the task, and ranks read the rest.
How read items become a batch (padding, the transform) is :mod:`ddp_exp.data.collate`.

May use: :mod:`ddp_exp.data.collate`, :mod:`ddp_exp.data.seeds`, :mod:`ddp_exp.config`
(``ConfigError``), NumPy, torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ddp_exp.config.errors import ConfigError, described
from ddp_exp.data.collate import Padding, collate_inputs, pad_stack


@dataclasses.dataclass(frozen=True)
class ItemReader:
    """Reads one item of a dataset as ``(input, target)`` tensors.

    An item is a pair ``(input, target)`` or a mapping read through ``input_key`` /
    ``target_key`` (``data.input_key`` / ``data.target_key``: a Hugging Face dataset with
    ``.with_format("torch")`` gives ``{"image": ..., "label": ...}``).
    """

    input_key: str | None = None
    target_key: str | None = None

    def __call__(self, item: Any, where: str = "an item") -> tuple[Any, Any]:
        import torch

        if isinstance(item, Mapping):
            if self.target_key is None:
                raise ConfigError(f"data.target_key is required: the dataset's items are mappings "
                                  f"with keys {sorted(map(str, item))}; set data.target_key=<key>"
                                  " (and data.input_key=<key>, or every other key is passed to "
                                  "the model by name)")
            for key, name in ((self.input_key, "data.input_key"),
                              (self.target_key, "data.target_key")):
                if key is not None and key not in item:
                    raise ConfigError(f"{name}={key!r} is not a key of the dataset's items "
                                      f"(keys: {sorted(map(str, item))})")
            y = item[self.target_key]
            if self.input_key is not None:
                x = item[self.input_key]
            else:  # keyword arguments of the model: every key but the target's
                x = {k: v for k, v in item.items() if k != self.target_key}
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            x, y = item
        else:
            raise ConfigError(f"{where} is a {type(item).__name__}, not an (input, target) pair; "
                              "return pairs, or mappings with data.input_key and "
                              "data.target_key set")
        try:
            if isinstance(x, Mapping):
                return {k: torch.as_tensor(v) for k, v in x.items()}, torch.as_tensor(y)
            if isinstance(x, (tuple, list)) and not _numeric(x):
                return tuple(torch.as_tensor(v) for v in x), torch.as_tensor(y)
            return torch.as_tensor(x), torch.as_tensor(y)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"{where}: input and target must be tensors, arrays or numbers "
                              f"(got {type(x).__name__}, {type(y).__name__}: {exc}); convert "
                              "them in the dataset, e.g. with a transform") from None


def _numeric(x: Sequence) -> bool:
    """A list/tuple of numbers (one tensor), not a tuple of tensors or arrays."""
    return all(isinstance(v, (int, float, bool)) for v in x)


@dataclasses.dataclass
class TorchSplit:
    """One split of a lazy dataset; the interface :class:`ddp_exp.data.arrays.ArrayDataset` has
    too.

    Attributes:
        dataset: the map-style dataset (all splits share it).
        indices: int64 indices into ``dataset`` of this split's samples ``[N]``.
        reader: reads an item as ``(input, target)``.
        input_shape: one sample's shape after the batch transform, e.g. ``(3, 32, 32)``.
        num_classes: classes, or 0 for regression.
        target_width: regression targets per sample (1 for classification).
        transform: ``[B, ...] -> [B, ...]`` applied to each batch of inputs, or None (inputs
            are then cast to float32).
    """

    dataset: Any
    indices: np.ndarray
    reader: ItemReader
    input_shape: tuple[int, ...]
    num_classes: int
    target_width: int = 1
    transform: Callable[[Any], Any] | None = None
    elementwise: bool = False  # class labels per element ([T] tokens, [H, W] pixels)
    padding: Padding = Padding()

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def num_outputs(self) -> int:
        """Width of the model's output: classes, or regression targets."""
        return self.num_classes if self.num_classes else self.target_width

    random = True  # a user's __getitem__ or transform may draw: the loader seeds every batch

    def subset(self, positions: np.ndarray) -> TorchSplit:
        """The samples at ``positions`` of this split (positions, not dataset indices)."""
        return dataclasses.replace(self, indices=self.indices[np.asarray(positions,
                                                                         dtype=np.int64)])

    def batch(self, positions: Sequence[int], items_read: Mapping[int, Any] | None = None,
              keys: Sequence[int] | None = None):
        """Read and collate the samples at ``positions``: inputs ``[B, *input_shape]`` float32,
        targets ``[B]`` int64 (classification) or ``[B, k]`` float32 (regression).
        ``items_read``: items read already, by dataset index, taken instead of reading them
        again. ``keys``: each sample's key (:func:`ddp_exp.data.seeds.sample_keys`): every
        item is read with the global RNGs seeded from its own (the caller puts them back,
        :func:`ddp_exp.data.seeds.seeded`), and the transform draws by them.

        Raises:
            ConfigError: an item of another shape, or a class label outside ``0..C-1`` (the
                user's data: reported in one line even when found by a rank while training).
        """
        import torch

        xs, ys = [], []
        items_read = items_read or {}
        # Items that may draw are read under their own key; a dataset that says it draws
        # nothing (``draws = False``: an image folder) needs none.
        keyed = keys is not None and getattr(self.dataset, "draws", True)
        if keyed:
            from ddp_exp.data.seeds import reseed
        for n, p in enumerate(positions):
            if keyed:
                reseed(keys[n])
            index = int(self.indices[p])
            x, y = self.reader(items_read[index] if index in items_read else self.dataset[index])
            xs.append(x)
            ys.append(y)
        x = collate_inputs(xs, self.padding, self.transform, keys)
        if self.elementwise:
            return x, self._element_targets(ys)
        y = torch.stack(ys)
        if self.num_classes:
            y = y.reshape(len(y)).to(torch.int64)
            low, high = int(y.min()), int(y.max())
            if low < 0 or high >= self.num_classes:
                raise ConfigError(f"data: class label {low if low < 0 else high} is outside 0.."
                                 f"{self.num_classes - 1} (data.num_classes={self.num_classes})")
        else:
            y = y.reshape(len(y), -1).to(torch.float32)
        return x, y

    def _element_targets(self, ys: list) -> Any:
        """Per-element labels ``[B, *dims]`` int64, shifted one step with
        ``data.shift_labels`` (position t holds label t+1, the last ``ignore_index``) and
        padded with ``data.ignore_index``."""
        import torch

        pad = self.padding
        ys = [y.to(torch.int64) for y in ys]
        if pad.shift_labels:
            ys = [torch.cat([y[1:], torch.full_like(y[:1], pad.ignore_index)]) for y in ys]
        y, _ = pad_stack(ys, pad.ignore_index, "dataset items' targets")
        counted = y[y != pad.ignore_index]
        if len(counted):
            low, high = int(counted.min()), int(counted.max())
            if low < 0 or high >= self.num_classes:
                raise ConfigError(f"data: class label {low if low < 0 else high} is outside 0.."
                                  f"{self.num_classes - 1} (data.num_classes={self.num_classes};"
                                  f" data.ignore_index={pad.ignore_index} marks ignored ones)")
        return y

    def fingerprint(self) -> int:
        """What the nodes of a multi-node world compare: the split's indices and, for an image
        folder, its file list."""
        import zlib

        crc = zlib.crc32(np.ascontiguousarray(self.indices))
        extra = getattr(self.dataset, "fingerprint", None)
        return zlib.crc32(str(extra() if callable(extra) else len(self.dataset)).encode(), crc)


def is_map_style(obj: Any) -> bool:
    """True for an object a DataLoader can index: ``__len__`` and ``__getitem__``, not an
    ``IterableDataset``."""
    from torch.utils.data import IterableDataset

    return (hasattr(obj, "__len__") and hasattr(obj, "__getitem__")
            and not isinstance(obj, IterableDataset) and not isinstance(obj, (str, bytes)))


def class_count(dataset: Any, target_key: str | None) -> int | None:
    """The dataset's number of classes if it says: ``classes`` (torchvision, ImageFolder) or a
    Hugging Face ``ClassLabel`` feature named ``target_key``."""
    classes = getattr(dataset, "classes", None)
    if classes is not None:
        try:
            return len(classes)
        except TypeError:
            return None
    features = getattr(dataset, "features", None)
    if isinstance(features, Mapping) and target_key in features:
        return getattr(features[target_key], "num_classes", None)
    return None


def describe(dataset: Any, reader: ItemReader, task: str, num_classes: int | None,
             transform: Callable[[Any], Any] | None, name: str
             ) -> tuple[tuple[int, ...], int, int, Any]:
    """Read item 0 of ``dataset`` to learn ``(input_shape, num_classes, target_width, item)``;
    ``item`` is item 0 as the dataset returned it, for checks that would read it again
    (:attr:`ddp_exp.data.splits.Datasets.items_read`).

    ``task=auto``: an integer target is a class label, a floating one is regression.

    Raises:
        ConfigError: an empty dataset, an item that cannot be read, a classification dataset
            whose number of classes is unknown (``data.num_classes``) or below 2.
    """
    import torch

    if len(dataset) == 0:
        raise ConfigError(f"the {name} dataset is empty (length 0)")
    try:
        item = dataset[0]
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"reading item 0 of the {name} dataset failed: {described(exc)}"
                          ) from None
    x, y = reader(item, f"item 0 of the {name} dataset")
    if transform is not None:
        x = transform(x[None])[0]
    integral = not (torch.is_floating_point(y) or torch.is_complex(y))
    if task == "auto":
        task = "classification" if integral else "regression"
    if task == "regression":
        return _shape_of(x), 0, max(1, y.numel()), item
    if not integral:
        raise ConfigError(f"data.task=classification needs integer class labels (one per item, "
                          f"or one per element: tokens, pixels); item 0's target is {y.dtype} of "
                          f"shape {list(y.shape)} (set data.task=regression for real-valued "
                          "targets)")
    classes = num_classes or class_count(dataset, reader.target_key)
    if not classes:
        raise ConfigError(f"data.num_classes is required: the {name} dataset has integer targets "
                          "but says nothing of its classes (no `classes` attribute); set "
                          "data.num_classes=<C> or data.task=regression")
    if classes < 2:
        raise ConfigError(f"data.num_classes={classes} is invalid: classification needs >= 2")
    return _shape_of(x), int(classes), 1, item


def _shape_of(x: Any) -> tuple[int, ...]:
    """One item's input shape: a tensor's, or a tuple's / mapping's first tensor's."""
    if isinstance(x, Mapping):
        x = next(iter(x.values()))
    elif isinstance(x, tuple):
        x = x[0]
    return tuple(x.shape)
