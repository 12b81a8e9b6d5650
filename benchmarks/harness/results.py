"""Where a run's numbers are kept: one CSV per group in ``benchmarks/results/`` holding the
latest measured rows of each of its variants (a run replaces the rows of the variants it ran and
keeps the others, so a run of a subset, ``--impls``, leaves the rest of the group as it was
measured; the history is git's), each row stamped with when and at which commit it was
measured; and the rows of docs/benchmarks.md's table of targets, one per target.

May use: ``benchmarks.common`` (the paths), ``stats`` (Target).
"""

from __future__ import annotations

import csv
import datetime
import os
import subprocess

from benchmarks import common
from benchmarks.harness.stats import Target

RESULTS = os.path.join(common.BENCH, "results")
DOCS = os.path.join(common.ROOT, "docs", "benchmarks.md")
CSV_FIELDS = ["measured", "commit", "group", "variant", "impl", "workload", "world_size",
              "batch_size", "epochs", "repeat", "rc", "status", "samples_per_sec", "train_s",
              "wall_s", "wall_s_inside", "peak_rss_mib_per_rank", "peak_rss_mib_self_reported",
              "steady_rss_mib_self_reported",
              "world_pss_mib", "ranks_seen", "threads_per_rank", "train_loss", "val_loss",
              "val_accuracy", "model_flops_per_sec", "loadavg_1m", "other_cpu_cores",
              "state_mib_per_rank", "first_line_s", "ratio", "note"]
BEGIN, END = "<!-- targets: begin -->", "<!-- targets: end -->"
TABLE_HEAD = ["| target | what | latest | bound | result | measured (UTC, commit) | reproduce |",
              "|---|---|---|---|---|---|---|"]


def stamp() -> dict[str, str]:
    """``measured`` (UTC, to the minute) and ``commit`` (the checkout's short hash, ``+dirty``
    where ``src/`` or ``benchmarks/`` outside ``benchmarks/results/`` has uncommitted changes;
    ``unknown`` outside git)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=common.ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD") or "unknown"
        # the results files themselves are not the code that measured them
        if git("status", "--porcelain", "--", "src", "benchmarks", ":!benchmarks/results"):
            commit += "+dirty"
    except (OSError, subprocess.TimeoutExpired):
        commit = "unknown"
    return {"measured": now, "commit": commit}


def _cell(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else ("" if v is None else str(v))


def write_csv(rows: list[dict], path: str) -> None:
    """``rows`` as a CSV of :data:`CSV_FIELDS` (other keys are left out)."""
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _cell(v) for k, v in r.items()})


def read_csv(path: str) -> list[dict]:
    """The rows of a results CSV as strings (``[]`` if there is none)."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


TEXT = {"measured", "commit", "group", "variant", "impl", "workload", "status", "note"}
INTEGER = {"world_size", "batch_size", "epochs", "repeat", "rc", "ranks_seen", "threads_per_rank"}


def load_rows(group: str, folder: str | None = None) -> list[dict]:
    """``folder/<group>.csv`` (default :data:`RESULTS`) as the runner's rows: numbers as
    numbers, empty cells as None."""
    rows = []
    for r in read_csv(os.path.join(folder or RESULTS, f"{group}.csv")):
        row: dict = {}
        for k, v in r.items():
            if k in TEXT:
                row[k] = v
            elif v == "" or v is None:
                row[k] = None
            else:
                row[k] = int(float(v)) if k in INTEGER else float(v)
        rows.append(row)
    return rows


def when_measured(rows: list[dict], t: Target) -> tuple[dict[str, str], int]:
    """When and at which commit ``t``'s runs were measured (its latest row), and the fewest
    successful runs of its two variants."""
    mine = [r for r in rows if r["variant"] in t.keys and r["status"] == "ok"]
    latest = max(mine, key=lambda r: r["measured"] or "")
    n = min(sum(r["variant"] == key for r in mine) for key in t.keys)
    return {"measured": latest["measured"], "commit": latest["commit"]}, n


def merge_group_csv(group: str, rows: list[dict], folder: str | None = None) -> str:
    """Write ``rows`` (one group's) into ``folder/<group>.csv`` (default :data:`RESULTS`) in
    place of the rows of the same variants, keeping the other variants' rows; returns the
    path."""
    path = os.path.join(folder or RESULTS, f"{group}.csv")
    ran = {r["variant"] for r in rows}
    kept = [r for r in read_csv(path) if r.get("variant") not in ran]
    write_csv(kept + rows, path)
    return path


def target_row(t: Target, measured: dict[str, str], runs: int, reproduce: str) -> str:
    """One row of docs/benchmarks.md's table: the target's key, what it compares, its ratio of
    medians, the bound, PASS/MISS, when, at which commit and over how many runs of each
    variant, and the command that measures it."""
    ratio = f"{t.ratio:.3f}" if t.ratio is not None else "n/a"
    return (f"| `{t.name}` | {t.what} | {ratio} | {t.bound_text} | {t.verdict} | "
            f"{measured['measured']}, `{measured['commit']}`, {runs} runs each | "
            f"`{reproduce}` |")


def update_docs_table(rows_by_key: dict[str, str], path: str | None = None) -> list[str]:
    """Replace the rows of ``rows_by_key``'s targets in the table between :data:`BEGIN` and
    :data:`END` of ``path`` (a target not there yet is added at the table's end), leaving every
    other line as it is (``path``: default :data:`DOCS`); returns the keys written. Raises
    ValueError if the markers are missing."""
    path = path or DOCS
    with open(path) as fh:
        lines = fh.read().splitlines()
    try:
        begin, end = lines.index(BEGIN), lines.index(END)
    except ValueError:
        raise ValueError(f"{path}: no {BEGIN} ... {END} around the table of targets") from None
    table = lines[begin + 1:end]
    left = dict(rows_by_key)
    for i, line in enumerate(table):
        key = line.split("`")[1] if line.startswith("| `") else None
        if key in left:
            table[i] = left.pop(key)
    last = max((i for i, line in enumerate(table) if line.startswith("|")), default=None)
    if last is None:
        table = [*TABLE_HEAD, *left.values(), *table]
    else:
        table[last + 1:last + 1] = list(left.values())
    with open(path, "w") as fh:
        fh.write("\n".join(lines[:begin + 1] + table + lines[end:]) + "\n")
    return list(rows_by_key)
