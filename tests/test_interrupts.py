"""Interrupted runs and sweeps (case U06): Ctrl-C or SIGTERM during job k of a sweep still writes
the sweep's summary (the finished jobs, job k marked interrupted), and SIGTERM while a run is
still starting (before any rank exists) is recorded like Ctrl-C.

Expected rows come from the jobs' own folders (``metrics.json``, ``.hydra/overrides.yaml``).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import uuid

import pytest
from helpers import (
    HANG_S,
    QUIET,
    assert_no_orphans,
    start_at_phase,
    start_watched,
)


@pytest.mark.slow
@pytest.mark.parametrize(("target", "sig", "code"), [
    pytest.param("group", signal.SIGINT, 130, id="ctrl-c"),
    pytest.param("pid", signal.SIGTERM, 143, id="sigterm"),
])
def test_interrupted_sweep_writes_its_summary(tmp_path, target, sig, code):
    """U06: a 3-job sweep stopped while job 1 trains: summary.csv has job 0 completed (its
    metrics) and job 1 interrupted; job 2 never started; the exit status is the signal's."""
    tag, sweep = uuid.uuid4().hex, tmp_path / "sweep"
    cmd = [sys.executable, "-m", "ddp_exp", "-m", "world_size=1", "trainer.epochs=1,400,1",
           QUIET, f"hydra.sweep.dir={sweep}"]
    watched = start_watched(cmd, tmp_path, tag, "epoch 1/400", stderr=subprocess.PIPE)
    proc, lines, reader = watched.proc, watched.lines, watched.reader
    try:
        assert watched.seen.wait(HANG_S), "".join(lines)
        if target == "group":
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        err = proc.stderr.read()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=10)
    assert proc.returncode == code, "".join(lines) + err
    assert err.strip().splitlines()[-1] == f"interrupted ({sig.name})", err
    assert_no_orphans(tag)

    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    with open(sweep / "summary.csv", newline="") as fh:
        rows = {row["job"]: row for row in csv.DictReader(fh)}
    assert sorted(rows) == ["0", "1"], rows
    metrics = json.loads((sweep / "0" / "metrics.json").read_text())
    assert rows["0"]["status"] == "completed"
    assert float(rows["0"]["val/loss"]) == metrics["val/loss"]
    assert rows["1"]["status"] == "interrupted", rows["1"]
    assert "trainer.epochs=400" in rows["1"]["overrides"]
    assert json.loads((sweep / "1" / "status.json").read_text())["status"] == "interrupted"
    assert (sweep / "summary.md").is_file() and (sweep / "summary.png").is_file()


@pytest.mark.parametrize(("sig", "code"), [
    pytest.param(signal.SIGINT, 130, id="ctrl-c", marks=pytest.mark.smoke),
    pytest.param(signal.SIGTERM, 143, id="sigterm", marks=pytest.mark.slow),
])
def test_a_signal_while_the_launcher_loads_the_data_is_recorded_as_interrupted(tmp_path, sig,
                                                                               code):
    """U06 and a fresh user: a signal while the launcher loads the data (no rank yet; held
    there by ``phases.slow_digits``): exit 130 (143), one line on stderr, status.json says
    interrupted by that signal. Ctrl-C printed a KeyboardInterrupt traceback and left no
    status.json; SIGTERM (Python's default) ended the process silently, leaving no record."""
    tag, job, marker = uuid.uuid4().hex, tmp_path / "early", tmp_path / "loading"
    proc = start_at_phase([sys.executable, "-m", "ddp_exp", "data._target_=phases.slow_digits",
                           f"hydra.run.dir={job}"], tmp_path, tag, marker)
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert [ln for ln in err.splitlines() if ln.strip()] == [f"interrupted ({sig.name})"], err
    status = json.loads((job / "status.json").read_text())
    assert status["status"] == "interrupted" and sig.name in status["error"], status
    assert not (job / "tensorboard").exists()
    assert_no_orphans(tag)


@pytest.mark.slow
@pytest.mark.parametrize("sig,group,code", [(signal.SIGTERM, False, 143),
                                            (signal.SIGINT, True, 130)],
                         ids=["sigterm-launcher", "ctrl-c-group"])
def test_a_signal_while_the_ranks_are_forked_stops_the_run(tmp_path, sig, group, code):
    """A signal that comes while the launcher forks its ranks (here: held after it forked 2 of
    4, ``phase_site/sitecustomize.py``, which also proves that the launcher noted the signal
    inside that window) ends the run as interrupted, with every rank, and no traceback: it was
    raised inside Python's after-fork hooks, which dropped it (the run trained to the end and
    exited 0), a rank raised it as a failure (exit 1), or a rank hung in a lock inherited
    across the fork (found by a fresh user, 14 of 15 tries wrong;
    ddp_exp.compat.elastic_agent.start_ranks_safely)."""
    tag, job, marker = uuid.uuid4().hex, tmp_path / "run", tmp_path / "forked-2-of-4"
    proc = start_at_phase([sys.executable, "-m", "ddp_exp", "world_size=4", "trainer.epochs=3",
                           "launcher.start_method=fork", QUIET, f"hydra.run.dir={job}"],
                          tmp_path, tag, marker, phase="fork", stderr=subprocess.STDOUT,
                          start_new_session=True)
    try:
        (os.killpg if group else os.kill)(proc.pid, sig)
        out, _ = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, out
    assert (tmp_path / "forked-2-of-4.held").exists(), "the signal came after the fork window"
    status = json.loads((job / "status.json").read_text())
    assert status["status"] == "interrupted", (status, out)
    for text in ("Traceback", "Exception ignored", "frame #"):
        assert text not in out, out
    assert_no_orphans(tag)


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "sig", "code"), [
    pytest.param("sweep", signal.SIGINT, 130, id="sweep-ctrl-c"),
    pytest.param("sweep", signal.SIGTERM, 143, id="sweep-sigterm"),
    pytest.param("run", signal.SIGINT, 130, id="run-ctrl-c"),
])
def test_a_signal_before_a_jobs_task_starts_is_recorded_as_interrupted(tmp_path, mode, sig,
                                                                        code):
    """Regression: a signal after Hydra made a job's folder (its .hydra/ and log) and before
    the job's task ran left the folder without status.json; the sweep's summary listed the job
    as "incomplete". Now the folder's status.json says interrupted and so does the summary.
    The window is held open by a Hydra callback that waits in on_job_start (job 1 of a sweep,
    after job 0 completed; the only job of a single run)."""
    tag, marker, out = uuid.uuid4().hex, tmp_path / "waiting", tmp_path / "out"
    job = 1 if mode == "sweep" else 0
    cmd = [sys.executable, "-m", "ddp_exp", "world_size=1", "trainer.epochs=1", QUIET,
           "+hydra.callbacks.slow._target_=hydra_hooks.SlowJobStart",
           f"+hydra.callbacks.slow.job={job}"]
    cmd += (["data.batch_size=32,64", f"hydra.sweep.dir={out}"] if mode == "sweep"
            else [f"hydra.run.dir={out}"])
    cmd[3:3] = ["-m"] if mode == "sweep" else []  # Hydra's flags come before the overrides
    proc = start_at_phase(cmd, tmp_path, tag, marker)  # held by the callback
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert [ln for ln in err.splitlines() if ln.strip()] == [f"interrupted ({sig.name})"], err
    assert_no_orphans(tag)
    folder = out / str(job) if mode == "sweep" else out
    status = json.loads((folder / "status.json").read_text())
    assert status["status"] == "interrupted", status
    assert status["error"] == f"stopped by {sig.name} before the job started", status
    assert sorted(p.name for p in folder.iterdir()) == [".hydra", "ddp_exp.log", "status.json"]
    if mode == "sweep":
        assert "data.batch_size=64" in status["overrides"], status
        with open(out / "summary.csv", newline="") as fh:
            rows = {row["job"]: row["status"] for row in csv.DictReader(fh)}
        assert rows == {"0": "completed", "1": "interrupted"}, rows


def test_only_a_folder_hydra_made_for_a_job_that_never_ran_gets_the_record(tmp_path):
    """What Hydra makes before a job's task (the job log, .hydra/) gets status.json saying
    interrupted; a folder with anything else (a status, a lock, another run's outputs) is left
    as it is: it may be another run's, or one still going."""
    from ddp_exp.job.folder import record_unstarted_interrupt

    def made_by_hydra(name: str) -> str:
        job = tmp_path / name
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text("- data.batch_size=64\n")
        (job / ".hydra" / "config.yaml").write_text("seed: 0\n")
        (job / "ddp_exp.log").write_text("")
        return str(job / "ddp_exp.log")

    log = made_by_hydra("fresh")
    assert record_unstarted_interrupt("SIGINT", log) == str(tmp_path / "fresh")
    status = json.loads((tmp_path / "fresh" / "status.json").read_text())
    assert status == {"status": "interrupted", "overrides": ["data.batch_size=64"],
                      "wall_s": 0.0, "error": "stopped by SIGINT before the job started"}
    for extra in ("status.json", ".ddp_exp.lock", "metrics.json", "checkpoints/"):
        log = made_by_hydra(f"kept-{extra.strip('/')}")
        path = tmp_path / f"kept-{extra.strip('/')}" / extra.strip("/")
        path.mkdir() if extra.endswith("/") else path.write_text("{}")
        assert record_unstarted_interrupt("SIGTERM", log) is None, extra
        assert not path.is_file() or path.read_text() == "{}"
    assert record_unstarted_interrupt("SIGINT", None) is None
