"""The data package's entry: ``cfg.data`` -> the training, validation and test split every
rank receives (:func:`load` and its dispatch), and the names users and the built-in
``data._target_``s import from ``ddp_exp.data``.

Runs in the launching process, once (no torch compute beyond reading one item; see
:mod:`ddp_exp.launch`). ``data._target_`` returns one of:

* an :class:`ArrayDataset` (digits, synthetic data, a user's .pt/.npz/.csv file): held whole in
  memory, the fast path for small data;
* a map-style dataset (``data=image_folder``, or ``data=dataset`` with any
  ``torch.utils.data.Dataset``): read item by item when indexed (:mod:`ddp_exp.data.lazy`);
* a ``(train, val)`` or ``(train, val, test)`` tuple of map-style datasets, or (split image
  folders) a mapping ``{"train", "val", "test"}`` with None where a split is absent.

:func:`load` turns it into :class:`Datasets`: with one dataset, ``data.val_size`` samples are
held out by the seed alone (never by ``world_size``). Both kinds of split offer the same
interface (``len``, ``input_shape``, ``num_classes``, ``num_outputs``, ``batch(positions)``,
``subset``), which the rank side (:mod:`ddp_exp.data.loaders`) serves to the loop.

The package, one module per concept:

* :mod:`~ddp_exp.data.arrays`: in-memory arrays, digits, synthetic data;
* :mod:`~ddp_exp.data.user_file`: a user's .pt/.npz/.csv file;
* :mod:`~ddp_exp.data.lazy`: map-style torch datasets, split by index, read when indexed;
* :mod:`~ddp_exp.data.images`: image folders and their batch transform;
* :mod:`~ddp_exp.data.splits`: :class:`Datasets`, the seeded hold-out, ``data.standardize``;
* :mod:`~ddp_exp.data.loaders`: the rank side, this rank's batches.

May use: the modules above, :mod:`ddp_exp.config` (``ConfigError``, ``instantiate_node``) and
Hydra (``get_object``). No module of the package imports train, launch or worker.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np

from ddp_exp.config import ConfigError
from ddp_exp.data.arrays import ArrayDataset, load_digits, make_synthetic
from ddp_exp.data.loaders import seeded
from ddp_exp.data.splits import Datasets, build_datasets, standardize
from ddp_exp.data.user_file import load_file

# What ``from ddp_exp.data import ...`` and the built-in ``data._target_``s name.
__all__ = ["ArrayDataset", "Datasets", "build_datasets", "load", "load_digits", "load_file",
           "make_synthetic", "standardize"]

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
