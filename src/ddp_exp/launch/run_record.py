"""The launching process's side of ``run.json`` (:mod:`ddp_exp.job.record`): what Hydra knows
of the job (its overrides, the user's config folder and primary config, the command's folder)
and what this world will run with (threads per rank), gathered once before any rank starts.

Uses :mod:`ddp_exp.job.record`, :mod:`ddp_exp.distributed.process_group` and
:mod:`ddp_exp.config.compose`; the build step calls it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ddp_exp.config.compose import command_folder, task_overrides
from ddp_exp.distributed.process_group import threads_per_rank
from ddp_exp.job import record


def user_config_source() -> tuple[str | None, str | None]:
    """(the ``--config-dir`` the user gave, absolute, or None; the primary config's name)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None, None
    hc = HydraConfig.get()
    folder = None
    for source in hc.runtime.config_sources:
        if source.provider == "command-line" and source.schema == "file":
            folder = os.path.abspath(source.path)
    return folder, hc.job.config_name


def record_start(job_dir: str, plain: Mapping[str, Any], backend: str,
                 data_fingerprint: Mapping[str, int], started: float) -> None:
    """Write ``<job_dir>/run.json`` for this start, in the process that owns the job folder
    (rank 0's under torchrun, task 0's in a cluster job, the launcher otherwise)."""
    from hydra.core.hydra_config import HydraConfig

    overrides = task_overrides(HydraConfig.get()) if HydraConfig.initialized() else []
    config_dir, config_name = user_config_source()
    nproc = int(plain["world_size"]) // int((plain.get("launcher") or {}).get("nnodes", 1))
    threads = threads_per_rank(nproc, int((plain.get("data") or {}).get("num_workers", 0)))
    record.write_start(job_dir, plain, command=record.command_line(), overrides=overrides,
                       cwd=command_folder(), config_dir=config_dir, config_name=config_name,
                       backend=backend, threads_per_rank=threads,
                       data_fingerprint=data_fingerprint, started=started)
