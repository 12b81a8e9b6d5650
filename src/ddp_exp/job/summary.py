"""The sweep summary: one row per job folder of a multirun, written as ``summary.csv``,
``summary.md`` and ``summary.png`` into the sweep folder (:func:`collect`,
:func:`write_summary`); :class:`ddp_exp.job.sweep.SummaryCallback` calls them when a multirun
ends. A job's overrides are read with Hydra's own override parser (:func:`override_items`).

May use: :mod:`ddp_exp.io.files` (atomic writes), :mod:`ddp_exp.job.pruning` (a ddp_optuna
sweep's trial states and curves), :mod:`ddp_exp.job.folder` (``status.json``'s name).
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
from collections.abc import Sequence
from typing import Any

from ddp_exp.io.files import atomic_write, best_effort, read_json
from ddp_exp.job import pruning
from ddp_exp.job.folder import STATUS_FILE

COLUMNS = ("job", "overrides", "status", "val/loss", "val/accuracy", "train/epoch_loss", "wall_s",
           "samples_per_sec", "error")
# Under summary.md's table: what wall_s measures, and why the first job's is longer.
WALL_S_NOTE = ("`wall_s`: seconds from the job's start to its end in the process that ran it "
               "(set-up, data, model, training, evaluation). The first job a process runs also "
               "pays one-off warm-up (imports such as torch._dynamo and TensorBoard, made once "
               "per process: seconds, often more than a small job's training), so its `wall_s` "
               "is longer for the same work: compare speed by `samples_per_sec`, which counts "
               "the training loop only.")
# The recipe's final values (issue 15), columns when some job has them: best/<monitor>,
# best/epoch, stopped_early, test/loss, test/accuracy, test/<metric>.
RECIPE_PREFIXES = ("best/", "test/")
RECIPE_KEYS = ("stopped_early",)


def recipe_values(metrics: dict[str, Any]) -> dict[str, Any]:
    """The recipe keys of a job's metrics.json (``test/num_samples`` left out)."""
    return {k: v for k, v in metrics.items()
            if (k.startswith(RECIPE_PREFIXES) or k in RECIPE_KEYS) and k != "test/num_samples"}


def columns(rows: list[dict[str, Any]]) -> list[str]:
    """:data:`COLUMNS` with the recipe keys any row has inserted before ``error``."""
    extra = sorted({k for row in rows for k in row if k not in COLUMNS})
    return [*COLUMNS[:-1], *extra, COLUMNS[-1]]


def collect(sweep_dir: str) -> list[dict[str, Any]]:
    """One row per job folder under ``sweep_dir`` (those holding ``.hydra/``), in job order;
    ``overrides`` is the job's list of override strings (summary.csv joins them with spaces).

    A job's status is its ``status.json``'s (``completed``, ``failed`` or ``interrupted``);
    without one, a job with ``metrics.json`` is ``completed`` and a job folder with neither
    (killed before it could write, or still running in another process) is ``incomplete``.
    """
    rows = []
    trials = pruning.trial_states(sweep_dir)  # hydra/sweeper=ddp_optuna: state, pruned_at_epoch
    for name in os.listdir(sweep_dir):
        job_dir = os.path.join(sweep_dir, name)
        if not os.path.isdir(os.path.join(job_dir, ".hydra")):
            continue
        status = read_json(os.path.join(job_dir, STATUS_FILE)) or {}
        metrics = read_json(os.path.join(job_dir, "metrics.json")) or {}
        state = status.get("status") or ("completed" if metrics else "incomplete")
        rows.append({
            "job": name,
            "overrides": list(status.get("overrides") or _overrides(job_dir)),
            "status": state,
            "val/loss": metrics.get("val/loss"),
            "val/accuracy": metrics.get("val/accuracy"),
            "train/epoch_loss": metrics.get("train/epoch_loss"),
            "wall_s": status.get("wall_s", metrics.get("time/total_s")),
            "samples_per_sec": metrics.get("train/samples_per_sec"),
            "error": status.get("error"),
            **recipe_values(metrics),
        })
        if trials is not None:  # the study's state; a trial it never recorded: FAIL
            trial = trials.get(name) or {}
            rows[-1].update(state=trial.get("state") or "FAIL",
                            pruned_at_epoch=trial.get("pruned_at_epoch"),
                            objective=trial.get("value"))
            if trial.get("interrupted"):  # rerun with its params: not a failure of the sweep
                rows[-1]["superseded"] = f"interrupted; rerun as trial {trial.get('rerun_as')}"
    rows.sort(key=lambda r: (not r["job"].isdigit(), int(r["job"]) if r["job"].isdigit()
                             else 0, r["job"]))
    return rows


def _overrides(job_dir: str) -> list[str]:
    from omegaconf import OmegaConf

    path = os.path.join(job_dir, ".hydra", "overrides.yaml")
    return list(OmegaConf.load(path)) if os.path.exists(path) else []


def override_items(overrides: Sequence[str] | str) -> dict[str, str]:
    """A job's overrides as ``{key: value}``, each parsed by Hydra's own override parser: the key
    as written (``+tag``, ``data@x``), the value as a string (a quoted one unquoted, ``'a b'``
    -> ``a b``). ``overrides`` is the job's list; a string (a summary row as summary.csv shows
    it) is split at spaces outside quotes. One that does not parse (not Hydra's) is split at
    its first ``=``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    if isinstance(overrides, str):  # split at spaces outside quotes, the quotes kept
        overrides = re.findall(r"""(?:[^\s'"]+|'[^']*'?|"[^"]*"?)+""", overrides)
    parser, items = OverridesParser.create(), {}
    for text in overrides:
        try:
            override = parser.parse_override(text)
            value = override.value()
            items[override.get_key_element()] = (
                value if isinstance(value, str) else override.get_value_element_as_str())
        except (HydraException, ValueError):
            key, _, value = text.partition("=")
            items[key] = value
    return items


def swept_keys(rows: list[dict[str, Any]]) -> list[str]:
    """Override keys whose value differs between jobs, in first-seen order."""
    values: dict[str, set[str]] = {}
    for row in rows:
        for key, value in override_items(row["overrides"]).items():
            values.setdefault(key, set()).add(value)
    return [k for k, v in values.items() if len(v) > 1]


def csv_cell(value: Any) -> Any:
    """A row's value as summary.csv holds it: a job's overrides joined with spaces; a boolean
    as ``true``/``false``, as JSON and YAML spell it (``status.json``, ``metrics.json``) and as
    pandas' ``read_csv`` reads back to ``bool`` (checked with pandas 3.1.1; Python's ``True``
    stood beside JSON's lower case in the same sweep folder)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return " ".join(value) if isinstance(value, list) else value


def table_cell(value: Any) -> str:
    """A value as a table shows it: floats to 6 significant digits, None as nothing (the
    sweep summary's markdown, ``ddp-exp runs``)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_summary(sweep_dir: str, rows: list[dict[str, Any]]) -> None:
    """``summary.csv`` (full precision), ``summary.md`` (a table) and ``summary.png``, each
    best-effort (:func:`ddp_exp.io.files.best_effort`: a full disk is one line, and the sweep's
    exit status still says which jobs failed)."""
    names = columns(rows)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=names, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else csv_cell(row[k]) for k in names})
    csv_path = os.path.join(sweep_dir, "summary.csv")
    best_effort(csv_path, lambda: atomic_write(csv_path, lambda fh: fh.write(
        buf.getvalue().encode())))
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    for row in rows:
        cells = [table_cell(csv_cell(row.get(k))).replace("|", "\\|").replace("\n", " ")
                 for k in names]
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n\n" + "\n\n".join([WALL_S_NOTE, *_optuna_notes(
        rows, pruning.trial_states(sweep_dir))]) + "\n"
    md_path = os.path.join(sweep_dir, "summary.md")
    best_effort(md_path, lambda: atomic_write(md_path, lambda fh: fh.write(text.encode())))
    _plot(sweep_dir, rows)


def _optuna_notes(rows: list[dict[str, Any]], record: dict[str, Any] | None) -> list[str]:
    """Under a ddp_optuna sweep's table: what ``objective`` is (the value the search ranks
    trials by, beside the best epoch's), and what ``superseded`` means, when a row has it."""
    if record is None:
        return []
    metric = next((r.get("metric") for r in record.values() if r.get("metric")), "the metric")
    notes = [f"`objective`: the value the Optuna search optimises and ranks trials by: "
             f"`{metric}` at the trial's last epoch (a pruned trial's: the epoch it stopped "
             f"after), as in optimization_results.yaml. `best/{metric}` and `best/epoch` are "
             f"the trial's best epoch (`checkpoints/best.pt`), which the search does not rank "
             f"by."]
    if any(r.get("superseded") for r in rows):
        notes.append("`superseded`: the sweep was interrupted while this trial trained; the "
                     "trial named reran its parameters, and it counts neither against "
                     "`n_trials` nor as a failed job.")
    return notes


def _plot(sweep_dir: str, rows: list[dict[str, Any]]) -> None:
    """Final metrics and throughput against the swept parameter (or the job, if several)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = swept_keys(rows)
    done = [r for r in rows if r["status"] == "completed"]
    x_label, xs, numeric = "job", [r["job"] for r in done], False
    if len(keys) == 1:
        values = [override_items(r["overrides"]).get(keys[0], "") for r in done]
        try:
            xs, numeric = [float(v) for v in values], True
        except ValueError:
            xs = values
        x_label = keys[0]
    metrics = [("val/loss", "val/loss"), ("val/accuracy", "val/accuracy"),
               ("train/epoch_loss", "train/epoch_loss"), ("samples_per_sec", "train samples/s")]
    trials = pruning.trial_states(sweep_dir)
    fig, axes = plt.subplots(1, len(metrics) + bool(trials),
                             figsize=(4 * (len(metrics) + bool(trials)), 3.2))
    if trials:  # a ddp_optuna sweep: each trial's curve, pruned ones cut
        pruning.plot_curves(axes[-1], trials)
    for ax, (key, title) in zip(axes, metrics, strict=False):
        ys = [r[key] if r.get(key) is not None else math.nan for r in done]
        if numeric:
            order = sorted(range(len(xs)), key=lambda i: xs[i])
            ax.plot([xs[i] for i in order], [ys[i] for i in order], marker="o")
            if len(set(xs)) > 2 and min(xs) > 0 and max(xs) / min(xs) >= 8:
                ax.set_xscale("log", base=2)
        else:
            ax.bar(range(len(xs)), ys)
            ax.set_xticks(range(len(xs)), [str(x) for x in xs], rotation=45)
        ax.set_title(title)
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
    failed = len(rows) - len(done)
    pruned = sum(1 for r in rows if r.get("state") == "PRUNED")
    fig.suptitle(f"{os.path.basename(os.path.normpath(sweep_dir))}: {len(done)} completed"
                 + (f" ({pruned} pruned)" if pruned else "") + (f", {failed} failed" if failed
                                                                 else ""))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    png_path = os.path.join(sweep_dir, "summary.png")
    best_effort(png_path, lambda: atomic_write(png_path, lambda fh: fh.write(buf.getvalue())))
