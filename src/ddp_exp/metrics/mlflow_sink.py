"""``logger=mlflow``: one MLflow run per job, through ``mlflow.tracking.MlflowClient``.

The run is created by the launching process when the job first starts, before its ranks
(tags: the job folder, the sweep folder and job number of a multirun, so a sweep's jobs are runs
of one experiment, tagged alike), and its id kept in ``<job>/trackers.json``; every later
start of the job (a resume of any kind, an elastic restart) reopens it. Its parameters are the
flattened config, logged once; its metrics the writer's scalars at their global steps, and
``final/<name>`` for each number of ``metrics.json``. A run that ends without finishing is
marked KILLED until a resume reopens it.

An unreachable server fails fast: the client's HTTP retries are bounded here (2 retries, 1 s
backoff, 30 s timeout) unless the user set MLflow's own variables, instead of MLflow's 7
retries over ~4 minutes. Uses :mod:`ddp_exp.metrics.trackers` (the record).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from ddp_exp.metrics.trackers import read_record, write_record

# MLflow's HTTP client settings, unless set: fail within seconds when the server is down.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
MAX_PARAMS_PER_BATCH = 100  # MLflow's limits (mlflow.utils.validation)
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_LENGTH = 6000


class MLflowSink:
    """One MLflow run (see the module's docstring).

    Args:
        job_dir: the job folder (``trackers.json``).
        tracking_uri: the store (``sqlite:///...``) or server (``http://...``).
        experiment: the experiment's name (created when missing).
        run_name: the run's name.
        tags: the run's tags (``job_dir``, ``sweep``, ``job_num``).
        artifact_root: where a new experiment keeps artifacts (a local store: beside it), or None.
        error: why the launching process could not create the run (then :meth:`open` raises
            it: one warning, no second wait for an unreachable server).
    """

    name = "mlflow"

    def __init__(self, job_dir: str, tracking_uri: str, experiment: str, run_name: str,
                 tags: Mapping[str, str], artifact_root: str | None = None,
                 error: str | None = None):
        self.job_dir, self.uri, self.experiment = job_dir, tracking_uri, experiment
        self.error = error
        self.run_name, self.tags, self.artifact_root = run_name, dict(tags), artifact_root
        self.client: Any = None
        self.run_id: str | None = None

    def connect(self) -> Any:
        """The client (MLflow's HTTP retries bounded, its INFO lines and urllib3's retry
        warnings quiet: the one line is the trackers')."""
        if self.client is None:
            for key, value in HTTP_DEFAULTS.items():
                os.environ.setdefault(key, value)
            for name in ("mlflow", "alembic"):  # "Creating initial MLflow database tables..."
                logging.getLogger(name).setLevel(logging.WARNING)
            logging.getLogger("urllib3").setLevel(logging.ERROR)
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=self.uri)
        return self.client

    def create_run(self) -> str:
        """The job's run id: the one ``trackers.json`` names for this store, else a new run
        (the experiment created when missing), recorded there. The launching process calls it
        before the ranks start (:func:`ddp_exp.launch.tracker_plan.start_trackers`), so that
        the store's creation and the run's do not share rank 0's GIL with the first epochs."""
        known = read_record(self.job_dir).get(self.name) or {}
        if known.get("run_id") and known.get("tracking_uri") == self.uri:
            return known["run_id"]
        client = self.connect()
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is None:
            try:
                experiment_id = client.create_experiment(self.experiment,
                                                         artifact_location=self.artifact_root)
            except Exception:  # another job of the sweep created it meanwhile
                found = client.get_experiment_by_name(self.experiment)
                if found is None:
                    raise
                experiment_id = found.experiment_id
        else:
            experiment_id = experiment.experiment_id
        run_id = client.create_run(experiment_id, tags=self.tags,
                                   run_name=self.run_name).info.run_id
        write_record(self.job_dir, self.name, {"run_id": run_id, "experiment_id": experiment_id,
                                               "tracking_uri": self.uri})
        return run_id

    def open(self, params: Mapping[str, float | str], purge_step: int | None
             ) -> Mapping[str, int]:
        """Open the job's run (:meth:`create_run`), RUNNING; the parameters logged once;
        returns each metric's last step in the run."""
        if self.error is not None:  # the launching process could not reach the store
            raise RuntimeError(self.error)
        client = self.connect()
        self.run_id = self.create_run()
        run = client.get_run(self.run_id)
        client.update_run(self.run_id, status="RUNNING")
        if not run.data.params:
            from mlflow.entities import Param

            items = [Param(k, str(v)[:MAX_PARAM_LENGTH]) for k, v in params.items()]
            for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
                client.log_batch(self.run_id, params=items[i:i + MAX_PARAMS_PER_BATCH])
        return {key: max(m.step for m in client.get_metric_history(self.run_id, key))
                for key in run.data.metrics}

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """One ``log_batch`` of ``values`` at ``step``."""
        self.log_steps([(step, values)])

    def log_steps(self, entries: list[tuple[int, Mapping[str, float]]]) -> None:
        """``(step, values)`` of several steps in one ``log_batch`` (1000 metrics at most
        each): one transaction of the store instead of one per step."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for step, values in entries
                   for k, v in values.items()]
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH])

    def flush(self) -> None:
        """Nothing: each batch is written when logged."""

    def finish(self, step: int, final: Mapping[str, float]) -> None:
        """``final/<name>`` for each final metric at ``step``; the run FINISHED."""
        self.log(step, {f"final/{k}": v for k, v in final.items()})
        self.client.set_terminated(self.run_id, "FINISHED")
        self.run_id = None

    def close(self) -> None:
        """The run KILLED (a resume reopens it)."""
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, "KILLED")
            self.run_id = None
