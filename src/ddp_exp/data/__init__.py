"""Datasets, from the config to the training/validation split every rank receives.

Runs in the launching process, once (no torch compute beyond reading one item; see
:mod:`ddp_exp.launch`). ``data._target_`` returns one of:

* an :class:`ArrayDataset` (digits, synthetic data, a user's .pt/.npz/.csv file): held whole in
  memory, the fast path for small data;
* a map-style dataset (``data=image_folder``, or ``data=dataset`` with any
  ``torch.utils.data.Dataset``): read item by item when indexed (:mod:`ddp_exp.data.lazy`);
* a ``(train, val)`` or ``(train, val, test)`` tuple of map-style datasets.

:func:`load` turns it into :class:`Datasets`: with one dataset, ``data.val_size`` samples are
held out by the seed alone (never by ``world_size``). Both kinds of split offer the same
interface (``len``, ``input_shape``, ``num_classes``, ``num_outputs``, ``batch(positions)``,
``subset``), which the rank side (:mod:`ddp_exp.data.loaders`) serves to the loop.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import math
import os
import warnings
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ddp_exp.config import ConfigError
from ddp_exp.data.loaders import seeded

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

    random = False  # batches never depend on random draws

    def subset(self, indices: np.ndarray) -> ArrayDataset:
        return ArrayDataset(self.features[indices], self.targets[indices], self.num_classes)

    def batch(self, positions: Sequence[int]):
        """Samples at ``positions`` as tensors ``(x [B, ...] float32, y [B] or [B, k])``."""
        import torch

        idx = np.asarray(positions, dtype=np.int64)
        return torch.from_numpy(self.features[idx]), torch.from_numpy(self.targets[idx])

    def fingerprint(self) -> int:
        """CRC-32 of both arrays (zlib, ~1 GB/s)."""
        crc = zlib.crc32(np.ascontiguousarray(self.features))
        return zlib.crc32(np.ascontiguousarray(self.targets), crc)


@dataclass
class Datasets:
    """The training, validation and test split handed to every rank: :class:`ArrayDataset` or
    :class:`ddp_exp.data.lazy.TorchSplit` (the training one carrying the augmentation); ``test`` is
    empty unless ``data.test_size`` > 0 or the data comes with a test split."""

    train: Any
    val: Any
    test: Any | None = None
    standardization: dict[str, Any] | None = None  # data.standardize's statistics, if used

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


# ------------------------------------------------------------------------- from the config
# Keys of the data path, never passed to ``data._target_`` (see conf/data/*.yaml).
PATH_KEYS = ("batch_size", "val_size", "test_size", "shuffle", "num_workers", "persistent_workers",
             "prefetch_factor", "pin_memory", "augment", "mean", "std", "transform",
             "input_key", "target_key", "standardize")
# Keys a built-in loader takes as arguments, but that describe a user's Dataset otherwise.
DESCRIBING_KEYS = ("num_classes", "task")


def load(data_cfg: Mapping[str, Any], seed: int, world_size: int) -> Datasets:
    """``cfg.data`` (resolved, plain) -> the training and validation split.

    Calls ``data._target_`` with the keys that are not the data path's own (:data:`PATH_KEYS`;
    ``num_classes`` and ``task`` only if the target's signature names them and they are set),
    then splits what it returned (see the module docstring).

    Raises:
        ConfigError: the target fails or returns something else than a dataset or a pair of
            datasets; a held-out ``data.val_size`` with given splits; any bad content.
    """
    from ddp_exp.config import instantiate_node

    target = data_cfg["_target_"]
    args = {k: v for k, v in data_cfg.items() if k not in PATH_KEYS}
    accepted = _accepted_keywords(target)
    if accepted is not None:  # a describing key left null is not an argument either
        args = {k: v for k, v in args.items()
                if k not in DESCRIBING_KEYS or (k in accepted and v is not None)}
    made = instantiate_node(args, "data")
    if isinstance(made, ArrayDataset):
        datasets = build_datasets(made, data_cfg["val_size"], seed, world_size,
                                  data_cfg.get("test_size", 0))
        return standardize(datasets) if data_cfg.get("standardize") else datasets
    return _lazy_datasets(made, data_cfg, seed, world_size)


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
        return ArrayDataset(x, part.targets, part.num_classes)

    stats = {"mean": mean.tolist(), "std": std.tolist(),
             "rule": "x_scaled = (x - mean) / std, statistics of the training split"}
    return Datasets(scaled(datasets.train), scaled(datasets.val), scaled(datasets.test), stats)


def _accepted_keywords(target: str) -> set[str] | None:
    """The keyword names ``target`` accepts; None if it cannot be inspected (then all keys
    other than the path's go to it). ``**kwargs`` accepts no *describing* key by name."""
    from hydra.utils import get_object

    try:
        obj = get_object(target)
        params = inspect.signature(obj).parameters.values()
    except Exception:  # instantiate reports an unknown target with its own one-line error
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _lazy_datasets(made: Any, data_cfg: Mapping[str, Any], seed: int,
                   world_size: int) -> Datasets:
    from ddp_exp.data import images, lazy

    target = data_cfg["_target_"]
    if isinstance(made, Mapping):  # {"train", "val", "test"}, None where absent: hold out
        return _named_splits(made, data_cfg, seed, world_size)
    given = isinstance(made, (tuple, list))
    parts = list(made) if given else [made]
    if given and len(parts) not in (2, 3) or not all(lazy.is_map_style(p) for p in parts):
        got = (f"a {type(made).__name__} of {len(parts)}: "
               f"{', '.join(type(p).__name__ for p in parts)}" if given else type(made).__name__)
        hint = (" (an IterableDataset cannot be sharded exactly: give a map-style one)"
                if any(isinstance(p, _iterable_dataset()) for p in parts) else "")
        raise ConfigError(f"data._target_={target!r} returned {got}, not a map-style dataset "
                          f"(an object with __len__ and __getitem__, e.g. a torch.utils.data."
                          f"Dataset) or a (train, val) or (train, val, test) tuple of them{hint}")
    for key, index in (("val_size", 1), ("test_size", 2)):
        if len(parts) > index and data_cfg.get(key):
            split = key.split("_")[0]
            raise ConfigError(f"data.{key}={data_cfg[key]} is invalid here: the data comes with "
                              f"its own {split} split (a {split}/ folder or a dataset of the "
                              f"tuple data._target_ returned), so nothing is held out; set "
                              f"data.{key}=0")
    reader = lazy.ItemReader(data_cfg.get("input_key"), data_cfg.get("target_key"))
    is_folder = isinstance(parts[0], images.ImageFolder)
    train_tf = eval_tf = None
    if is_folder:
        mean, std = data_cfg.get("mean"), data_cfg.get("std")
        _check_normalisation(mean, std, parts[0].channels)
        user = data_cfg.get("transform")
        transform = None
        if user is not None:
            from ddp_exp.config import instantiate_node

            transform = instantiate_node(user, "data.transform")
            if not callable(transform):
                raise ConfigError(f"data.transform._target_={user.get('_target_')!r} built a "
                                  f"{type(transform).__name__}, which is not callable")
        train_tf = images.ImageBatch(mean, std, bool(data_cfg.get("augment")), transform)
        eval_tf = images.ImageBatch(mean, std)
    task = "classification" if is_folder else data_cfg.get("task", "auto")
    with seeded(seed):  # item 0 read here draws the same numbers in every rerun
        return _describe_and_split(parts, given, reader, task, data_cfg, train_tf, eval_tf,
                                   seed, world_size)


def _describe_and_split(parts, given, reader, task, data_cfg, train_tf, eval_tf, seed,
                        world_size) -> Datasets:
    from ddp_exp.data import lazy

    target = data_cfg["_target_"]
    shape, num_classes, width = lazy.describe(parts[0], reader, task,
                                              data_cfg.get("num_classes"), train_tf,
                                              "training" if given else "data._target_'s")
    splits = [lazy.TorchSplit(p, np.arange(len(p), dtype=np.int64), reader, shape, num_classes,
                              width) for p in parts]
    for part, name in zip(parts[1:], ("validation", "test")[:len(parts) - 1], strict=True):
        other = lazy.describe(part, reader, task, num_classes, eval_tf, name)
        if (other[0], other[2]) != (shape, width):
            raise ConfigError(f"data._target_={target!r}: {name} items have input shape "
                              f"{list(other[0])} but training items {list(shape)}")
    if given:
        test = splits[2] if len(splits) == 3 else splits[0].subset(np.arange(0))
        datasets = Datasets(train=splits[0], val=splits[1], test=test)
        if world_size > len(datasets.train):
            raise ConfigError(f"world_size={world_size} is invalid: the training split has "
                              f"only {len(datasets.train)} samples and every rank needs one")
    else:
        datasets = build_datasets(splits[0], data_cfg["val_size"], seed, world_size,
                                  data_cfg.get("test_size", 0))
    import dataclasses

    return Datasets(train=dataclasses.replace(datasets.train, transform=train_tf),
                    val=dataclasses.replace(datasets.val, transform=eval_tf),
                    test=dataclasses.replace(datasets.test, transform=eval_tf))


def _named_splits(made: Mapping[str, Any], data_cfg: Mapping[str, Any], seed: int,
                  world_size: int) -> Datasets:
    """Split folders: the given splits as they are; a missing validation or test split is held
    out of the training folder by ``data.val_size`` / ``data.test_size`` and the seed."""
    import dataclasses

    train, val, test = (made.get(k) for k in ("train", "val", "test"))
    given = {"val_size": val is not None, "test_size": test is not None}
    cfg = {**data_cfg, **{k: 0 for k, v in given.items() if v}}
    for key, present in given.items():
        if present and data_cfg.get(key):
            split = key.split("_")[0]
            raise ConfigError(f"data.{key}={data_cfg[key]} is invalid here: data.path has a "
                              f"{split}/ folder, the {split} split, so nothing is held out; set "
                              f"data.{key}=0")
    held = _lazy_datasets(train, cfg, seed, world_size)
    out = {"train": held.train, "val": held.val, "test": held.test}
    for name, part in (("val", val), ("test", test)):
        if part is not None:
            own = _lazy_datasets((train, part), {**cfg, "val_size": 0, "test_size": 0}, seed,
                                 world_size).val
            out[name] = dataclasses.replace(own, transform=held.val.transform)
    return Datasets(**out)


def _iterable_dataset():
    from torch.utils.data import IterableDataset

    return IterableDataset


def _check_normalisation(mean, std, channels: int) -> None:
    for key, value in (("data.mean", mean), ("data.std", std)):
        if (value is None) != (mean is None and std is None) or value is not None and (
                len(value) != channels):
            raise ConfigError(f"{key}={value!r} is invalid: null for no normalisation, or "
                              f"{channels} per-channel value(s) (data.channels={channels}), "
                              "with data.mean and data.std set together")
    if std is not None and any(s <= 0 for s in std):
        raise ConfigError(f"data.std={list(std)!r} is invalid: positive values")
