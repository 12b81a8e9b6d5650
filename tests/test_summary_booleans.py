"""``summary.csv`` spells booleans ``true``/``false`` (issue 41 item 4): it wrote Python's
``True``/``False`` beside the lower case of ``status.json`` and ``metrics.json``; lower case is
what JSON and YAML write and what pandas' ``read_csv`` reads back as ``bool``."""

from __future__ import annotations

import csv

import pytest

from ddp_exp.job.summary import write_summary

METRICS = {"val/accuracy": 0.9, "train/loss": 0.2, "wall_s": 3.0, "samples_per_sec": 1e4,
           "error": None}
ROWS = [
    {"job": 0, "overrides": ["optim.lr=0.1"], "status": "completed", "val/loss": 0.25,
     **METRICS, "stopped_early": True},
    {"job": 1, "overrides": ["optim.lr=0.2"], "status": "completed", "val/loss": 0.5,
     **METRICS, "stopped_early": False},
    {"job": 2, "overrides": ["optim.lr=0.3"], "status": "failed", "val/loss": None,
     **METRICS, "stopped_early": None},
]


@pytest.fixture
def summary(tmp_path):
    write_summary(str(tmp_path), ROWS)
    return tmp_path


def test_booleans_are_lower_case_in_the_csv_and_the_table(summary):
    with open(summary / "summary.csv", newline="") as fh:
        cells = [row["stopped_early"] for row in csv.DictReader(fh)]
    assert cells == ["true", "false", ""]
    table = (summary / "summary.md").read_text()
    assert "True" not in table and "False" not in table
    assert "| true |" in table and "| false |" in table


def test_pandas_reads_them_back_as_bool(summary):
    pandas = pytest.importorskip("pandas")
    frame = pandas.read_csv(summary / "summary.csv")
    assert frame["stopped_early"].tolist()[:2] == [True, False]
    assert all(type(v) is bool for v in frame["stopped_early"].tolist()[:2])
