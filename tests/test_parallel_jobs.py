"""A sweep's parallel jobs share the machine's cores (issue 41 item 5;
:mod:`ddp_exp.launch.parallel_jobs`): ``-m hydra/launcher=joblib hydra.launcher.n_jobs=2
data.batch_size=16,32,64`` put 4 ranks on 2 cores without a word, where one world of 3 ranks
warned."""

from __future__ import annotations

import pytest
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from ddp_exp.distributed import process_group
from ddp_exp.launch.parallel_jobs import jobs_at_once, parallel_jobs


@pytest.mark.parametrize(("n_jobs", "cores", "expected"), [
    (2, 2, 2), (3, 8, 3), (-1, 2, 2), (-2, 8, 7), (-4, 2, 1), (None, 4, 1), (0, 4, 1),
])
def test_jobs_at_once_follows_joblibs_rule(n_jobs, cores, expected):
    assert jobs_at_once(n_jobs, cores) == expected


@pytest.fixture
def hydra_job():
    """Set the running job's Hydra config to ``{mode, launcher}``; restores none afterwards."""
    saved = HydraConfig.instance().cfg

    def set_job(mode: RunMode, launcher: dict) -> None:
        HydraConfig.instance().cfg = OmegaConf.create({"hydra": {"mode": mode,
                                                                 "launcher": launcher}})
    yield set_job
    HydraConfig.instance().cfg = saved


def test_a_joblib_sweep_counts_its_parallel_jobs(hydra_job, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    target = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
    hydra_job(RunMode.MULTIRUN, {"_target_": target, "n_jobs": 2})
    assert parallel_jobs() == 2
    hydra_job(RunMode.MULTIRUN, {"_target_": target, "n_jobs": -1})
    assert parallel_jobs() == 2
    hydra_job(RunMode.MULTIRUN, {"_target_": "hydra._internal.core_plugins."
                                 "basic_launcher.BasicLauncher"})
    assert parallel_jobs() == 1  # one job at a time
    hydra_job(RunMode.RUN, {"_target_": target, "n_jobs": 2})
    assert parallel_jobs() == 1


def test_the_warning_counts_every_rank_of_the_jobs_at_once(monkeypatch):
    monkeypatch.setattr(process_group.os, "sched_getaffinity", lambda pid: {0, 1})
    assert process_group.oversubscription_warning(2) is None  # one job of 2 ranks fits
    line = process_group.oversubscription_warning(2 * 2, jobs=2)
    assert line is not None and line.startswith(
        "4 ranks on this machine's 2 CPU core(s) (2 sweep jobs at once x 2 ranks; fewer "
        "hydra.launcher.n_jobs or ranks avoid it)")
    assert "slower than on 4 cores" in line
