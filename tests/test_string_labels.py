"""Class names as targets in a user's file (issue 41, case F08; :mod:`ddp_exp.data.user_file`).

Before: ``data=file data.path=pets.csv`` with a last column of ``cat``/``dog`` failed with
"could not convert string 'dog' to float64". Names are classes now: label ``i`` is the
``i``-th name in sorted order, whatever order the file gives them in, and rank 0 writes the
names to ``classes.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ddp_exp.config.errors import ConfigError
from ddp_exp.data.user_file import load_file

# The file's first label is "dog": the mapping must follow sorted order, not first seen.
ROWS = [(0.5, 1.0, "dog"), (0.1, 0.2, "cat"), (0.9, 1.1, " bird"), (0.2, 0.1, "cat"),
        (0.7, 0.9, "dog")]


def _csv(path: Path, rows, header: str | None = "weight,height,label") -> Path:
    lines = ([header] if header else []) + [",".join(map(str, r)) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("header", ["weight,height,label", None])
def test_csv_names_become_sorted_class_labels(tmp_path, header):
    ds = load_file(str(_csv(tmp_path / "pets.csv", ROWS, header)))
    assert ds.classes == ("bird", "cat", "dog")  # stripped, sorted
    assert ds.num_classes == 3
    expected = [{"bird": 0, "cat": 1, "dog": 2}[r[2].strip()] for r in ROWS]
    assert ds.targets.tolist() == expected and ds.targets.dtype == np.int64
    np.testing.assert_array_equal(ds.features, np.array([r[:2] for r in ROWS], np.float32))
    # a split keeps the names (what rank 0 writes and the confusion matrix labels)
    assert ds.subset(np.array([1, 0])).classes == ds.classes


def test_npz_string_targets_are_classes_too(tmp_path):
    path = tmp_path / "pets.npz"
    np.savez(path, features=np.eye(4, dtype=np.float32),
             targets=np.array(["dog", "cat", "dog", "cat"]))
    ds = load_file(str(path))
    assert ds.classes == ("cat", "dog") and ds.targets.tolist() == [1, 0, 1, 0]


def test_numeric_labels_are_unchanged(tmp_path):
    ds = load_file(str(_csv(tmp_path / "n.csv", [(0.1, 0.2, 1), (0.3, 0.4, 0)])))
    assert ds.classes is None and ds.targets.tolist() == [1, 0] and ds.num_classes == 2


@pytest.mark.parametrize(("rows", "task", "says"), [
    ([(0.1, 0.2, "cat"), (0.3, 0.4, "cat")], "auto", "every target is 'cat'"),
    ([(0.1, 0.2, "cat"), (0.3, 0.4, "dog")], "regression", "data.task=regression needs numeric"),
    ([(0.1, "heavy", "cat"), (0.3, 0.4, "dog")], "auto", "cannot read it"),
])
def test_unusable_names_are_refused_in_one_line(tmp_path, rows, task, says):
    with pytest.raises(ConfigError) as refused:
        load_file(str(_csv(tmp_path / "bad.csv", rows)), task=task)
    assert says in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.slow
def test_a_run_on_named_classes_writes_classes_json(tmp_path):
    """A run at world_size 3 (every rank reads the file): trained as classification, the names
    in ``classes.json`` and as the confusion matrix's rows and columns."""
    from helpers import QUIET, run_once

    rng = np.random.default_rng(0)
    rows = [(round(float(rng.normal(4 if c == "dog" else 20, 2)), 2), 1.0, c)
            for c in rng.choice(["dog", "cat"], size=90)]
    _csv(tmp_path / "pets.csv", rows)
    run = run_once(tmp_path, "data=file", "data.path=pets.csv", "data.val_size=30",
                   "world_size=3", "trainer.epochs=1", QUIET)
    assert json.loads((run.job_dir / "classes.json").read_text())["classes"] == ["cat", "dog"]
    header = (run.job_dir / "confusion_matrix.csv").read_text().splitlines()[0]
    assert header.split(",")[1:] == ["cat", "dog"]
    assert run.metrics["val/num_samples"] == 30
