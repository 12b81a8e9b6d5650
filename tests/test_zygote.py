"""The suite's pre-imported CLI (tests/zygote.py): a run forked from it ends as a real
``python -m ddp_exp`` does (exit status, stdout, stderr), its processes carry the caller's tag,
and what it cannot reproduce (start-up variables, a sitecustomize, the switch) starts a real
process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import zygote
from helpers import (
    HANG_S,
    QUIET,
    TESTS,
    cli_env,
    default_signals,
    run_tagged,
    start_cli,
    tagged_processes,
)

DDP_EXP = [sys.executable, "-m", "ddp_exp"]


def _both(tmp_path, monkeypatch, *args):
    """The same command as a forked run and as a real process."""
    tag = uuid.uuid4().hex
    forked, _ = run_tagged([*DDP_EXP, *args], tmp_path, tag, 300)
    monkeypatch.setenv(zygote.DISABLE, "1")
    real, _ = run_tagged([*DDP_EXP, *args], tmp_path, uuid.uuid4().hex, 300)
    return forked, real


@pytest.mark.smoke
@pytest.mark.parametrize("args", [("world_size=two",), ("--cfg", "job", QUIET),
                                  ("trainer.resume=yes",)])
def test_a_forked_run_ends_as_a_real_one(tmp_path, monkeypatch, args):
    forked, real = _both(tmp_path, monkeypatch, *args)
    assert (forked.returncode, _untimed(forked.stdout), _untimed(forked.stderr)) == (
        real.returncode, _untimed(real.stdout), _untimed(real.stderr))


def _untimed(text: str) -> str:
    """``text`` without its log lines' timestamps (``[2026-12-05 12:00:12,923]``), which
    differ between any two runs."""
    return re.sub(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\]", "[time]", text)


@pytest.mark.slow
def test_a_forked_world_carries_the_callers_tag_and_trains(tmp_path):
    tag = uuid.uuid4().hex
    proc = start_cli([*DDP_EXP, "world_size=2", "trainer.epochs=1", QUIET,
                      f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, cli_env(tag))
    assert isinstance(proc, zygote.ZygoteProcess) == (not os.environ.get(zygote.DISABLE))
    assert proc.pid in tagged_processes(tag) or proc.poll() is not None
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "epoch 1/1" in out
    assert (tmp_path / "run" / "metrics.json").exists()


def test_what_a_fork_cannot_reproduce_starts_a_real_process(tmp_path, monkeypatch):
    env = cli_env("t")
    monkeypatch.delenv(zygote.DISABLE, raising=False)
    assert zygote.usable(DDP_EXP, env)
    assert zygote.usable([sys.executable, "-m", "torch.distributed.run"], env)
    assert not zygote.usable([sys.executable, "-m", "pytest"], env)
    assert not zygote.usable([sys.executable, "script.py"], env)
    assert not zygote.usable(DDP_EXP, {**env, "OMP_PROC_BIND": "true"})
    assert zygote.usable(DDP_EXP, {**env, "OMP_NUM_THREADS": "7"})  # ddp_exp applies it
    assert not zygote.usable(DDP_EXP, {**env, "PYTHONWARNINGS": "error"})
    (tmp_path / "sitecustomize.py").write_text("")
    assert not zygote.usable(DDP_EXP, {**env, "PYTHONPATH": str(tmp_path)})
    assert not zygote.usable(DDP_EXP, cli_env("t" * 64))
    # changed in this process by a test: the server imported under the suite's start
    monkeypatch.setenv("OMP_PROC_BIND", "true")
    assert not zygote.usable(DDP_EXP, cli_env("t"))
    assert zygote.usable(DDP_EXP, env)
    monkeypatch.delenv("OMP_PROC_BIND")
    for name, value in zygote.SET_BY_IMPORTS.items():  # import sklearn set them here too
        monkeypatch.setenv(name, value)
    assert zygote.usable(DDP_EXP, cli_env("t"))
    monkeypatch.setenv(zygote.DISABLE, "1")
    assert not zygote.usable(DDP_EXP, env)
    real = start_cli([sys.executable, "-c", "pass"], tmp_path, env)
    assert isinstance(real, subprocess.Popen)
    assert real.communicate(timeout=300) == ("", "")


# ------------------------------------------------------- the guide's .venv/bin/python (shim)
def test_the_shim_forks_only_what_the_server_can_run(tmp_path, monkeypatch):
    """``zygote_shim.forkable`` holds :func:`zygote.usable`'s rules for ``python *args``."""
    import signal

    import zygote_shim

    monkeypatch.delenv(zygote.DISABLE, raising=False)
    # the caller a terminal's shell starts, whatever this worker inherited (`make test &`)
    monkeypatch.setattr(signal, "getsignal", lambda sig: signal.SIG_DFL)
    config = zygote_shim.install(tmp_path / ".venv", "/nowhere")
    env = cli_env("t")
    args = ["-m", "ddp_exp", "world_size=1"]
    assert zygote_shim.forkable(args, env, config)
    for form in (["-m", "ddp_exp.data.images"], ["-u", "-m", "ddp_exp"], ["script.py", "x"],
                 ["-u", "-"]):
        assert zygote_shim.forkable(form, env, config), form
    # -c: multiprocessing's spawn, with descriptors the shim would not hand over
    for other in (["-c", "pass"], ["-u"], ["-m"], ["-I", "script.py"], []):
        assert not zygote_shim.forkable(other, env, config), other
    for changed in ({"OMP_PROC_BIND": "true"}, {"PYTHONWARNINGS": "error"},
                    {zygote.CASE_TAG: "t" * 64}, {zygote.DISABLE: "1"}):
        assert not zygote_shim.forkable(args, {**env, **changed}, config), changed
    assert zygote_shim.forkable(args, {**env, "PYTHONPATH": str(tmp_path)}, config)
    (tmp_path / "sitecustomize.py").write_text("")
    assert not zygote_shim.forkable(args, {**env, "PYTHONPATH": str(tmp_path)}, config)
    monkeypatch.setattr(signal, "getsignal", lambda sig: (
        signal.SIG_IGN if sig == signal.SIGINT else signal.SIG_DFL))  # `python ... &`
    assert not zygote_shim.forkable(args, env, config)


def _held_run(venv_python: Path, tmp_path: Path, name: str, tag: str, env: dict[str, str]):
    """``venv_python -m ddp_exp`` (its run folder ``name``) held while it loads the data
    (``phases.slow_digits``), and the pids of the processes that carry ``tag``."""
    import time

    marker = tmp_path / f"{name}.loading"
    env = {**env, "PYTHONPATH": str(TESTS), "DDP_EXP_TEST_MARKER": str(marker)}
    proc = subprocess.Popen([str(venv_python), "-m", "ddp_exp", "data._target_=phases.slow_digits",
                             QUIET, f"hydra.run.dir={tmp_path / name}"], cwd=tmp_path, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)
    deadline = time.monotonic() + HANG_S
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("no marker: " + "".join(proc.communicate()))
        time.sleep(0.02)
    return proc, tagged_processes(tag)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        return int(fh.read().rsplit(b")", 1)[1].split()[1])


@pytest.mark.parametrize("forked", [pytest.param(True, id="forked"),
                                    pytest.param(False, id="real", marks=pytest.mark.slow)])
def test_the_shim_runs_ddp_exp_from_the_server_and_ends_as_the_real_interpreter(tmp_path,
                                                                                forked):
    """The guide's ``.venv/bin/python -m ddp_exp`` (tests/zygote_shim.py): forked, the run is
    a child of the server's waiter (the shim is only its client); with a start-up variable it
    is the real interpreter, in the shim's own process (exec). Either way a refused config
    exits 2 with its one line, SIGINT to the python the user started ends the run as
    interrupted with 130 (as tests/test_interrupts.py holds of a real run), and a run killed
    by a signal ends the shim by that signal."""
    import signal

    import zygote_shim

    address = zygote.address() if forked else None
    if forked and address is None:
        pytest.skip("no zygote server (DDP_EXP_TEST_NO_ZYGOTE=1)")
    zygote_shim.install(tmp_path / ".venv", address or os.devnull)
    python = tmp_path / ".venv" / "bin" / "python"
    tag = uuid.uuid4().hex
    env = cli_env(tag, **({} if forked else {"OMP_PROC_BIND": "false"}))

    refused = subprocess.run([str(python), "-m", "ddp_exp", "distributed.timeout_s=0"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                             preexec_fn=default_signals)
    assert (refused.returncode, refused.stdout, refused.stderr) == (
        2, "", "error: distributed.timeout_s=0.0 is invalid: a positive number of seconds\n")

    for sig, code in ((signal.SIGINT, 130), (signal.SIGKILL, -signal.SIGKILL)):
        proc, tagged = _held_run(python, tmp_path, sig.name, tag, env)
        try:
            if forked:
                (run,) = set(tagged) - {proc.pid}
                assert _parent(_parent(run)) == zygote._Server.proc.pid
            else:
                run = proc.pid
                assert tagged == [run]
            # SIGINT as `kill -INT` sends it to the python started; SIGKILL reaches only the run
            os.kill(proc.pid if sig == signal.SIGINT else run, sig)
            _, err = proc.communicate(timeout=HANG_S)
        finally:
            proc.kill()
        assert proc.returncode == code, err
        if sig == signal.SIGINT:
            assert [ln for ln in err.splitlines() if ln.strip()] == ["interrupted (SIGINT)"], err


TORCHRUN_PROBE = """
import os, sys
here = os.path.dirname(os.path.realpath(__file__))
# One write per line: the ranks run with -u, where print writes each argument apart and the
# two ranks' pieces interleaved in the shared pipe once in CI ("10 True ...").
line = " ".join(str(v) for v in (os.environ["RANK"], "torch" in sys.modules,
                                  sys.argv == [__file__, "x"], sys.path[0] == here, __name__))
sys.stdout.write(line + "\\n")
sys.stdout.flush()
"""


def test_torchrun_and_its_ranks_run_forked_from_the_server(tmp_path, monkeypatch):
    """``python -m torch.distributed.run`` runs forked, with the server's shim as its
    ``sys.executable``: its ranks (``shim -u script``) are forked too, torch already imported
    when their script starts (a real interpreter's would not have it), with the ``sys.argv``,
    ``sys.path[0]`` and ``__name__`` a real interpreter gives a script."""
    monkeypatch.delenv(zygote.DISABLE, raising=False)
    script = tmp_path / "probe.py"
    script.write_text(TORCHRUN_PROBE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(script), "x"]
    proc = start_cli(cmd, tmp_path, cli_env("t"))
    assert isinstance(proc, zygote.ZygoteProcess)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    expected = [f"{rank} True True True __main__" for rank in (0, 1)]
    assert sorted(out.split("\n")[:2]) == expected, out


SIGNALS_PROBE = """
import signal, sys
print("torch" in sys.modules, sys.argv, sys.path[0] == "", __name__,
      signal.getsignal(signal.SIGINT) is signal.default_int_handler,
      signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN,
      signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL)
"""


def test_a_forked_program_on_stdin_has_its_callers_signals_not_the_servers(tmp_path):
    """``python - x`` through the shim runs forked (torch already imported) with ``sys.argv``
    and ``sys.path[0]`` as a real interpreter sets them, and the dispositions a real child of
    the caller would have: SIGQUIT ignored by the caller (a shell's background job) stays
    ignored, the others are the defaults (SIGINT: KeyboardInterrupt), whatever the server
    inherited when it started (a worker that started it while a test ignored a signal: then
    torchrun's ranks ran as real interpreters)."""
    import signal

    import zygote_shim

    address = str(tmp_path / "s")  # a server of its own, started with SIGUSR2 ignored
    server = subprocess.Popen([sys.executable, zygote.__file__, address], stdout=subprocess.PIPE,
                              env={**os.environ, zygote.CASE_TAG: zygote.PLACEHOLDER},
                              preexec_fn=lambda: signal.signal(signal.SIGUSR2, signal.SIG_IGN))
    try:
        assert server.stdout.readline() == b"ready\n"
        zygote_shim.install(tmp_path / ".venv", address)
        out = subprocess.run([str(tmp_path / ".venv" / "bin" / "python"), "-", "x"],
                             input=SIGNALS_PROBE, cwd=tmp_path, env=cli_env(uuid.uuid4().hex),
                             capture_output=True, text=True, timeout=HANG_S,
                             preexec_fn=lambda: (default_signals(),
                                                 signal.signal(signal.SIGQUIT, signal.SIG_IGN)))
    finally:
        server.kill()
        server.wait()
    assert out.returncode == 0, out.stderr
    assert out.stdout == "True ['-', 'x'] True __main__ True True True\n", out.stdout
