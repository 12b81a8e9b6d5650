"""A finished Optuna trial's overrides copied into a plain run are refused in one line
(issue 41 item 4; :mod:`ddp_exp.launch.trial_link`). Before: the run trained an epoch, then
failed with Optuna's ``UpdateFinishedTrialError`` when it reported to the finished trial."""

from __future__ import annotations

import pytest
from helpers import run_sweep

from ddp_exp.config.errors import ConfigError
from ddp_exp.launch.trial_link import refuse_trial_link_in_a_plain_run

# What a ddp_optuna trial's line shows after its parameters (Hydra's "#0 : ..." line).
COPIED = ["++hydra.job.env_set.DDP_EXP_OPTUNA_STORAGE='/x/optuna_journal.log'",
          "++hydra.job.env_set.DDP_EXP_OPTUNA_STUDY='ddp_exp'",
          "++hydra.job.env_set.DDP_EXP_OPTUNA_TRIAL='0'"]


@pytest.mark.slow
def test_a_trials_copied_line_is_refused_before_any_rank(tmp_path):
    out = run_sweep(tmp_path, "trainer.epochs=2", "optim.lr=0.08", *COPIED,
                    f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: ++hydra.job.env_set.DDP_EXP_OPTUNA_TRIAL='0' links this run to trial 0 of an "
        "Optuna study, which only a hydra/sweeper=ddp_optuna sweep's own jobs do (a finished "
        "trial takes no more reports): drop the 3 ++hydra.job.env_set.DDP_EXP_OPTUNA_* "
        "override(s) copied from the trial's line and keep its parameters"]
    assert not (tmp_path / "run").exists()
    assert "epoch 1" not in out.stdout


def test_a_variable_left_in_the_shell_is_named(monkeypatch):
    monkeypatch.setenv("DDP_EXP_OPTUNA_TRIAL", "7")
    with pytest.raises(ConfigError, match="^the environment variable DDP_EXP_OPTUNA_TRIAL=7 "
                       "links this run to trial 7.*: unset DDP_EXP_OPTUNA_TRIAL "
                       "DDP_EXP_OPTUNA_STORAGE DDP_EXP_OPTUNA_STUDY$"):
        refuse_trial_link_in_a_plain_run(False, [])


def test_a_sweeps_job_and_an_unlinked_run_pass(monkeypatch):
    monkeypatch.delenv("DDP_EXP_OPTUNA_TRIAL", raising=False)
    refuse_trial_link_in_a_plain_run(False, [])  # no link
    monkeypatch.setenv("DDP_EXP_OPTUNA_TRIAL", "3")
    refuse_trial_link_in_a_plain_run(True, COPIED)  # the sweeper's own job


@pytest.mark.slow  # starts torchrun's world of two ranks
def test_a_trials_copied_line_is_refused_under_torchrun_too(run_cli):
    """Regression: the torchrun/srun path skipped the refusal (its setup was written apart from
    the elastic path's); both now take the launch session's steps
    (:mod:`ddp_exp.launch.session`), so the same line ends the world before any rank trains."""
    from helpers import QUIET, TORCHRUN_2

    run = run_cli("trainer.epochs=1", QUIET, *COPIED, launcher=TORCHRUN_2, timeout=120)
    assert run.returncode != 0, run.stdout[-2000:]
    refusals = [ln for ln in (run.stdout + run.stderr).splitlines() if "links this run" in ln]
    assert refusals and set(refusals) == {
        "error: ++hydra.job.env_set.DDP_EXP_OPTUNA_TRIAL='0' links this run to trial 0 of an "
        "Optuna study, which only a hydra/sweeper=ddp_optuna sweep's own jobs do (a finished "
        "trial takes no more reports): drop the 3 ++hydra.job.env_set.DDP_EXP_OPTUNA_* "
        "override(s) copied from the trial's line and keep its parameters"}, refusals
    assert "epoch 1" not in run.stdout and not (run.job_dir / "metrics.json").exists()
