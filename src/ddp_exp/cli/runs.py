"""``ddp-exp runs [PATH ...]``: the runs under ``outputs/`` (or the given folders, sweeps
included) as one table, and ``ddp-exp runs --diff A B``: what differs between two runs.

A run is a job folder (one holding ``.hydra/config.yaml``). The table has, per run: its folder,
status (``status.json``; ``incomplete`` without one and without ``metrics.json``), the config
keys whose values differ between the runs shown (never the whole config; a config group whose
option differs shows as the group, ``model=cnn``, not as its keys), the final metrics of
``metrics.json`` and the wall seconds. ``--sort KEY`` orders it by a column (numbers
ascending, empty cells last), ``--csv`` prints CSV instead of aligned text. ``--diff A B``
prints each config key, group option and ``run.json`` entry (:mod:`ddp_exp.job.record`) that
differs, ``key: A -> B``. A list shows as a command line writes it, in the table, the CSV and
``--diff``: ``[tensorboard,csv,mlflow]``, ``[16,32]``; so does a group given several options
(``logger=[tensorboard,csv,mlflow]``), which Hydra leaves out of ``hydra.runtime.choices``: it is
read from the run's overrides.

May use: :mod:`ddp_exp.job` (the record, the sweep summary's readers), :mod:`ddp_exp.io.files`.
"""

from __future__ import annotations

import csv
import io
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ddp_exp.cli.one_line_parser import OneLineParser
from ddp_exp.io.files import read_json
from ddp_exp.job.folder import STATUS_FILE
from ddp_exp.job.record import RECORD
from ddp_exp.job.summary import table_cell

METRICS = ("val/loss", "val/accuracy", "train/epoch_loss")  # always shown when a run has them
SKIP_DIRS = {"checkpoints", "tensorboard", "wandb", "errors", ".hydra", "mlartifacts"}
# run.json entries that differ between any two runs: left out of --diff
RECORD_NOISE = ("start_time", "end_time", "wall_s", "attempts", "command", "status")


def find_runs(paths: Sequence[str]) -> list[str]:
    """Every job folder under ``paths`` (a path may be a job folder itself), sorted."""
    found = []
    for top in paths:
        for folder, dirs, _files in os.walk(top):
            if os.path.isfile(os.path.join(folder, ".hydra", "config.yaml")):
                found.append(os.path.normpath(folder))
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
    return sorted(set(found), key=_natural)


def _natural(path: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in path.split(os.sep)]


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{dotted.key: leaf}`` (lists kept whole)."""
    if not isinstance(node, Mapping):
        return {prefix: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


def run_config(job_dir: str) -> dict[str, Any]:
    """The run's config as composed (``.hydra/config.yaml``, interpolations unresolved),
    flattened, with each config group's option as ``<group>=`` keys (``.hydra/hydra.yaml``)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(os.path.join(job_dir, ".hydra",
                                                             "config.yaml")), resolve=False)
    values = flatten(cfg)
    hydra_yaml = os.path.join(job_dir, ".hydra", "hydra.yaml")
    if os.path.isfile(hydra_yaml):
        hydra_cfg = OmegaConf.load(hydra_yaml)
        choices = OmegaConf.select(hydra_cfg, "hydra.runtime.choices")
        choices = OmegaConf.to_container(choices) if choices else {}
        for group, option in choices.items():
            if not group.startswith(("hydra", "schema")):
                values[f"{group}="] = option
        overrides = OmegaConf.select(hydra_cfg, "hydra.overrides.task")
        for group, options in group_lists(OmegaConf.to_container(overrides) if overrides
                                          else [], cfg).items():
            if group not in choices:
                values[f"{group}="] = options
    return values


def group_lists(overrides: Sequence[str], cfg: Mapping[str, Any]) -> dict[str, list[Any]]:
    """``{group: [option, ...]}`` for each config group that ``overrides`` (a run's
    ``hydra.overrides.task``) gave several options, ``logger=[tensorboard,csv]`` (the last such
    override of a group wins); a top-level key the config holds a list in is a value, not a
    group. Hydra records no choice for such a group (``hydra.runtime.choices``, Hydra 1.3)."""
    import yaml  # omegaconf's own YAML parser

    found: dict[str, list[Any]] = {}
    for override in overrides:
        key, sep, text = str(override).lstrip("+").partition("=")
        if not sep or "." in key or key.startswith(("~", "hydra")) or isinstance(
                cfg.get(key), list):
            continue
        try:
            options = yaml.safe_load(text)
        except yaml.YAMLError:
            continue
        if isinstance(options, list):
            found[key] = options
    return found


def override_text(value: Any) -> str:
    """A value as a command-line override writes it: a list ``[tensorboard,csv]``, a mapping
    ``{a:1}``, None ``null``, a bool ``true``; a string with a space, comma, bracket, brace or
    quote (or empty) quoted, ``'a b'``; anything else as ``str``."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_text(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{override_text(v)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    if isinstance(value, str) and (not value or any(c in value for c in " \t,[]{}()'\"")):
        return repr(value)
    return str(value)


def shown(value: Any) -> str:
    """A config value as ``--diff`` shows it: a list as a command line writes it
    (:func:`override_text`), anything else as ``repr`` (``'cosine'``, ``0.01``, ``None``)."""
    return override_text(value) if isinstance(value, (list, tuple)) else repr(value)


def cell(value: Any) -> str:
    """A table cell (:func:`ddp_exp.job.summary.table_cell`), a list as a command line writes
    it (:func:`override_text`)."""
    return override_text(value) if isinstance(value, (list, tuple)) else table_cell(value)


def differing(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The keys whose value is not the same in every config (a missing key counts as a value);
    a key under a group whose option differs is left out (the group's column says it)."""
    keys = sorted({k for c in configs for k in c})
    differ = [k for k in keys if len({repr(c.get(k)) for c in configs}) > 1]
    groups = {k[:-1] for k in differ if k.endswith("=")}
    return [k for k in differ if k.endswith("=") or k.split(".")[0] not in groups]


def table(job_dirs: Sequence[str]) -> tuple[list[str], list[dict[str, Any]]]:
    """(columns, one row per run) of the runs table."""
    configs = [run_config(d) for d in job_dirs]
    keys = differing(configs) if len(job_dirs) > 1 else []
    rows, metric_keys = [], []
    for job_dir, config in zip(job_dirs, configs, strict=True):
        status = read_json(os.path.join(job_dir, STATUS_FILE)) or {}
        metrics = read_json(os.path.join(job_dir, "metrics.json")) or {}
        state = status.get("status") or ("completed" if metrics else "incomplete")
        if state == "completed" and not metrics:  # damaged or removed since: blank metrics
            state = "completed, metrics.json unreadable"
        row: dict[str, Any] = {"run": job_dir, "status": state}
        row.update({k.rstrip("="): config.get(k) for k in keys})
        for key in (*METRICS, *sorted(k for k in metrics if k.startswith(("test/", "best/")))):
            if key in metrics:
                row[key] = metrics[key]
                if key not in metric_keys:
                    metric_keys.append(key)
        row["wall_s"] = status.get("wall_s", metrics.get("time/total_s"))
        rows.append(row)
    return ["run", "status", *(k.rstrip("=") for k in keys), *metric_keys, "wall_s"], rows


def sort_rows(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """``rows`` by column ``key``: numbers ascending, then text, empty cells last."""
    def order(row: Mapping[str, Any]) -> tuple:
        value = row.get(key)
        if value is None:
            return (2, 0, "")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return (0, value, "")
        return (1, 0, cell(value))
    return sorted(rows, key=order)


def render(columns: Sequence[str], rows: Sequence[Mapping[str, Any]], as_csv: bool) -> str:
    """The table as aligned text, or CSV (every digit) with ``as_csv``."""
    if as_csv:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows({c: "" if r.get(c) is None else override_text(r[c]) if isinstance(
            r[c], (list, tuple)) else r[c] for c in columns} for r in rows)
        return out.getvalue()
    cells = [list(columns)] + [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "".join("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip()
                   + "\n" for line in cells)


def diff(a: str, b: str) -> list[str]:
    """``key: <A's> -> <B's>`` for each config key, group option and record entry that
    differs between job folders ``a`` and ``b``."""
    lines = []
    configs = [run_config(a), run_config(b)]
    for key in differing(configs):
        lines.append(f"{key.rstrip('=')}: {shown(configs[0].get(key))} -> "
                     f"{shown(configs[1].get(key))}")
    records = [flatten({k: v for k, v in (read_json(os.path.join(d, RECORD)) or {}).items()
                        if k not in RECORD_NOISE}) for d in (a, b)]
    for key in sorted(records[0].keys() | records[1].keys()):
        if records[0].get(key) != records[1].get(key):
            lines.append(f"record {key}: {records[0].get(key)!r} -> {records[1].get(key)!r}")
    return lines


def main(argv: Sequence[str]) -> int:
    """``ddp-exp runs`` (see the module's docstring); returns the exit status (2: no runs or a
    folder that is no run)."""
    parser = OneLineParser(prog="ddp-exp runs", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="folders of runs or sweeps (default: outputs)")
    parser.add_argument("--sort", metavar="KEY", help="order by this column, e.g. val/loss")
    parser.add_argument("--csv", action="store_true", help="print CSV")
    parser.add_argument("--diff", nargs=2, metavar=("A", "B"), help="what differs: A -> B")
    args = parser.parse_args(list(argv))
    if args.diff:
        for folder in args.diff:
            if not os.path.isfile(os.path.join(folder, ".hydra", "config.yaml")):
                print(f"error: {folder}: not a job folder (no .hydra/config.yaml)",
                      file=sys.stderr)
                return 2
        lines = diff(*args.diff)
        print("\n".join(lines) if lines else "no difference in config or record")
        return 0
    paths = args.paths or ["outputs"]
    job_dirs = find_runs(paths)
    if not job_dirs:
        print(f"error: no runs under {', '.join(paths)} (a run is a folder holding "
              ".hydra/config.yaml)", file=sys.stderr)
        return 2
    columns, rows = table(job_dirs)
    if args.sort:
        if args.sort not in columns:
            print(f"error: --sort {args.sort}: no such column; one of {', '.join(columns)}",
                  file=sys.stderr)
            return 2
        rows = sort_rows(rows, args.sort)
    sys.stdout.write(render(columns, rows, args.csv))
    return 0
