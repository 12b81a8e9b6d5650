"""The job folder is the record whatever happens to the console (:mod:`ddp_exp.io.console`).

Issue 41 item 1: ``python -m ddp_exp ... optim.lr=1e9 2>&1 | true`` left ``errors/`` but no
``status.json``: the error line's ``print`` raised ``BrokenPipeError`` before the status was
written. A failing run (rank 1 raises) and a good run, each piped into ``true``, into
``head -c 1``, started with every standard descriptor closed, and (the failing one) with its
output on a full disk (``/dev/full``): ``status.json`` says failed / completed, ``errors/``
holds rank 1's file, ``metrics.json`` is written, and the exit status is the run's own (1 and
0, as without the pipe: Python ignores SIGPIPE, so the shell's 141 never appears).

The runs' ``python`` is the suite's shim (tests/zygote_shim.py): a run whose descriptors are
open is forked from the pre-imported server with those descriptors; with them closed, the shim
execs the real interpreter.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import zygote
import zygote_shim
from helpers import QUIET, assert_no_orphans, cli_env, faulty_args, tests_on_path

# How each run's output is wired, as a user's shell writes it; ``$?`` of the python command.
CONSOLES = {
    "pipe_true": ("{cmd} 2>&1 | true", "${PIPESTATUS[0]}"),
    "pipe_head": ("{cmd} 2>&1 | head -c 1 >/dev/null", "${PIPESTATUS[0]}"),
    "closed": ("{cmd} <&- >&- 2>&-", "$?"),
    "disk_full": ("{cmd} >/dev/full 2>&1", "$?"),
}
GOOD_CONSOLES = ("pipe_true", "pipe_head", "closed")


def _run_in_shell(cmd: list[str], console: str, cwd: Path) -> int:
    """Run ``cmd`` from bash with its output wired as ``CONSOLES[console]``; its exit status."""
    wiring, status = CONSOLES[console]
    script = wiring.format(cmd=shlex.join(cmd)) + f"; echo {status} > exit_status"
    tag = uuid.uuid4().hex
    env = cli_env(tag, **tests_on_path())
    subprocess.run(["bash", "-c", script], cwd=cwd, env=env, timeout=240,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    assert_no_orphans(tag)
    return int((cwd / "exit_status").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, str], tuple[int, Path]]:
    """Every (outcome, console) run once: exit status and job folder."""
    root = tmp_path_factory.mktemp("closed_output")
    address = zygote.address()
    if address:  # python -m ddp_exp forked from the pre-imported server where it can be (its
        # descriptors handed over as they are; a closed one makes the shim exec the real one)
        zygote_shim.install(root / ".venv", address)
        python = [str(root / ".venv" / "bin" / "python"), "-m", "ddp_exp"]
    else:
        python = [sys.executable, "-m", "ddp_exp"]
    common = ["backend=gloo", "world_size=2", "trainer.epochs=1", QUIET]
    failing = faulty_args(root / "conf", fault="raise", fault_step=2, fault_rank=1)
    done = {}
    for outcome, consoles, extra in (("failed", CONSOLES, failing),
                                     ("completed", GOOD_CONSOLES, [])):
        for console in consoles:
            cwd = root / f"{outcome}-{console}"
            cwd.mkdir()
            job = cwd / "job"
            code = _run_in_shell([*python, *extra, *common, f"hydra.run.dir={job}"], console,
                                 cwd)
            done[outcome, console] = code, job
    return done


@pytest.mark.slow
@pytest.mark.parametrize("console", list(CONSOLES))
def test_a_failed_run_is_recorded_whatever_its_console(runs, console):
    code, job = runs["failed", console]
    status = json.loads((job / "status.json").read_text())
    assert status["status"] == "failed"
    assert status["error"].startswith("rank 1 failed: RuntimeError: injected failure")
    assert sorted(p.name for p in (job / "errors").iterdir()) == ["rank1.json"]
    assert code == 1  # the run's own status, as without the pipe (no 141: SIGPIPE is ignored)
    assert "RuntimeError: injected failure at step 2" in (job / "ddp_exp.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("console", GOOD_CONSOLES)
def test_a_good_run_is_recorded_whatever_its_console(runs, console):
    code, job = runs["completed", console]
    assert code == 0
    assert json.loads((job / "status.json").read_text())["status"] == "completed"
    assert json.loads((job / "metrics.json").read_text())["val/loss"] > 0
    assert not (job / "errors").exists()


def _pipe_without_reader():
    """A pipe whose read end is closed: writing to it fails with EPIPE."""
    read, write = os.pipe()
    os.close(read)
    return open(write, "w", buffering=1, encoding="utf-8")


@pytest.mark.parametrize("make", ["no_reader", "disk_full", "closed_file"])
def test_a_console_that_fails_drops_the_text_and_never_raises(make):
    """The unit: a write or flush to a console that is gone returns; the descriptor then
    leads to os.devnull, so that the interpreter's own flush at exit cannot fail either."""
    from ddp_exp.io.console import SafeStream

    if make == "no_reader":
        raw, expected = _pipe_without_reader(), errno.EPIPE
    elif make == "disk_full":
        raw, expected = open("/dev/full", "w", encoding="utf-8"), errno.ENOSPC  # noqa: SIM115
    else:
        raw, expected = _pipe_without_reader(), None
        raw.close()
    with pytest.raises((OSError, ValueError)):  # the stream as Python gives it: it raises
        print("x" * 10, file=raw, flush=True)
    stream = SafeStream(raw)
    print("error: the line nobody reads", file=stream, flush=True)
    stream.write("more\n")
    stream.flush()
    if expected is not None:
        assert getattr(stream.lost, "errno", None) == expected
        assert os.path.samestat(os.fstat(raw.fileno()), os.stat(os.devnull))
        raw.close()
    else:
        assert isinstance(stream.lost, ValueError)


def test_descriptors_closed_at_start_are_opened_on_devnull(tmp_path):
    """``>&- 2>&-``: Python starts with ``sys.stdout`` and ``sys.stderr`` None; after
    :func:`protect_console` they write, and the next file opened does not take descriptor 1
    or 2 (where torch's C++ code and child processes would write into it)."""
    probe = ("from ddp_exp.io.console import protect_console; import os, sys\n"
             "assert sys.stdout is None and sys.stderr is None\n"
             "protect_console(); print('x'); print('y', file=sys.stderr, flush=True)\n"
             "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT)\n"
             "os.write(fd, str(fd).encode())\n")
    record = tmp_path / "fd"
    subprocess.run(f"{shlex.quote(sys.executable)} -c {shlex.quote(probe)} {record} "
                   "<&- >&- 2>&-", shell=True, check=True, timeout=60, executable="bash")
    assert int(record.read_text()) > 2
