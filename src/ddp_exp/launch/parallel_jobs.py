"""How many jobs of a sweep run at once on this machine, sharing its cores.

A sweep through a parallel launcher (``hydra/launcher=joblib hydra.launcher.n_jobs=2``) runs
that many worlds at the same time: ``data.batch_size=16,32,64`` with 2 ranks each put 4 ranks
on 2 cores without a word, 25.9 s against 6.2 s sequentially (issue 41), while one world of 3
ranks warned. The oversubscription warning and the threads per rank count every rank of the
jobs running at once (:func:`ddp_exp.launch.elastic.run_job`).

May use: Hydra's config of the running job.
"""

from __future__ import annotations

import os

from omegaconf import OmegaConf


def jobs_at_once(n_jobs: int | None, cores: int) -> int:
    """joblib's count of parallel workers for ``n_jobs`` on ``cores`` CPUs: ``n_jobs`` when
    positive; negative counts from the cores (-1 every core, -2 all but one: ``cores + 1 +
    n_jobs``, at least 1); None or 0: 1 (joblib's own rule, ``joblib.Parallel``'s docs)."""
    if not n_jobs:
        return 1
    return n_jobs if n_jobs > 0 else max(1, cores + 1 + n_jobs)


def parallel_jobs() -> int:
    """Jobs of the running sweep that share this machine at once (1 outside a multirun or
    under a launcher that runs one job at a time). Reads the job's ``hydra.launcher``:
    joblib's ``n_jobs``."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return 1
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return 1
    target = str(OmegaConf.select(hc, "launcher._target_", default="") or "")
    if "joblib" not in target.lower():
        return 1
    n_jobs = OmegaConf.select(hc, "launcher.n_jobs", default=None)
    return jobs_at_once(n_jobs, len(os.sched_getaffinity(0)))
