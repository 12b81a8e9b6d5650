"""``logger=wandb``: one Weights & Biases run per job, offline by default.

The run lives in ``<job>/wandb/`` (offline: ``wandb/offline-run-<time>-<id>/``, uploaded later
with ``wandb sync``); its id is kept in ``<job>/trackers.json`` and a resume reopens it
(``resume="allow"``, same id). Its config is the flattened config; its history the writer's
scalars at their global steps; its summary ``metrics.json``'s numbers as ``final/<name>``
(float64), written at the end. W&B's console capture and system metrics are off: the job log
and the ``perf/*`` scalars have them. Uses :mod:`ddp_exp.metrics.trackers` (the record).

An offline run knows nothing of what an earlier attempt logged, so the steps past a resume's
checkpoint are kept from the earlier attempt's files only: ``wandb sync`` of both offline folders
gives one run whose steps W&B orders (a step logged twice keeps its last value).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any

from ddp_exp.metrics.trackers import read_record, write_record


class WandbSink:
    """One W&B run (see the module's docstring).

    Args:
        job_dir: the job folder (``wandb/``, ``trackers.json``).
        mode: ``offline`` | ``online`` | ``disabled``.
        project, entity, run_name, group: as ``wandb.init`` takes them (``group``: the sweep).
    """

    name = "wandb"

    def __init__(self, job_dir: str, mode: str, project: str, run_name: str,
                 entity: str | None = None, group: str | None = None):
        self.job_dir, self.mode, self.project, self.entity = job_dir, mode, project, entity
        self.run_name, self.group = run_name, group
        self.run: Any = None

    def open(self, params: Mapping[str, float | str], purge_step: int | None
             ) -> Mapping[str, int]:
        """``wandb.init`` with the id ``trackers.json`` names, or a new one."""
        import wandb

        known = read_record(self.job_dir).get(self.name) or {}
        run_id = known.get("run_id") or uuid.uuid4().hex[:12]
        settings = wandb.Settings(console="off", x_disable_stats=True, silent=True,
                                  disable_git=True, save_code=False)
        self.run = wandb.init(dir=self.job_dir, mode=self.mode, project=self.project,
                              entity=self.entity, name=self.run_name, id=run_id,
                              resume="allow", group=self.group, config=dict(params),
                              settings=settings)
        if not known:
            write_record(self.job_dir, self.name, {"run_id": run_id, "mode": self.mode,
                                                   "dir": os.path.join(self.job_dir, "wandb")})
        return {}

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """``run.log(values, step=step)``."""
        self.run.log(dict(values), step=step)

    def flush(self) -> None:
        """Nothing: W&B's own process writes as it goes."""

    def finish(self, step: int, final: Mapping[str, float]) -> None:
        """The summary gets the final metrics as ``final/<name>`` (W&B keeps a history key's
        last logged value as its summary, float32 here); the run finishes (exit code 0)."""
        self.run.summary.update({f"final/{k}": v for k, v in final.items()})
        self.run.finish(exit_code=0)
        self.run = None

    def close(self) -> None:
        """The run finishes with exit code 1 (a resume reopens it)."""
        if self.run is not None:
            self.run.finish(exit_code=1)
            self.run = None
