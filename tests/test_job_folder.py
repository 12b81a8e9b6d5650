"""The job folder (``hydra.run.dir``): a finished folder is not trained into again, a busy one
(another run holds its lock) is refused, a refused run keeps the earlier record, the lock file
lives out of sight under ``.hydra/``, and a run leaves nothing outside its folder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from helpers import (
    assert_no_orphans,
    cli_env,
    copy_job,
    folder_files,
)


def test_a_fresh_run_into_a_finished_folder_is_refused(run_cli, tmp_path,
                                                       default_run_1_epoch):
    """Regression: the same hydra.run.dir without trainer.resume retrained from scratch,
    overwrote the run's files and left two event streams plotting the same steps twice."""
    job = copy_job(default_run_1_epoch, tmp_path)  # trainer.epochs=1, finished
    before = folder_files(job)
    again = run_cli("trainer.epochs=1", "optim.lr=0.5", "print_config=false")
    assert again.returncode == 2
    lines = [ln for ln in again.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "trainer.resume=auto" in lines[0], again.stderr
    assert "metrics.json" in lines[0] and "tensorboard/" in lines[0]
    assert folder_files(job) == before  # every file, .hydra/ included, as the first run left it


def test_a_second_run_into_a_busy_job_folder_is_refused(run_cli, tmp_path):
    """Regression: two runs given the same hydra.run.dir both ran and mixed their event
    streams, checkpoints and metrics in one folder."""
    job = tmp_path / "run"
    tag = uuid.uuid4().hex
    first = subprocess.Popen([sys.executable, "-m", "ddp_exp", "trainer.epochs=100000",
                              "print_config=false", f"hydra.run.dir={job}"], cwd=tmp_path,
                             env=cli_env(tag), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (job / "tensorboard").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        record = {p.name: p.read_bytes() for p in (job / ".hydra").iterdir()}
        second = run_cli("trainer.epochs=1", "model=cnn")
        assert second.returncode == 2
        assert "in use by another running job" in second.stderr
        assert len(list((job / "tensorboard").iterdir())) == 1
        # The refused run's Hydra rewrote .hydra/ (trainer.epochs=1, model=cnn); put back.
        assert {p.name: p.read_bytes() for p in (job / ".hydra").iterdir()} == record
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=30)
    assert_no_orphans(tag)
    assert json.loads((job / "status.json").read_text())["status"] == "interrupted"


def test_config_error_in_a_used_folder_keeps_its_record(run_cli, tmp_path,
                                                        default_run_1_epoch):
    """Regression: a typo rerun into a finished folder rewrote its status.json ("failed",
    with the typo) and .hydra/, next to the first run's weights and metrics."""
    job = copy_job(default_run_1_epoch, tmp_path)  # trainer.epochs=1, finished
    kept = folder_files(job)
    typo = run_cli("trainer.epochs=2", "trainer.resume=auto", "optim.lr=-1")
    assert typo.returncode == 2 and "optim.lr" in typo.stderr
    assert folder_files(job) == kept


# ------------------------------------------------ item 11b: the lock file out of sight
def test_the_lock_file_lives_under_dot_hydra_and_still_locks(tmp_path):
    """Regression: ``.ddp_exp.lock`` stayed in every finished job folder and made it look in
    use. It lives in ``.hydra/`` (beside the record it keeps), still refuses a second run
    there, and a refused single run's folder that holds only what its start made is still
    removed."""
    from ddp_exp.job.folder import (
        LOCK_FILE,
        JobFolderBusy,
        job_folder_lock,
        note_new_folders,
        remove_refused_folder,
    )

    job = tmp_path / "run"
    note_new_folders(str(job))
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "config.yaml").write_text("seed: 0\n")
    with job_folder_lock(str(job), str(job / ".hydra")):
        with pytest.raises(JobFolderBusy):
            with job_folder_lock(str(job), str(job / ".hydra")):
                pass
    assert sorted(p.name for p in job.iterdir()) == [".hydra"]
    assert (job / ".hydra" / LOCK_FILE).is_file()
    assert remove_refused_folder(str(job), ".hydra", None) and not job.exists()


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_no_output_left_outside_the_job_folder(default_run_1_epoch):
    """A run writes only inside its job folder (no stray outputs/ or event files in cwd): the
    session's world_size=2, 1-epoch run, whose cwd was a folder of its own."""
    cwd = default_run_1_epoch.job_dir.parent
    stray = [p for p in cwd.iterdir() if p.name != "run"]
    assert stray == [], stray
    assert os.path.isdir(cwd / "run" / "tensorboard")
