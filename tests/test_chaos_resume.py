"""Issue 32 items 1 and 2: a run killed at any point resumes with ``trainer.resume=auto`` to the
uninterrupted run's outputs. The kill points are chosen by watching the folder (the first event
file) or by a rename that waits for the kill (``chaos_site/sitecustomize.py``: the temp file
written, the rename not done), never by a sleep; the whole process group gets SIGKILL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import QUIET, refused_before_ranks
from kill_points import RUN, kill_at, resume_auto, same_outputs


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_kills_in_the_first_epoch_and_after_the_last_checkpoint_resume_exactly(
        default_run_2_epochs, tmp_path):
    """One job killed three times, each resume=auto killed again, then resumed to its end:

    1. once the first event file exists (item 1: today the resume refuses with exit 2, "the job
       folder ... already holds a run (tensorboard/)");
    2. the resume, which starts afresh there, with its first last.pt written to the temp file
       and not renamed (item 1: a temp file counted as an earlier run);
    3. the next resume, afresh again, with the final epoch's last.pt in place and its best.pt
       link not (a .best.pt.<pid>.tmp left, best.pt epoch 1's: item 2; today "nothing left to
       train", exit 0, no metrics.json, model.pt or status.json).

    The last resume finishes the run: outputs equal to the uninterrupted run's, one event file
    (the killed attempts' removed), no temp file."""
    reference = default_run_2_epochs.job_dir
    job = tmp_path / "run"
    kill_at(job, tmp_path, None)
    assert not (job / "checkpoints" / "last.pt").exists(), "killed too late to test item 1"

    kill_at(job, tmp_path, "last.pt:1", *RUN, "trainer.resume=auto")
    assert list((job / "checkpoints").glob(".last.pt.*.tmp"))
    assert not (job / "checkpoints" / "last.pt").exists()

    kill_at(job, tmp_path, "best.pt:2", *RUN, "trainer.resume=auto")
    assert torch.load(job / "checkpoints/last.pt", weights_only=True)["epoch"] == 1
    assert torch.load(job / "checkpoints/best.pt", weights_only=True)["epoch"] == 0
    assert list((job / "checkpoints").glob(".best.pt.*.tmp"))
    assert not (job / "metrics.json").exists()

    proc = resume_auto(job, tmp_path)
    assert "finishing it" in proc.stdout + proc.stderr
    same_outputs(job, reference)
    assert len(list((job / "tensorboard").glob("events.out.tfevents*"))) == 2  # 3rd and 4th


def _killed_attempt(job: Path) -> None:
    """What a run killed in its first epoch leaves: Hydra's record, an event file, a temp
    checkpoint (the job log is Hydra's, which this process has not set up)."""
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (job / "tensorboard").mkdir()
    (job / "tensorboard" / "events.out.tfevents.1.host.1.0").write_bytes(b"x")
    (job / "checkpoints").mkdir()
    (job / "checkpoints" / ".last.pt.abc.tmp").write_bytes(b"x")


@pytest.mark.parametrize(("extra", "why"), [
    ("notes.txt", "holds 'notes.txt', which ddp_exp did not write"),
    ("checkpoints/best.pt", "holds a checkpoint"),
    ("model.pt", "it finished"),
])
def test_resume_auto_keeps_refusing_a_folder_that_is_not_a_killed_attempt(compose, tmp_path,
                                                                          extra, why):
    """A folder that holds more than a killed first epoch (a user's file, a complete
    checkpoint, a finished run's weights) is still refused, naming why; nothing is changed."""
    job = tmp_path / "run"
    _killed_attempt(job)
    (job / extra).write_bytes(b"x")
    message = refused_before_ranks(compose("trainer.resume=auto", "trainer.epochs=1"), job)
    assert "already holds a run" in message and why in message, message


def test_a_temp_file_alone_is_no_earlier_run(tmp_path):
    """A partial .last.pt.<tag>.tmp is not an earlier run's output (today: checkpoints/)."""
    from ddp_exp.job.earlier_run import earlier_outputs

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / ".last.pt.abc.tmp").write_bytes(b"x")
    assert earlier_outputs(str(tmp_path)) == []


def test_a_killed_attempt_of_another_config_is_refused_and_of_this_one_restarted(tmp_path):
    """The killed attempt's record (the lock file's copy of its .hydra/config.yaml) must be this
    run's config but for trainer.resume: another config keeps the refusal; the same one is
    cleared (event files, temp files, errors/, status.json) and starts afresh."""
    from ddp_exp.job.earlier_run import make_way, refuse_earlier_run
    from ddp_exp.job.folder import FolderHoldsRun, job_folder_lock

    job = tmp_path / "run"
    _killed_attempt(job)
    (job / "status.json").write_text('{"status": "interrupted"}')
    (job / "errors").mkdir()
    hydra_dir = str(job / ".hydra")
    (job / ".hydra" / ".ddp_exp.lock").write_text(json.dumps(
        {"config.yaml": "seed: 1\ntrainer:\n  resume: null\n"}))
    (job / ".hydra" / "config.yaml").write_text("seed: 0\ntrainer:\n  resume: auto\n")
    with pytest.raises(FolderHoldsRun, match="started with another config"):
        with job_folder_lock(str(job), hydra_dir):
            refuse_earlier_run(str(job), "auto")
    assert (job / "tensorboard").is_dir() and (job / "status.json").is_file()

    (job / ".hydra" / ".ddp_exp.lock").write_text(json.dumps(
        {"config.yaml": "seed: 0\ntrainer:\n  resume: null\n"}))
    (job / ".hydra" / "config.yaml").write_text("seed: 0\ntrainer:\n  resume: auto\n")
    with job_folder_lock(str(job), hydra_dir):
        assert refuse_earlier_run(str(job), "auto") is True
        make_way(str(job), True)
    assert sorted(p.name for p in job.iterdir()) == [".hydra"]


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_a_run_that_stopped_early_killed_before_metrics_json_is_finished(run_cli, tmp_path):
    """Item 2 for a run that stopped early: killed with model.pt in place and metrics.json not
    (the last rename before it), resume=auto trains no more epochs and finishes the run as the
    uninterrupted one did (today: "stopped early ... nothing left to train", no metrics.json)."""
    stop = ["world_size=1", "trainer.epochs=6", QUIET, "trainer.monitor_mode=max",
            "trainer.early_stopping_patience=1"]
    reference = run_cli(*stop, job="reference").ok()
    assert reference.metrics["stopped_early"] is True
    job = tmp_path / "run"
    kill_at(job, tmp_path, "metrics.json:1", *stop)
    assert (job / "model.pt").exists() and not (job / "metrics.json").exists()
    proc = resume_auto(job, tmp_path, *stop)
    assert "finishing it" in proc.stdout + proc.stderr
    same_outputs(job, reference.job_dir)
