"""The data package's entry: ``cfg.data`` -> the training, validation and test split every
rank receives (:func:`load` and its dispatch), and the names users and the built-in
``data._target_``s import from ``ddp_exp.data``.

Runs in the launching process, once (no torch compute beyond reading one item; see
:mod:`ddp_exp.launch.build`). ``data._target_`` returns one of:

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
* :mod:`~ddp_exp.data.collate`: their items collated into a batch (padding, the transform);
* :mod:`~ddp_exp.data.images`: image folders;
* :mod:`~ddp_exp.data.image_batch`: an image folder's batch transform (scale, augmentation,
  normalisation);
* :mod:`~ddp_exp.data.tokens`: a token stream in windows (``data=tokens``);
* :mod:`~ddp_exp.data.splits`: :class:`Datasets`, the seeded hold-out, ``data.standardize``;
* :mod:`~ddp_exp.data.sampling`: which samples a rank serves in an epoch, in which batches;
* :mod:`~ddp_exp.data.loaders`: the rank side, this rank's batches.

May use: the modules above and :mod:`ddp_exp.config` (``ConfigError``, ``instantiate_node``,
``find_target``). No module of the package imports train, launch or worker.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np

from ddp_exp.config.errors import ConfigError
from ddp_exp.config.targets import find_target
from ddp_exp.data.arrays import ArrayDataset, load_digits, make_synthetic
from ddp_exp.data.loaders import seeded
from ddp_exp.data.splits import Datasets, build_datasets, standardize
from ddp_exp.data.tokens import TokenStream, split_stream
from ddp_exp.data.user_file import load_file

# What ``from ddp_exp.data import ...`` and the built-in ``data._target_``s name.
__all__ = ["ArrayDataset", "Datasets", "build_datasets", "load", "load_digits", "load_file",
           "make_synthetic", "standardize"]

# Keys of the data path, never passed to ``data._target_`` (see conf/data/*.yaml).
PATH_KEYS = ("batch_size", "val_size", "test_size", "shuffle", "num_workers", "persistent_workers",
             "prefetch_factor", "pin_memory", "augment", "mean", "std", "transform",
             "input_key", "target_key", "standardize", "pad_value", "ignore_index",
             "shift_labels", "global_batch_size", "max_batch_size_per_rank")
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
    from ddp_exp.config.targets import instantiate_node

    target = data_cfg["_target_"]
    args = {k: v for k, v in data_cfg.items() if k not in PATH_KEYS}
    accepted = _accepted_keywords(target)
    if accepted is not None:  # a describing key left null is not an argument either
        args = {k: v for k, v in args.items()
                if k not in DESCRIBING_KEYS or (k in accepted and v is not None)}
    made = instantiate_node(args, "data")
    if isinstance(made, TokenStream):  # data=tokens: held-out windows from the stream's tail
        return split_stream(made, data_cfg.get("val_size"), data_cfg.get("test_size", 0), seed)
    if isinstance(made, ArrayDataset):
        datasets = build_datasets(made, data_cfg["val_size"], seed, world_size,
                                  data_cfg.get("test_size", 0))
        return standardize(datasets) if data_cfg.get("standardize") else datasets
    return _lazy_datasets(made, data_cfg, seed, world_size)


def _accepted_keywords(target: str) -> set[str] | None:
    """The keyword names ``target`` accepts; None if it cannot be inspected (then all keys
    other than the path's go to it). ``**kwargs`` accepts no *describing* key by name."""
    obj = find_target(target)
    if obj is None:  # instantiate reports an unknown target with its own one-line error
        return None
    try:
        params = inspect.signature(obj).parameters.values()
    except Exception:  # no signature to read (a builtin): every key goes to it
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


_SPLITS = ("train", "val", "test")  # the keys of split folders' mapping, in a tuple's order
_SPLIT_NAMES = {"train": "training", "val": "validation", "test": "test"}


def _lazy_datasets(made: Any, data_cfg: Mapping[str, Any], seed: int,
                   world_size: int) -> Datasets:
    """Map-style data -> :class:`Datasets` of :class:`ddp_exp.data.lazy.TorchSplit`.

    ``made`` is one dataset (validation and test held out by the seed), a ``(train, val)`` or
    ``(train, val, test)`` tuple (the splits as given; no test split unless given), or a
    mapping ``{"train", "val", "test"}`` (split folders: a split that is None is held out of
    ``train`` by ``data.val_size`` / ``data.test_size`` and the seed). Item 0 of each given
    split is read once and ``data.transform`` is instantiated once, whatever the splits.

    Raises:
        ConfigError: data that is not map-style; ``data.val_size`` or ``data.test_size`` set
            for a split that is given; splits whose items differ in shape or whose ``classes``
            differ; anything :func:`ddp_exp.data.lazy.describe` refuses.
    """
    from ddp_exp.data import lazy

    target = data_cfg["_target_"]
    if isinstance(made, Mapping):  # {"train", "val", "test"}, None where absent: hold out
        parts, mode = {k: made.get(k) for k in _SPLITS}, "named"
        for key, split in (("val_size", "val"), ("test_size", "test")):
            if parts[split] is not None and data_cfg.get(key):
                raise ConfigError(f"data.{key}={data_cfg[key]} is invalid here: data.path has a "
                                  f"{split}/ folder, the {split} split, so nothing is held out; "
                                  f"set data.{key}=0")
        listed = [p for p in parts.values() if p is not None]
        got = "a mapping {" + ", ".join(f"{k!r}: {type(v).__name__}" for k, v in made.items())
        got += "}"
        bad = parts["train"] is None or not all(lazy.is_map_style(p) for p in listed)
    else:
        given = isinstance(made, (tuple, list))
        listed = list(made) if given else [made]
        parts = dict(zip(_SPLITS, listed + [None] * (3 - len(listed)), strict=False))
        mode = "given" if given else "single"
        got = (f"a {type(made).__name__} of {len(listed)}: "
               f"{', '.join(type(p).__name__ for p in listed)}" if given else type(made).__name__)
        bad = given and len(listed) not in (2, 3) or not all(lazy.is_map_style(p) for p in listed)
    if bad:
        hint = (" (an IterableDataset cannot be sharded exactly: give a map-style one)"
                if any(isinstance(p, _iterable_dataset()) for p in listed) else "")
        raise ConfigError(f"data._target_={target!r} returned {got}, not a map-style dataset "
                          f"(an object with __len__ and __getitem__, e.g. a torch.utils.data."
                          f"Dataset) or a (train, val) or (train, val, test) tuple of them{hint}")
    if mode == "given":
        for key, index in (("val_size", 1), ("test_size", 2)):
            if len(listed) > index and data_cfg.get(key):
                split = key.split("_")[0]
                raise ConfigError(f"data.{key}={data_cfg[key]} is invalid here: the data comes "
                                  f"with its own {split} split (a {split}/ folder or a dataset of "
                                  f"the tuple data._target_ returned), so nothing is held out; "
                                  f"set data.{key}=0")
    reader = lazy.ItemReader(data_cfg.get("input_key"), data_cfg.get("target_key"))
    is_folder, train_tf, eval_tf = _transforms(parts["train"], data_cfg)
    task = "classification" if is_folder else data_cfg.get("task", "auto")
    with seeded(seed):  # item 0 read here draws the same numbers in every rerun
        return _describe_and_split(parts, mode, reader, task, data_cfg, train_tf, eval_tf,
                                   seed, world_size)


def _transforms(train: Any, data_cfg: Mapping[str, Any]):
    """``(is_folder, train_tf, eval_tf)``: for an image folder, the training and evaluation
    batch transforms (:class:`ddp_exp.data.image_batch.ImageBatch`), ``data.transform`` built once
    and shared by every split; None and None for other data."""
    from ddp_exp.data import image_batch, images

    if not isinstance(train, images.ImageFolder):
        return False, None, None
    mean, std = data_cfg.get("mean"), data_cfg.get("std")
    _check_normalisation(mean, std, train.channels)
    user = data_cfg.get("transform")
    transform = None
    if user is not None:
        from ddp_exp.config.targets import instantiate_node

        transform = instantiate_node(user, "data.transform")
        if not callable(transform):
            raise ConfigError(f"data.transform._target_={user.get('_target_')!r} built a "
                              f"{type(transform).__name__}, which is not callable")
    return (True, image_batch.ImageBatch(mean, std, bool(data_cfg.get("augment")), transform),
            image_batch.ImageBatch(mean, std))


def _describe_and_split(parts, mode, reader, task, data_cfg, train_tf, eval_tf, seed,
                        world_size) -> Datasets:
    import dataclasses

    from ddp_exp.data import lazy
    from ddp_exp.data.collate import Padding

    target = data_cfg["_target_"]
    train = parts["train"]
    shape, num_classes, width, first = lazy.describe(
        train, reader, task, data_cfg.get("num_classes"), train_tf,
        "data._target_'s" if mode == "single" else "training")

    padding = Padding(data_cfg.get("pad_value", 0), data_cfg.get("ignore_index", -100),
                      bool(data_cfg.get("shift_labels")))
    first_target = reader(first)[1]
    # Class labels per element (tokens, pixels): any target of more than one label.
    elementwise = bool(num_classes) and (first_target.numel() > 1 or padding.shift_labels)

    def whole(dataset) -> lazy.TorchSplit:
        return lazy.TorchSplit(dataset, np.arange(len(dataset), dtype=np.int64), reader, shape,
                               num_classes, width, elementwise=elementwise, padding=padding)

    own = {}  # the given validation and test splits
    for key in ("val", "test"):
        if parts[key] is None:
            continue
        name = _SPLIT_NAMES[key]
        other = lazy.describe(parts[key], reader, task, num_classes, eval_tf, name)
        # Lengths may differ (sequences are padded per batch); the other dimensions may not.
        if (len(other[0]), other[0][1:], other[2]) != (len(shape), shape[1:], width):
            raise ConfigError(f"data._target_={target!r}: {name} items have input shape "
                              f"{list(other[0])} but training items {list(shape)}")
        _check_same_classes(train, parts[key], name, target)
        own[key] = whole(parts[key])
    if mode == "given":
        datasets = Datasets(train=whole(train), val=own["val"], test=own.get("test"))
        if datasets.test is None:  # no test split unless given
            datasets.test = datasets.train.subset(np.arange(0))
        if world_size > len(datasets.train):
            raise ConfigError(f"world_size={world_size} is invalid: the training split has "
                              f"only {len(datasets.train)} samples and every rank needs one")
    else:  # one dataset, or split folders: hold out what is not given
        held = build_datasets(whole(train), 0 if "val" in own else data_cfg["val_size"], seed,
                              world_size, 0 if "test" in own else data_cfg.get("test_size", 0))
        datasets = Datasets(train=held.train, val=own.get("val", held.val),
                            test=own.get("test", held.test))
    return Datasets(train=dataclasses.replace(datasets.train, transform=train_tf),
                    val=dataclasses.replace(datasets.val, transform=eval_tf),
                    test=dataclasses.replace(datasets.test, transform=eval_tf),
                    items_read={0: first})


def _check_same_classes(train: Any, part: Any, name: str, target: str) -> None:
    """Given splits that both say their ``classes`` must say the same, in the same order: label
    ``i`` names ``classes[i]`` in every split (torchvision numbers a folder's classes by its own
    sorted names, so a split missing a class would renumber the rest silently).

    Raises:
        ConfigError: the lists differ; one line naming both.
    """
    mine, theirs = getattr(train, "classes", None), getattr(part, "classes", None)
    if mine is None or theirs is None:
        return
    try:
        mine, theirs = list(mine), list(theirs)
        same = bool(mine == theirs)
    except Exception:  # not a list of comparable names: nothing to compare
        return
    if not same:
        pairs = zip(mine, theirs, strict=False)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(mine), len(theirs)))
        raise ConfigError(f"data._target_={target!r}: the {name} dataset's classes "
                          f"{_class_list(theirs)} differ from the training dataset's "
                          f"{_class_list(mine)} (from label {first} on), so a label would name "
                          f"another class in each split; build the {name} dataset with the "
                          "training dataset's classes")


def _class_list(classes: list) -> str:
    """A class list for a one-line message: whole up to 10 names, else its head and length."""
    if len(classes) <= 10:
        return repr(classes)
    return f"[{', '.join(map(repr, classes[:5]))}, ... ({len(classes)} classes)]"


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
