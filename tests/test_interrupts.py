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
import time
import uuid

import pytest
from conftest import assert_no_orphans, cli_env, start_watched

QUIET = "print_config=false"


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
        assert watched.seen.wait(120), "".join(lines)
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


@pytest.mark.slow
def test_sigterm_before_the_ranks_start_is_recorded_as_interrupted(tmp_path):
    """U06: SIGTERM while the launcher loads the data (no rank yet): exit 143, one line on
    stderr, status.json says interrupted (Python's default would end the process silently,
    leaving no record)."""
    tag, job = uuid.uuid4().hex, tmp_path / "early"
    proc = subprocess.Popen([sys.executable, "-m", "ddp_exp", "data._target_=faulty.slow_digits",
                             f"hydra.run.dir={job}"], cwd=tmp_path,
                            env=cli_env(tag, PYTHONPATH=os.path.dirname(__file__),
                                        DDP_EXP_TEST_LOAD_S="30"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (job / "ddp_exp.log").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # inside the 30 s load
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert [ln for ln in err.splitlines() if ln.strip()] == ["interrupted (SIGTERM)"], err
    status = json.loads((job / "status.json").read_text())
    assert status["status"] == "interrupted" and "SIGTERM" in status["error"], status
    assert not (job / "tensorboard").exists()
    assert_no_orphans(tag)
