"""What a ddp_optuna sweep leaves in its folder: ``optimization_results.yaml`` (the best trial,
the count per state, the epochs pruning saved) and ``optuna_trials.json`` (per job folder, the
trial's state, value and curve: the sweep summary's source, :mod:`ddp_exp.job.pruning`)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from hydra_plugins.ddp_optuna_sweeper.trials import reruns

log = logging.getLogger("ddp_exp")

RESULTS = "optimization_results.yaml"


def write_results(study: Any, sweep_dir: str, monitor: str, direction: str,
                  epochs: int | None) -> None:
    """Write both files atomically into ``sweep_dir``.

    ``optimization_results.yaml``: ``best_params`` and ``best_value`` (the best COMPLETE
    trial by ``monitor`` at its last epoch, the value Optuna optimises: ``objective`` says so;
    a trial's best epoch, ``best/<monitor>`` in its metrics.json, is not what the search
    ranks), ``states`` (trials per state), ``reruns`` (interrupted trial -> the trial that
    reran its params), ``epochs_run`` (each COMPLETE or PRUNED trial's metrics.json
    ``epoch``: ``trainer.max_steps`` and early stopping count) and ``epochs_without_pruning``
    (a pruned trial at ``trainer.epochs``, a complete one at what it ran).
    """
    import yaml

    from ddp_exp.io.files import atomic_write
    from ddp_exp.job.pruning import TRIALS_RECORD

    trials = study.get_trials(deepcopy=False)
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
    ran = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]
    run = sum(t.user_attrs.get("epochs_run", t.user_attrs.get("pruned_at_epoch") or epochs
                               or 0) for t in ran)
    full = sum((epochs or 0) if t.state.name == "PRUNED"
               else t.user_attrs.get("epochs_run", epochs or 0) for t in ran)
    try:
        best = study.best_trial
        best_params, best_value = dict(best.params), best.value
    except ValueError:  # no COMPLETE trial
        best_params, best_value = None, None
    rerun_as = reruns(trials)
    results = {"name": "ddp_optuna", "direction": direction,
               "objective": f"{monitor} at each trial's last epoch",
               "best_params": best_params, "best_value": best_value, "states": counts,
               "reruns": rerun_as, "epochs_run": run, "epochs_without_pruning": full}
    folders = _job_folders(sweep_dir) if any(
        "job" not in t.user_attrs for t in trials if t.state.name != "WAITING") else {}
    named = [(t.user_attrs.get("job") or folders.get(t.number), t) for t in trials]
    record = {job: {
        "number": t.number, "state": t.state.name, "metric": monitor, "value": t.value,
        "pruned_at_epoch": t.user_attrs.get("pruned_at_epoch"),
        "interrupted": bool(t.user_attrs.get("interrupted")),
        "rerun_as": rerun_as.get(t.number),
        "curve": sorted([step, v] for step, v in t.intermediate_values.items())}
        for job, t in named if job}
    text = json.dumps(record, indent=1) + "\n"
    atomic_write(os.path.join(sweep_dir, TRIALS_RECORD), lambda fh: fh.write(text.encode()))
    path = os.path.join(sweep_dir, RESULTS)
    text = yaml.safe_dump(results, sort_keys=False)
    atomic_write(path, lambda fh: fh.write(text.encode()))
    log.info("best %s: %s (%s)", direction, best_value, os.path.abspath(path))


def _job_folders(sweep_dir: str) -> dict[int, str]:
    """``{hydra.job.num: job folder name}`` of the jobs in ``sweep_dir`` (their
    ``.hydra/hydra.yaml``): the folder of a trial whose sweep was interrupted before the job
    returned (its trial has no ``job`` attribute)."""
    import yaml

    found = {}
    for name in os.listdir(sweep_dir):
        try:
            with open(os.path.join(sweep_dir, name, ".hydra", "hydra.yaml")) as fh:
                num = yaml.safe_load(fh)["hydra"]["job"]["num"]
        except (OSError, yaml.YAMLError, KeyError, TypeError):
            continue
        if isinstance(num, int):
            found[num] = name
    return found
