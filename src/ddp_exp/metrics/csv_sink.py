"""``logger=csv``: ``<job>/metrics.csv`` in Lightning's CSVLogger layout.

The header is ``step`` and every metric name, sorted (Lightning's ``_ExperimentWriter``); a
metric that first appears later rewrites the file with the wider header. Values logged at the
same step one after another (the training interval, then the epoch's validation) share one row:
a row per logged step. The final metrics go into the last step's row as ``final/<name>``
columns. A resume keeps the rows before its first step and logs the rest again, as TensorBoard's
``purge_step`` hides them, so the file equals the event stream. Values are written with
``repr`` (every digit). Uses :mod:`ddp_exp.io.files`; :mod:`ddp_exp.metrics.trackers` runs it.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping

from ddp_exp.io.files import atomic_write


class CSVSink:
    """One ``metrics.csv`` (see the module's docstring). Not thread-safe: the trackers' thread
    alone calls it."""

    name = "csv"

    def __init__(self, path: str):
        self.path = path
        self.keys: list[str] = []  # the header
        self.pending: dict[str, float | int] | None = None  # the last step's row, not written
        self.written: dict[str, float | int] | None = None  # the file's last row

    def open(self, params: Mapping[str, float | str], purge_step: int | None
             ) -> Mapping[str, int]:
        """A fresh run starts an empty file; a resume keeps the rows before ``purge_step``."""
        rows: list[dict[str, str]] = []
        if purge_step is not None and os.path.isfile(self.path):
            with open(self.path, newline="") as fh:
                reader = csv.DictReader(fh)
                self.keys = list(reader.fieldnames or [])
                rows = [r for r in reader if r.get("step") and int(r["step"]) < purge_step]
        self._rewrite(rows)
        return {}

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Add ``values`` to the row of ``step`` (a new row when the step changed or a value
        is already there)."""
        row = self.pending
        if row is not None and (row["step"] != step or any(k in row for k in values)):
            self._write(row)
            row = None
        if row is None:
            last = self.written
            if last is not None and last["step"] == step and not any(k in last for k in values):
                self._drop_last_row()  # written at a flush: the step's row again, completed
                row = self.pending = dict(last)
            else:
                row = self.pending = {"step": step}
        row.update(values)

    def flush(self) -> None:
        """Write the pending row."""
        if self.pending is not None:
            self._write(self.pending)
            self.pending = None

    def finish(self, step: int, final: Mapping[str, float]) -> None:
        """The final metrics as ``final/<name>`` in the row of ``step``; the file complete."""
        self.log(step, {f"final/{k}": v for k, v in final.items()})
        self.flush()

    def close(self) -> None:
        self.flush()

    def _drop_last_row(self) -> None:
        with open(self.path, newline="") as fh:
            rows = list(csv.DictReader(fh))
        self._rewrite(rows[:-1])
        self.written = None

    def _write(self, row: Mapping[str, float | int]) -> None:
        self.written = dict(row)
        if set(row) - set(self.keys):  # a new metric: the file is rewritten, wider
            with open(self.path, newline="") as fh:
                rows = list(csv.DictReader(fh))
            self.keys = sorted(set(self.keys) | set(row))
            self._rewrite([*rows, _cells(row)])
            return
        with open(self.path, "a", newline="") as fh:
            csv.DictWriter(fh, fieldnames=self.keys).writerow(_cells(row))

    def _rewrite(self, rows: list[Mapping[str, str]]) -> None:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=self.keys)
        if self.keys:
            writer.writeheader()
        writer.writerows(rows)
        atomic_write(self.path, lambda fh: fh.write(out.getvalue().encode()))


def _cells(row: Mapping[str, float | int]) -> dict[str, str]:
    return {k: repr(v) for k, v in row.items()}
