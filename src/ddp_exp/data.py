"""Datasets and the per-rank data path.

Two halves, split by where they run:

* In the launching process (no torch compute there, see :mod:`ddp_exp.launch`): the loaders
  named by ``data._target_`` read or generate the data **once** as NumPy arrays, and
  :func:`build_datasets` holds out the validation samples chosen by the seed alone.
* In each rank: :class:`TrainLoader` serves the rank's shard of the training set, chosen by
  ``torch.utils.data.DistributedSampler`` (strided shards of one seeded permutation per epoch),
  by batched tensor indexing (or torch's DataLoader when ``data.num_workers > 0``), and
  :func:`val_batches` serves an unpadded strided shard of the validation set.

Training policy for a training set not divisible by ``world_size``: DistributedSampler's padding,
i.e. the first ``world_size - N % world_size`` samples of the epoch's permutation are seen twice,
so every rank runs the same number of steps and DDP's all-reduces line up. Validation is never
padded: each sample is evaluated exactly once across the world.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ddp_exp.config import ConfigError

log = logging.getLogger(__name__)

_ALIASES = {"features": ("features", "x", "data", "inputs"), "targets": ("targets", "y", "target",
                                                                         "labels")}


@dataclass
class ArrayDataset:
    """A whole dataset in memory.

    Attributes:
        features: float32 array ``[N, *input_shape]``.
        targets: int64 class labels ``[N]`` (classification) or float32 ``[N, num_outputs]``
            (regression).
        num_classes: number of classes, or 0 for regression.
    """

    features: np.ndarray
    targets: np.ndarray
    num_classes: int

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

    def subset(self, indices: np.ndarray) -> ArrayDataset:
        return ArrayDataset(self.features[indices], self.targets[indices], self.num_classes)


@dataclass
class Datasets:
    """The training, validation and test split handed to every rank (``test`` is empty unless
    ``data.test_size`` > 0)."""

    train: ArrayDataset
    val: ArrayDataset
    test: ArrayDataset | None = None

    @property
    def num_classes(self) -> int:
        return self.train.num_classes

    def fingerprint(self) -> dict[str, int]:
        """Sizes and a CRC-32 of every array (zlib, ~1 GB/s): what the nodes of a multi-node
        world compare, since each builds the data from its own copy."""
        crc = 0
        for part in (self.train, self.val, *([self.test] if self.test is not None else [])):
            for array in (part.features, part.targets):
                crc = zlib.crc32(np.ascontiguousarray(array), crc)
        return {"data.train_samples": len(self.train), "data.val_samples": len(self.val),
                "data.test_samples": len(self.test) if self.test is not None else 0,
                "data.crc32": crc}


# ------------------------------------------------------------------------- built-in loaders
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


def load_file(path: str, task: str = "auto") -> ArrayDataset:
    """A user's file of features and targets.

    ``.pt`` (``torch.load(weights_only=True)``) or ``.npz``: a mapping with ``features`` [N, ...]
    and ``targets`` [N] or [N, k] (also accepted: ``x``/``y``), or a pair ``(features, targets)``.
    ``.csv``: numeric columns, the last one the target; a non-numeric first row is a header.
    ``task=auto`` treats integer targets as class labels ``0..C-1`` (in a CSV: non-negative whole
    numbers below 1000 with at most 100 distinct values), anything else as regression; the
    inference is logged.

    Raises:
        ConfigError: the file is missing, of an unknown kind, or its content is unusable.
    """
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(full):
        raise ConfigError(f"data.path={path!r} is a directory; give a .pt, .npz or .csv file")
    if not os.path.isfile(full):
        raise ConfigError(f"data.path={path!r}: no such file (looked at {full})")
    ext = os.path.splitext(full)[1].lower()
    try:
        if ext == ".csv":
            features, targets, integral = _read_csv(full)
        elif ext in (".pt", ".pth"):
            import torch

            obj = torch.load(full, map_location="cpu", weights_only=True)
            features, targets = _pick_arrays(obj, path)
            features, targets = np.asarray(features), np.asarray(targets)
            integral = None
        elif ext == ".npz":
            with np.load(full, allow_pickle=False) as npz:
                features, targets = _pick_arrays(dict(npz), path)
            integral = None
        else:
            raise ConfigError(f"data.path={path!r}: unsupported file type {ext!r}; "
                              "use .pt, .npz or .csv")
    except ConfigError:
        raise
    except Exception as exc:  # a corrupt or foreign file: say which, not a traceback
        raise ConfigError(f"data.path={path!r}: cannot read it ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else 'no detail'})") from exc
    dataset = _to_dataset(features, targets, task, path, integral)
    kind = (f"classification, {dataset.num_classes} classes" if dataset.num_classes
            else f"regression, {dataset.num_outputs} target(s)")
    log.info("data.path=%s: %d samples of shape %s; %s (data.task=%s)", path, len(dataset),
             list(dataset.input_shape), kind, task)
    return dataset


def _pick_arrays(obj, path: str):
    if isinstance(obj, (tuple, list)) and len(obj) == 2:
        return obj[0], obj[1]
    if isinstance(obj, dict):
        found = {}
        for role, names in _ALIASES.items():
            key = next((n for n in names if n in obj), None)
            if key is None:
                raise ConfigError(f"data.path={path!r}: no '{role}' entry (found "
                                  f"{sorted(map(str, obj))}; expected {role} or {names[1]})")
            found[role] = obj[key]
        return found["features"], found["targets"]
    raise ConfigError(f"data.path={path!r}: expected a dict with features and targets or a "
                      f"(features, targets) pair, got {type(obj).__name__}")


def _read_csv(full: str):
    with open(full) as fh:
        first = fh.readline().strip().split(",")

    def numeric(field: str) -> bool:
        try:
            float(field)
            return True
        except ValueError:
            return False

    # A header row has no number in it; a row mixing numbers and words is bad data, which
    # np.loadtxt reports (as a one-line ConfigError naming data.path).
    header = 0 if any(numeric(f) for f in first) else 1
    with warnings.catch_warnings():  # an empty file: our error below, not numpy's warning
        warnings.simplefilter("ignore", UserWarning)
        table = np.loadtxt(full, delimiter=",", skiprows=header, ndmin=2, dtype=np.float64)
    if table.shape[1] < 2:
        raise ConfigError(f"data.path={full!r}: a CSV needs feature columns and a last target "
                          f"column, found {table.shape[1]} column(s)")
    targets = table[:, -1]
    finite = np.isfinite(targets).all()
    integral = bool(finite and (targets >= 0).all() and (targets == np.round(targets)).all()
                    and len(np.unique(targets)) <= 100 and targets.max() < 1000)
    return table[:, :-1], targets, integral


def _to_dataset(features, targets, task: str, path: str, integral: bool | None) -> ArrayDataset:
    features = np.asarray(features)
    targets = np.asarray(targets)
    where = f"data.path={path!r}"
    if features.ndim < 2 or len(features) == 0:
        raise ConfigError(f"{where}: features must be [N, ...] with N >= 1, got shape "
                          f"{features.shape}")
    if len(targets) != len(features):
        raise ConfigError(f"{where}: {len(features)} feature rows but {len(targets)} targets")
    if not np.issubdtype(features.dtype, np.number) or not np.issubdtype(targets.dtype,
                                                                           np.number):
        raise ConfigError(f"{where}: features and targets must be numeric")
    features = features.astype(np.float32)
    if not np.isfinite(features).all():
        raise ConfigError(f"{where}: features contain NaN or infinity")
    if integral is None:
        integral = np.issubdtype(targets.dtype, np.integer) or targets.dtype == np.bool_
    if task == "auto":
        task = "classification" if integral and targets.ndim == 1 else "regression"
    if task == "classification":
        if targets.ndim != 1 or not np.isfinite(targets).all() or (targets < 0).any() or (
                targets != np.round(targets)).any():
            raise ConfigError(f"{where}: classification targets must be one label 0..C-1 per "
                              "sample (set data.task=regression for real-valued targets)")
        labels = targets.astype(np.int64)
        return ArrayDataset(features, labels, num_classes=max(2, int(labels.max()) + 1))
    targets = targets.astype(np.float32).reshape(len(targets), -1)
    if not np.isfinite(targets).all():
        raise ConfigError(f"{where}: targets contain NaN or infinity")
    return ArrayDataset(features, targets, num_classes=0)


# ---------------------------------------------------------------------------------- split
def build_datasets(dataset: ArrayDataset, val_size: int, seed: int, world_size: int,
                   test_size: int = 0) -> Datasets:
    """Hold out ``val_size`` validation and ``test_size`` test samples, chosen by ``seed``
    alone (never by ``world_size``).

    One seeded permutation of the samples: validation takes its first ``val_size`` entries,
    test its last ``test_size``, training the rest. So changing ``test_size`` never changes
    which samples are validation (nor ``val_size`` which are test); only training shrinks.
    Every part keeps the file's order (sorted indices); shuffling happens per epoch in the
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


# ---------------------------------------------------------------------------- rank side
class TrainLoader:
    """This rank's training batches ``(x [B, ...], y [B] or [B, k])``, one epoch per iteration.

    ``sampler`` is the rank's ``DistributedSampler``; call its ``set_epoch`` before iterating.
    ``x`` and ``y`` are the whole training set; with workers they must stay on the host (see
    :func:`placement`), and ``pin_memory`` makes the workers' batches page-locked.
    With ``num_workers == 0`` batches are cut from the in-memory tensors by index (one gather
    per batch, no per-sample ``__getitem__`` or collate); otherwise torch's DataLoader serves
    the same indices in the same order from persistent worker processes. The last batch of an
    epoch may be smaller.
    """

    def __init__(self, x, y, sampler, batch_size: int, num_workers: int = 0,
                 pin_memory: bool = False):
        from torch.utils.data import DataLoader, TensorDataset

        self.x, self.y, self.sampler, self.batch_size = x, y, sampler, batch_size
        self.loader = None
        if num_workers > 0:
            self.loader = DataLoader(TensorDataset(x, y), batch_size=batch_size, sampler=sampler,
                                     num_workers=num_workers, persistent_workers=True,
                                     pin_memory=pin_memory, worker_init_fn=die_with_parent)

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self) -> Iterator:
        import torch

        if self.loader is not None:
            yield from self.loader
            return
        order = torch.tensor(list(self.sampler), dtype=torch.long)
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            yield self.x.index_select(0, idx), self.y.index_select(0, idx)


def placement(device, num_workers: int) -> tuple[bool, bool]:
    """Where a rank keeps its training set: ``(move_batches, pin_memory)``.

    * ``num_workers == 0``: the whole set is copied to ``device`` once, and batches are cut
      there by index: no host-to-device copy per step. (The sets this tool loads are in
      memory already; on a GPU they cost their size in device memory.)
    * ``num_workers > 0``: the set stays on the host (workers cannot share CUDA tensors); each
      batch is copied to the device in the step, from page-locked memory on CUDA
      (``pin_memory``), so that ``non_blocking=True`` copies overlap with compute (PyTorch docs,
      "pin_memory" in torch.utils.data).

    Args:
        device: the rank's ``torch.device``.
        num_workers: ``data.num_workers``.
    """
    on_host = num_workers > 0
    return on_host and device.type != "cpu", on_host and device.type == "cuda"


def die_with_parent(worker_id: int = 0) -> None:
    """DataLoader ``worker_init_fn``: the worker gets SIGKILL when its rank dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``). Otherwise a killed rank's workers live on until their next
    liveness check (5 s), holding the rank's exit pipe, so the launcher waits for them."""
    del worker_id
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: keep torch's own liveness check
        pass


def val_batches(x, y, rank: int, world_size: int, batch_size: int) -> Iterator:
    """Yield this rank's validation batches: samples ``rank, rank + world_size, ...``, unpadded.

    A rank may get no sample at all (``val_size < world_size``); it then yields nothing.
    """
    shard = slice(rank, None, world_size)
    xs, ys = x[shard], y[shard]
    for start in range(0, len(xs), batch_size):
        yield xs[start:start + batch_size], ys[start:start + batch_size]
