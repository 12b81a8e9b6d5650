"""A user's own data file (``data=file``): ``.pt``, ``.npz`` or ``.csv`` of features and
targets, read whole into an :class:`ddp_exp.data.arrays.ArrayDataset`, with the task inferred
from the targets unless ``data.task`` says.

May use: :mod:`ddp_exp.data.arrays`, :mod:`ddp_exp.config` (``ConfigError``), NumPy, torch (to
read ``.pt``).
"""

from __future__ import annotations

import logging
import os
import warnings

import numpy as np

from ddp_exp.config.errors import ConfigError, first_line
from ddp_exp.data.arrays import ArrayDataset
from ddp_exp.io.files import load_failure

log = logging.getLogger(__name__)

_ALIASES = {"features": ("features", "x", "data", "inputs"), "targets": ("targets", "y", "target",
                                                                         "labels")}


def load_file(path: str, task: str = "auto") -> ArrayDataset:
    """A user's file of features and targets.

    ``.pt`` (``torch.load(weights_only=True)``) or ``.npz``: a mapping with ``features`` [N, ...]
    and ``targets`` [N] or [N, k] (also accepted: ``x``/``y``), or a pair ``(features, targets)``.
    ``.csv``: numeric columns, the last one the target; a non-numeric first row is a header.
    ``task=auto`` treats integer targets as class labels ``0..C-1`` (in a CSV: non-negative whole
    numbers below 1000 with at most 100 distinct values), anything else as regression; the
    inference is logged. Targets that are names (a CSV's ``cat``/``dog``, a string array) are
    classes: label ``i`` is the ``i``-th name in sorted order (:func:`classes_of`), the same
    for every rank and world size; the dataset's ``classes`` holds the names (rank 0 writes
    them to ``classes.json``).

    Raises:
        ConfigError: the file is missing, of an unknown kind, or its content is unusable.
    """
    if not str(path).strip():  # '' reads as the current folder: "is a directory" misled
        raise ConfigError(f"data.path={path!r} is empty; give a .pt, .npz or .csv file")
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

            try:
                obj = torch.load(full, map_location="cpu", weights_only=True)
            except Exception as exc:
                raise ConfigError(f"data.path={path!r}: cannot load it: "
                                  f"{load_failure(exc)}") from None
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
                          f"{first_line(exc, default='no detail')})") from exc
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
        cells = np.loadtxt(full, delimiter=",", skiprows=header, ndmin=2, dtype=str)
    cells = np.char.strip(cells)
    names = None
    if cells.shape[0] and cells.shape[1] >= 2 and not all(map(numeric, cells[:, -1])):
        names = cells[:, -1]  # a column of class names (cat, dog): labels by sorted name
        cells = cells[:, :-1]
    table = cells.astype(np.float64)  # a word among the features: one line naming data.path
    if names is not None:
        return table, names, None
    if table.shape[0] == 0:  # empty, or a header and no row
        raise ConfigError(f"data.path={full!r}: the CSV has no data rows"
                          + (f" (a header of {len(first)} column(s) only)" if header and any(first)
                             else ""))
    if table.shape[1] < 2:
        raise ConfigError(f"data.path={full!r}: a CSV needs feature columns and a last target "
                          f"column, found {table.shape[1]} column(s)")
    targets = table[:, -1]
    finite = np.isfinite(targets).all()
    integral = bool(finite and (targets >= 0).all() and (targets == np.round(targets)).all()
                    and len(np.unique(targets)) <= 100 and targets.max() < 1000)
    return table[:, :-1], targets, integral


def classes_of(names: np.ndarray, where: str) -> tuple[tuple[str, ...], np.ndarray]:
    """Class names ``[N]`` (strings) -> (the sorted distinct names, int64 labels ``[N]``):
    label ``i`` is the ``i``-th name in sorted (code point) order, so that every rank and
    every world size that reads the same file numbers the classes alike.

    Raises:
        ConfigError: fewer than two distinct names, or an empty name.
    """
    names = np.asarray([str(n).strip() for n in names.tolist()])
    if (names == "").any():
        row = int(np.flatnonzero(names == "")[0])
        raise ConfigError(f"{where}: target {row} is empty: every sample needs a class name")
    classes, labels = np.unique(names, return_inverse=True)  # np.unique sorts
    if len(classes) < 2:
        raise ConfigError(f"{where}: every target is {str(classes[0])!r}: classification needs at "
                          "least two classes")
    return tuple(str(c) for c in classes), labels.astype(np.int64)


def _to_dataset(features, targets, task: str, path: str, integral: bool | None) -> ArrayDataset:
    features = np.asarray(features)
    targets = np.asarray(targets)
    where = f"data.path={path!r}"
    if features.ndim < 2 or len(features) == 0:
        raise ConfigError(f"{where}: features must be [N, ...] with N >= 1, got shape "
                          f"{features.shape}")
    if len(targets) != len(features):
        raise ConfigError(f"{where}: {len(features)} feature rows but {len(targets)} targets")
    classes = None
    if targets.dtype.kind in "USO" and targets.ndim == 1:  # class names
        if task == "regression":
            raise ConfigError(f"{where}: data.task=regression needs numeric targets; these are "
                              "names (e.g. " + ", ".join(repr(str(t)) for t in targets[:2])
                              + "): leave data.task=auto or set it to classification")
        classes, targets = classes_of(targets, where)
        task = "classification"
    if not np.issubdtype(features.dtype, np.number) or not np.issubdtype(targets.dtype,
                                                                           np.number):
        raise ConfigError(f"{where}: features and targets must be numeric (targets may also "
                          "be class names, one per sample)")
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
            per_element = ("; labels per token or pixel train through data=dataset "
                           "(docs/sequences.md)" if targets.ndim > 1 else "")
            raise ConfigError(f"{where}: classification targets must be one label 0..C-1 per "
                              "sample (set data.task=regression for real-valued targets"
                              f"{per_element})")
        labels = targets.astype(np.int64)
        if classes is not None:
            return ArrayDataset(features, labels, num_classes=len(classes), classes=classes)
        return ArrayDataset(features, labels, num_classes=max(2, int(labels.max()) + 1))
    targets = targets.astype(np.float32).reshape(len(targets), -1)
    if not np.isfinite(targets).all():
        raise ConfigError(f"{where}: targets contain NaN or infinity")
    return ArrayDataset(features, targets, num_classes=0)
