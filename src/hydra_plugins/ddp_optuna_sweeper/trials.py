"""The study's trials as the ddp_optuna sweeper counts them: a finished job's outcome, trials
left RUNNING by an interrupted sweep, the trials that count against ``n_trials``, and the grid's
points still to run.

An interrupted trial (the sweep stopped by Ctrl-C, SIGTERM or kill -9 while its job ran: the
journal has no heartbeat, so the trial is still RUNNING when the same sweep starts again in the
same folder) becomes FAIL with the user attribute ``interrupted`` and is rerun with its same
parameters: its copy is queued (``enqueue_trial``, as Optuna's ``RetryFailedTrialCallback``
does) with ``requeue_of`` naming it, and runs first. An interrupted trial does not count
against ``n_trials`` (its rerun does) and does not fail the sweep: its job folder stays, its
summary row says which trial reran it (``superseded``), and the sweep exits 0 once every trial
has a final state.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from typing import Any

log = logging.getLogger("ddp_exp")


def job_outcome(job_dir: str | None, monitor: str
                ) -> tuple[str, float | None, int | None, int | None]:
    """``(state, value, pruned_at_epoch, epochs_run)`` of a finished job from its folder's
    ``status.json`` and ``metrics.json``: ``COMPLETE`` (finite monitored value), ``PRUNED`` or
    ``FAIL``; ``epochs_run`` is metrics.json's ``epoch`` (``trainer.max_steps`` and early
    stopping end runs early too), None without one."""
    from ddp_exp.io.files import read_json

    folder = job_dir or ""
    status = read_json(os.path.join(folder, "status.json")) or {}
    metrics = read_json(os.path.join(folder, "metrics.json")) or {}
    epochs = metrics.get("epoch") if isinstance(metrics.get("epoch"), int) else None
    if status.get("status") != "completed" or not metrics:
        return "FAIL", None, None, epochs
    pruned = metrics.get("pruned_at_epoch")
    value = metrics.get(monitor)
    finite = isinstance(value, (int, float)) and math.isfinite(value)
    if pruned is not None:
        return "PRUNED", (float(value) if finite else None), int(pruned), epochs
    return ("COMPLETE", float(value), None, epochs) if finite else ("FAIL", None, None, epochs)


def requeue_interrupted(study: Any, storage: Any) -> None:
    """Trials left RUNNING by an interrupted sweep: FAIL (``interrupted``) in the study's
    ``storage``, each one's params queued once more (``requeue_of``: its number). A rerun that
    is interrupted in its turn is queued again: an interruption is not the parameters'
    doing."""
    import optuna

    study_id = storage.get_study_id_from_name(study.study_name)
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        tid = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        storage.set_trial_user_attr(tid, "interrupted", True)
        storage.set_trial_state_values(tid, optuna.trial.TrialState.FAIL)
        study.enqueue_trial(t.params, user_attrs={"requeue_of": t.number})
        log.info("trial %d was left running by an interrupted sweep: FAIL, requeued",
                 t.number)


def counts(trial: Any) -> bool:
    """Whether ``trial`` (a FrozenTrial) counts against ``n_trials``: COMPLETE, PRUNED, or a
    FAIL that was not an interruption."""
    name = trial.state.name
    return name in ("COMPLETE", "PRUNED") or (name == "FAIL"
                                             and not trial.user_attrs.get("interrupted"))


def reruns(trials: list[Any]) -> dict[int, int]:
    """``{interrupted trial's number: the number of the trial that reruns its params}``."""
    return {t.user_attrs["requeue_of"]: t.number for t in trials
            if t.user_attrs.get("requeue_of") is not None}


def grid_points_left(trials: list[Any], dists: dict[str, Any]) -> tuple[int, int]:
    """``(points left, points in all)`` of the grid of ``dists`` (categorical distributions):
    a point is taken by a trial that counts (:func:`counts`) or is running; an interrupted
    trial's point is left (its queued rerun takes it)."""
    keys = list(dists)
    grid = set(itertools.product(*(dists[k].choices for k in keys)))
    taken = {tuple(t.params.get(k) for k in keys) for t in trials
             if counts(t) or t.state.name == "RUNNING"}
    return len(grid - taken), len(grid)
