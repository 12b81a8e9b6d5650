"""Sweeps: one summary per multirun, the sweep's failure, and what a job returns to the sweeper.

Every job writes ``status.json`` into its own folder (:func:`ddp_exp.job.folder.write_status`):
completed, failed or interrupted, its overrides, wall seconds and, if not completed, why. At
the end of a multirun, Hydra calls :class:`SummaryCallback` (``hydra.callbacks`` in
``conf/config.yaml``), which reads every job folder of the sweep (whichever launcher ran them:
sequential, joblib processes, submitit) and writes ``summary.csv``, ``summary.md`` and
``summary.png`` into the sweep folder. A failed job does not take the others' rows with it; the
callback then records the failure, and the entry point (which runs the sweep) raises
:class:`SweepFailed` from it, so the sweep still exits non-zero. (Hydra turns exceptions raised
inside callbacks into warnings.)
:func:`objective` is what a job returns to Hydra's sweeper (Optuna's worst value for a failed
job).

The summary's rows and files are :mod:`ddp_exp.job.summary`'s (its names re-exported here).

May use: :mod:`ddp_exp.config` (a job's overrides), :mod:`ddp_exp.io.files` (atomic writes),
:mod:`ddp_exp.job.summary`, :mod:`ddp_exp.job.folder` (which folders this process created).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ddp_exp.config.compose import task_overrides
from ddp_exp.io.files import atomic_write, read_json
from ddp_exp.job.folder import note_new_folders, remove_new_empty_folder
from ddp_exp.job.summary import (  # noqa: F401  (re-exported: the summary's names, as before)
    COLUMNS,
    WALL_S_NOTE,
    collect,
    columns,
    override_items,
    recipe_values,
    swept_keys,
    write_summary,
)

log = logging.getLogger("ddp_exp")


class SweepFailed(RuntimeError):
    """Some jobs of a multirun failed; the summary lists them."""


# Set by SummaryCallback.on_multirun_end in the process that ran the sweep; read and cleared by
# raise_if_failed. A module global because Hydra swallows exceptions from callbacks.
_failure: str | None = None
# The sweep folder of the multirun this process takes part in: set when the multirun starts
# (SummaryCallback) and by each job's task (a job may run in another process: slurm_local).
active_sweep_dir: str | None = None
# The sweep folder's multirun.yaml as it was before this multirun (Hydra's sweeper rewrites
# it before the first job): put back when the sweep is refused there (discard_refused_sweep).
_earlier_record: bytes | None = None
SWEEP_RECORD = "multirun.yaml"
# The names in the sweep folder when this multirun started (empty: no folder yet): a name that
# is not here at the end, other than the record, is a job's (discard_refused_sweep).
_names_before: frozenset[str] = frozenset()


def raise_if_failed() -> None:
    """Raise :class:`SweepFailed` if the multirun that just ended had failed jobs."""
    global _failure
    failure, _failure = _failure, None
    if failure:
        raise SweepFailed(failure)


def objective(value: float | None, sweeper: Any) -> float | None:
    """What a job returns to Hydra's sweeper: its final ``val/loss``, or NaN for a failed job.

    A sweeper that optimises (one with ``hydra.sweeper.direction``: Optuna) gets the worst value
    for its direction instead of NaN or None: ``inf`` when minimising, ``-inf`` when maximising.
    Optuna then records the trial as completed with that value, so it is never the best while
    any trial completed, and the search goes on. NaN would end it: Optuna refuses NaN, and the
    plugin's attempt to record the trial as failed with that value raises ("Values cannot be
    specified when state is TrialState.FAIL", hydra #2237). Which jobs failed stays in their
    ``status.json`` and the sweep summary; other sweepers ignore the value (NaN kept).
    """
    direction = sweeper.get("direction") if hasattr(sweeper, "get") else None
    if direction is None or (value is not None and math.isfinite(value)):
        return value
    if isinstance(direction, Sequence) and not isinstance(direction, str):
        direction = direction[0]  # one objective: ddp_exp returns one value
    direction = getattr(direction, "name", direction)  # the plugin's Direction enum, or a str
    worst = -math.inf if str(direction).lower() == "maximize" else math.inf
    log.warning("this job has no finite val/loss (%s): the sweeper is told %s, the worst value "
                "for direction %s, and the search goes on", value, worst, direction)
    return worst


def log_config(cfg: Any) -> None:
    """Log the resolved config at a job's start (``print_config=true``): the whole of it in a
    single run and in a sweep's job 0; in a later job of a sweep, one line with the job's
    overrides on the console (the rest is what job 0 printed) and the whole config in the
    job's own ``ddp_exp.log``, so that every job folder still says exactly what it ran."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from ddp_exp.job.folder import log_to_job_log_only

    text = OmegaConf.to_yaml(cfg)
    hc = HydraConfig.get() if HydraConfig.initialized() else None
    if hc is None or hc.mode != RunMode.MULTIRUN or not hc.job.num:
        log.info("config:\n%s", text)
        return
    log_to_job_log_only(logging.INFO, f"config:\n{text}")
    overrides = " ".join(task_overrides(hc)) or "none"
    log.info("config: job 0's (printed above; the whole in this job's ddp_exp.log), with this "
             "job's overrides: %s", overrides)


def recorded_val_loss(job_dir: str) -> float:
    """``val/loss`` from a finished job's ``metrics.json``: what a skipped job returns to the
    sweeper (NaN when it has none)."""
    value = (read_json(os.path.join(job_dir, "metrics.json")) or {}).get("val/loss")
    return math.nan if value is None else float(value)


def summarize_interrupted(sweep_dir: str) -> None:
    """Write the summary of a sweep stopped by Ctrl-C or SIGTERM (Hydra then never calls
    ``on_multirun_end``): the jobs that finished, and the one that was running, ``interrupted``
    in its ``status.json``. Jobs the sweep never started have no folder and no row."""
    rows = collect(sweep_dir) if os.path.isdir(sweep_dir) else []
    if rows:
        write_summary(sweep_dir, rows)
        log.info("sweep interrupted; summary: %s",
                 os.path.join(os.path.abspath(sweep_dir), "summary.md"))


def discard_refused_sweep() -> bool:
    """Put the sweep folder back as it was when a multirun is refused before any job made its
    folder (an override that does not compose: ``-m model=mlp,nonexistent``; Hydra's sweeper
    writes ``multirun.yaml`` first and composes the jobs next): the earlier sweep's
    ``multirun.yaml`` goes back, or the refused one is removed, and the folder goes too if this
    multirun created it and it is empty (with the folders made on the way to it). Does nothing
    once a job has put anything into the folder.

    Returns:
        True when the folder was put back.
    """
    if active_sweep_dir is None:
        return False
    try:
        new = set(os.listdir(active_sweep_dir)) - _names_before - {SWEEP_RECORD}
    except OSError:
        return False
    if new:  # a job started: its folder and the record stay
        return False
    if _earlier_record is not None:  # the sweep that ran there before: its record goes back
        record = _earlier_record
        try:
            atomic_write(os.path.join(active_sweep_dir, SWEEP_RECORD),
                         lambda fh: fh.write(record))
        except OSError:  # a folder that cannot be written: nothing was changed in it
            return False
    else:
        try:
            os.remove(os.path.join(active_sweep_dir, SWEEP_RECORD))
        except FileNotFoundError:
            pass
        except OSError:  # a folder that cannot be written (read-only): Hydra wrote nothing
            return False
        remove_new_empty_folder(active_sweep_dir)
    return True


class SummaryCallback(Callback):
    """Hydra callback: notes the sweep folder and its earlier ``multirun.yaml`` when a multirun
    starts (:data:`active_sweep_dir`: a Ctrl-C still writes the summary,
    :func:`summarize_interrupted`; :func:`discard_refused_sweep`), writes the sweep summary
    when it ends (``on_multirun_end``), and records failed or unfinished jobs for
    :func:`raise_if_failed`."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global active_sweep_dir, _earlier_record, _names_before
        active_sweep_dir = str(config.hydra.sweep.dir)
        try:
            with open(os.path.join(active_sweep_dir, SWEEP_RECORD), "rb") as fh:
                _earlier_record = fh.read()
        except OSError:
            _earlier_record = None
        try:
            _names_before = frozenset(os.listdir(active_sweep_dir))
        except OSError:
            _names_before = frozenset()
        note_new_folders(active_sweep_dir)  # before Hydra's sweeper makes it

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _failure
        sweep_dir = config.hydra.sweep.dir
        if not os.path.isdir(sweep_dir):
            return
        rows = collect(sweep_dir)
        if not rows:
            return
        write_summary(sweep_dir, rows)
        log.info("sweep summary: %s", os.path.join(os.path.abspath(sweep_dir), "summary.md"))
        # an Optuna trial interrupted and rerun (ddp_exp.job.summary: "superseded") has
        # its final state in the rerun's row
        bad = [r for r in rows if r["status"] != "completed" and not r.get("superseded")]
        if bad:
            jobs = ", ".join(f"{r['job']} ({r['status']})" for r in bad)
            _failure = (f"{len(bad)} of {len(rows)} jobs did not complete: {jobs}; see "
                        f"{os.path.join(sweep_dir, 'summary.md')}")
