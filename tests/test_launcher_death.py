"""A launcher that dies leaves no rank behind (session 34, task K).

* SIGKILL to the launcher's PID alone (an OOM kill, ``kill -9 <pid>``) ends its ranks and their
  DataLoader workers at once (``prctl(PR_SET_PDEATHSIG)``, :mod:`ddp_exp.rank.parent`); before,
  they trained on with PPID 1 and then hung in torch elastic's ``_wrap``.
* SIGUSR1/SIGUSR2 with preemption off (no ``trainer.preempt_signal``, off SLURM) stop the job as
  SIGTERM does: every rank ended, ``status.json`` interrupted, one line, exit 128+n. Before, the
  signal's default action killed the launcher alone, silently, orphaning its ranks.
* A rank whose launcher is gone before it could tie itself to it ends at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from helpers import (
    HANG_S,
    QUIET,
    assert_no_orphans,
    start_at_phase,
    start_watched,
    tagged_processes,
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"),
                                                   reason="prctl(PR_SET_PDEATHSIG) is Linux's")]

# Long enough that the ranks are training when the launcher is signalled (an epoch: ~1.5 s).
LONG_RUN = ["world_size=2", "data.batch_size=4", "trainer.epochs=30", QUIET]
TRAINING = "world: 2 rank(s)"


def _background_job() -> None:
    """In the child before its exec: SIGINT ignored, as a shell starts a background job
    (``python -m ddp_exp ... &``). Torch's own parent-death signal for its ranks is SIGINT,
    which such ranks ignore: this is how the fresh user's ranks outlived their launcher."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start(tmp_path, *overrides: str):
    """Start a long 2-rank run in its own session, as a background job; return once the
    ranks train."""
    tag = uuid.uuid4().hex
    job = tmp_path / "run"
    run = start_watched([sys.executable, "-m", "ddp_exp", *LONG_RUN, *overrides,
                         f"hydra.run.dir={job}"], tmp_path, tag, TRAINING,
                        preexec_fn=_background_job)
    proc, reader, lines = run.proc, run.reader, run.lines
    if not run.seen.wait(HANG_S):
        _kill_all(proc, tag)
        pytest.fail("the ranks did not start:\n" + run.text[-3000:])
    return proc, reader, lines, tag, job


def _kill_all(proc: subprocess.Popen, tag: str) -> None:
    for pid in [proc.pid, *tagged_processes(tag)]:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(30)


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_sigkill_to_the_launcher_alone_ends_its_ranks_and_their_workers(tmp_path, method):
    """forkserver: the fork servers (the launcher's, each rank's) outlive whoever asked for the
    process (every process they start holds their pipe): the rank and the worker watch."""
    proc, _, _, tag, _ = _start(tmp_path, "data.num_workers=1",
                                f"launcher.start_method={method}")
    try:
        time.sleep(1.0)  # the ranks' DataLoader workers run
        assert len(tagged_processes(tag)) >= 5, "launcher, 2 ranks, 2 workers (+ servers)"
        os.kill(proc.pid, signal.SIGKILL)  # the launcher's PID alone, not its group
        assert proc.wait(30) == -signal.SIGKILL
        assert_no_orphans(tag, grace_s=5.0)  # before: ranks and workers trained on (PPID 1)
    finally:
        _kill_all(proc, tag)


@pytest.mark.parametrize("name", ["SIGUSR1", "SIGUSR2"])
def test_usr_signal_with_preemption_off_stops_the_job_like_sigterm(tmp_path, name):
    sig = getattr(signal, name)
    proc, reader, lines, tag, job = _start(tmp_path)
    try:
        os.kill(proc.pid, sig)  # the launcher alone, as `kill -USR1 <pid>`
        code = proc.wait(30)
        reader.join(10)
        text = "".join(lines)
        assert code == 128 + sig, text[-3000:]  # the default action's status, now told
        assert f"interrupted ({name})" in text, text[-3000:]
        status = json.loads((job / "status.json").read_text())
        assert status["status"] == "interrupted", status
        assert_no_orphans(tag, grace_s=5.0)
    finally:
        _kill_all(proc, tag)


def test_usr1_while_the_launcher_loads_the_data_is_recorded_as_interrupted(tmp_path):
    """USR1 with preemption off before any rank exists (the launcher held loading the data by
    ``phases.slow_digits``): as SIGTERM there, one line, exit 138, ``status.json``
    interrupted. Before, the launcher died silently, leaving no record."""
    tag, job, marker = uuid.uuid4().hex, tmp_path / "early", tmp_path / "loading"
    proc = start_at_phase([sys.executable, "-m", "ddp_exp", "data._target_=phases.slow_digits",
                           QUIET, f"hydra.run.dir={job}"], tmp_path, tag, marker)
    try:
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGUSR1, err
    assert [ln for ln in err.splitlines() if ln.strip()] == ["interrupted (SIGUSR1)"], err
    status = json.loads((job / "status.json").read_text())
    assert status["status"] == "interrupted" and "SIGUSR1" in status["error"], status
    assert_no_orphans(tag)


ORPHAN = """
import os, sys, time
launcher = os.getpid()
if os.fork() == 0:
    time.sleep(0.5)  # the launcher is gone by now: this process was reparented
    from ddp_exp.rank import parent
    parent.end_with_launcher(launcher)
    print("outlived its launcher", flush=True)
    sys.exit(0)
os._exit(0)
"""


def test_a_rank_whose_launcher_died_before_it_was_tied_ends_at_once(tmp_path):
    """The race PR_SET_PDEATHSIG alone leaves: the launcher died between the fork and the
    rank's prctl (a spawned rank's imports take seconds). The rank finds another parent than
    the launcher it was started by, and ends at once instead of training on alone."""
    tag = uuid.uuid4().hex
    out = tmp_path / "orphan.txt"
    with open(out, "w") as fh:
        subprocess.run([sys.executable, "-c", ORPHAN], stdout=fh, stderr=subprocess.STDOUT,
                       env={**os.environ, "DDP_EXP_CASE_TAG": tag}, timeout=30, check=True)
    assert_no_orphans(tag, grace_s=10.0)
    assert out.read_text() == "", out.read_text()  # killed before it printed a word
