"""``run.json``, the reproducibility record of every job (issue 38), read from the session's
tracked sweep (helpers.TRACKED_SWEEP, which tests/test_trackers.py reads too)."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess
import sys

import pytest
from helpers import TRACKED_SWEEP, shared_sweep


@pytest.mark.slow
def test_every_job_records_what_produced_it(tmp_path_factory):
    import torch

    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    sweep = shared_sweep(tmp_path_factory, *TRACKED_SWEEP)
    job = sweep / "0"
    metrics = json.loads((job / "metrics.json").read_text())
    record = json.loads((job / "run.json").read_text())
    assert record["command"][:3] == [sys.executable, "-m", "ddp_exp"]
    assert {"world_size=2", "optim.lr=0.01"} <= set(record["overrides"])
    assert record["cwd"] == str(sweep.parent)
    assert record["git"]["commit"] is None and "not a git repository" in record["git"]["note"]
    assert record["versions"]["torch"] == torch.__version__
    assert record["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert {"hydra-core", "omegaconf", "ddp_exp"} <= record["versions"].keys()
    assert (record["world_size"], record["backend"], record["device"], record["seed"]) == (
        2, "gloo", "cpu", 0)
    assert record["threads_per_rank"] == metrics["threads_per_rank"]
    assert record["cpu"]["capability"] == torch.backends.cpu.get_cpu_capability()
    assert {"ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS"} <= set(record["cpu"]["env"])
    (digits,) = record["data"]["files"]
    assert digits["path"].endswith("digits.csv.gz")
    assert digits["bytes"] == os.path.getsize(digits["path"])
    with open(digits["path"], "rb") as fh:
        assert digits["sha256"] == hashlib.sha256(fh.read()).hexdigest()
    assert record["data"]["data.train_samples"] == 1500
    start, end = (datetime.datetime.fromisoformat(record[k]) for k in ("start_time",
                                                                       "end_time"))
    assert start < end and record["status"] == "completed"
    assert record["hostname"] and record["attempts"] == []


def git(folder, *args):
    subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True)


def test_git_state_names_the_commit_and_keeps_a_dirty_trees_diff(tmp_path):
    from ddp_exp.job.record import git_state

    repo, job = tmp_path / "project", tmp_path / "job"
    repo.mkdir()
    job.mkdir()
    git(repo, "init", "-q")
    (repo / "train.py").write_text("lr = 0.1\n")
    git(repo, "add", "train.py")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert git_state(str(repo), str(job)) == {"commit": head, "dirty": False}
    assert not (job / "run.diff").exists()
    (repo / "train.py").write_text("lr = 0.2\n")
    state = git_state(str(repo), str(job))
    assert state == {"commit": head, "dirty": True, "diff": "run.diff"}
    assert "-lr = 0.1\n+lr = 0.2" in (job / "run.diff").read_text()


def test_a_first_epoch_killed_with_trackers_on_still_starts_afresh(tmp_path):
    """run.json and the trackers' files are ddp_exp's own: an attempt killed before its first
    checkpoint that left them is still restarted by trainer.resume=auto, not refused."""
    from ddp_exp.job.earlier_run import killed_first_epoch

    job = tmp_path / "run"
    (job / "tensorboard").mkdir(parents=True)
    (job / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"")
    for name in ("run.json", "trackers.json", "metrics.csv", "mlflow.db"):
        (job / name).write_text("{}")
    (job / "wandb").mkdir()
    assert killed_first_epoch(str(job)) is None
    (job / "notes.txt").write_text("mine")
    assert killed_first_epoch(str(job)) == "it holds 'notes.txt', which ddp_exp did not write"


def test_an_earlier_start_that_never_recorded_its_end_is_kept_as_killed(tmp_path):
    """A start moves the record before it under ``attempts`` as it ended: one still
    "running" (killed, or a full disk refused its end's write) is "killed" (a fresh user's
    run.json listed every killed attempt as running, after the run had completed)."""
    from ddp_exp.job import record

    def start(world_size: int) -> dict:
        return record.write_start(str(tmp_path), {"world_size": world_size}, command=["x"],
                                  overrides=[f"world_size={world_size}"], cwd=str(tmp_path),
                                  config_dir=None, config_name=None, backend="gloo",
                                  threads_per_rank=1, data_fingerprint={}, started=0.0)

    start(2)  # killed: never ends
    start(3)
    record.write_end(str(tmp_path), "failed", 1.0)
    start(3)  # killed too
    last = start(1)
    assert [(a["world_size"], a["status"]) for a in last["attempts"]] == [
        (2, "killed"), (3, "failed"), (3, "killed")]
    assert last["status"] == "running"
    record.write_end(str(tmp_path), "completed", 2.0)
    kept = json.loads((tmp_path / "run.json").read_text())
    assert kept["status"] == "completed" and len(kept["attempts"]) == 3
