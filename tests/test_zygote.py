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

import pytest
import zygote
from helpers import QUIET, cli_env, run_tagged, start_cli, tagged_processes

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
    assert not zygote.usable([sys.executable, "-m", "torch.distributed.run"], env)
    assert not zygote.usable(DDP_EXP, {**env, "OMP_NUM_THREADS": "7"})
    assert not zygote.usable(DDP_EXP, {**env, "PYTHONWARNINGS": "error"})
    (tmp_path / "sitecustomize.py").write_text("")
    assert not zygote.usable(DDP_EXP, {**env, "PYTHONPATH": str(tmp_path)})
    assert not zygote.usable(DDP_EXP, cli_env("t" * 64))
    monkeypatch.setenv(zygote.DISABLE, "1")
    assert not zygote.usable(DDP_EXP, env)
    real = start_cli([sys.executable, "-c", "pass"], tmp_path, env)
    assert isinstance(real, subprocess.Popen)
    assert real.communicate(timeout=300) == ("", "")
