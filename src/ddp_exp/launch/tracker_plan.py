"""The trackers of a job, decided once in the launching process: :func:`plan_trackers` turns the
``logger`` group (:mod:`ddp_exp.config.loggers`) and Hydra's view of the job (its folder, the
sweep it belongs to, the experiment preset) into a :class:`ddp_exp.metrics.trackers.TrackerPlan`
that rank 0 opens. A tracker whose library is not installed is refused here, before any rank
starts, in one line naming the extra that installs it.

Uses :mod:`ddp_exp.config` and :mod:`ddp_exp.metrics.trackers`; the build step calls it.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ddp_exp.config.errors import ConfigError, described
from ddp_exp.config.loggers import TRACKER_EXTRAS
from ddp_exp.metrics.trackers import TrackerPlan

OUTPUTS = "outputs"  # the folder Hydra's default run and sweep folders are under
STORE = "mlflow.db"  # the local MLflow store's file


def check_extras(cfg: DictConfig) -> None:
    """Refuse a tracker whose library is missing.

    Raises:
        ConfigError: ``logger=mlflow`` without ``mlflow`` installed (the line names the extra).
    """
    for name, (module, extra) in TRACKER_EXTRAS.items():
        if OmegaConf.select(cfg, f"logger.{name}") is not None and (
                importlib.util.find_spec(module) is None):
            raise ConfigError(f"logger={name} needs the {module} library, which is not "
                              f"installed: pip install 'ddp_exp[{extra}]' (or leave {name} "
                              "out of the logger list)")


def store_folder(job_dir: str, sweep_dir: str | None) -> str:
    """Where a local tracker store goes: the nearest folder named ``outputs`` above the job
    folder (Hydra's default layout: every run and sweep of the project in one store, as
    ``tensorboard --logdir outputs`` sees them), else the sweep's folder, else the job's."""
    path = os.path.abspath(job_dir)
    while True:
        parent = os.path.dirname(path)
        if os.path.basename(path) == OUTPUTS:
            return path
        if parent == path:
            break
        path = parent
    return os.path.abspath(sweep_dir) if sweep_dir else os.path.abspath(job_dir)


def _hydra_job() -> tuple[str | None, str | None, str]:
    """(the sweep folder of a multirun or None, its job number or None, the experiment
    preset's name or Hydra's job name)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None, None, "ddp_exp"
    hc = HydraConfig.get()
    experiment = hc.runtime.choices.get("experiment") or hc.job.name or "ddp_exp"
    if hc.mode == RunMode.MULTIRUN:
        return os.path.abspath(hc.sweep.dir), str(hc.job.num), experiment
    return None, None, experiment


def preload_trackers(plan: TrackerPlan) -> None:
    """Import the trackers' libraries here, in the process that owns the job folder (rank 0's
    under torchrun, task 0's in a cluster job): forked ranks inherit them, so rank 0's tracker
    thread does not import them (1-2 s of Python holding the GIL) while the first epochs
    train."""
    if plan.mlflow is not None:
        import mlflow.entities  # noqa: F401
        import mlflow.tracking  # noqa: F401
    if plan.wandb is not None:
        import wandb  # noqa: F401


def start_trackers(plan: TrackerPlan) -> None:
    """Once every check has passed, before any rank starts, in the process that owns the job
    folder (one per job: two would create two runs): create or find the job's MLflow run
    (:meth:`ddp_exp.metrics.mlflow_sink.MLflowSink.create_run`: the store's creation, seconds
    of Python, is not rank 0's during training).
    A failure is noted in the plan for rank 0's tracker to report in its one line."""
    if plan.mlflow is None:
        return
    from ddp_exp.metrics.mlflow_sink import MLflowSink

    try:
        MLflowSink(job_dir=plan.job_dir, **plan.mlflow).create_run()
    except Exception as exc:  # reported once, by rank 0's tracker (a tracker stops nothing)
        plan.mlflow["error"] = described(exc)


def plan_trackers(cfg: DictConfig, job_dir: str) -> TrackerPlan:
    """The job's :class:`TrackerPlan` (see the module's docstring).

    Raises:
        ConfigError: a tracker's library is not installed (:func:`check_extras`).
    """
    check_extras(cfg)
    job_dir = os.path.abspath(job_dir)
    sweep_dir, job_num, experiment = _hydra_job()
    root = store_folder(job_dir, sweep_dir)
    run_name = os.path.relpath(job_dir, root) if job_dir != root else os.path.basename(job_dir)
    plan = TrackerPlan(job_dir=job_dir)
    csv = OmegaConf.select(cfg, "logger.csv")
    if csv is not None:
        plan.csv = csv.name
    tags: dict[str, Any] = {"job_dir": job_dir}
    if sweep_dir is not None:
        tags.update({"sweep": sweep_dir, "job_num": job_num})
    ml = OmegaConf.select(cfg, "logger.mlflow")
    if ml is not None:
        uri = ml.tracking_uri or f"sqlite:///{os.path.join(root, STORE)}"
        local = ml.tracking_uri is None
        plan.mlflow = {"tracking_uri": uri, "experiment": ml.experiment_name or experiment,
                       "run_name": ml.run_name or run_name, "tags": tags,
                       "artifact_root": os.path.join(root, "mlartifacts") if local else None}
    wb = OmegaConf.select(cfg, "logger.wandb")
    if wb is not None:
        project = wb.project or (ml.experiment_name if ml is not None else None) or experiment
        plan.wandb = {"mode": wb.mode, "project": project, "entity": wb.entity,
                      "run_name": wb.run_name or run_name,
                      "group": None if sweep_dir is None else os.path.relpath(sweep_dir, root)
                      if sweep_dir != root else os.path.basename(sweep_dir)}
    return plan
