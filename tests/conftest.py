"""Shared helpers: run the real CLI in a subprocess, read its outputs, check for orphans."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

CASE_TAG = "DDP_EXP_CASE_TAG"


@dataclass
class Run:
    """A finished ``python -m ddp_exp`` invocation."""

    returncode: int
    stdout: str
    stderr: str
    job_dir: Path
    seconds: float

    @property
    def metrics(self) -> dict:
        return json.loads((self.job_dir / "metrics.json").read_text())

    def ok(self) -> Run:
        assert self.returncode == 0, f"exit {self.returncode}\n{self.stdout}\n{self.stderr}"
        return self


def tagged_processes(tag: str) -> list[int]:
    """PIDs whose environment carries ``DDP_EXP_CASE_TAG=tag``."""
    needle = f"{CASE_TAG}={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def assert_no_orphans(tag: str, grace_s: float = 5.0) -> None:
    deadline = time.monotonic() + grace_s
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tagged_processes(tag) == [], f"processes left behind: {tagged_processes(tag)}"


def cli_env(tag: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.pop("HYDRA_FULL_ERROR", None)
    env[CASE_TAG] = tag
    env.update(extra)
    return env


@pytest.fixture
def run_cli(tmp_path):
    """``run_cli(*overrides, job="run", timeout=180, env=None)`` runs ``python -m ddp_exp`` with
    ``hydra.run.dir=<tmp>/<job>`` in a temp cwd and checks that no process outlives it."""

    def run(*overrides: str, job: str = "run", timeout: float = 180, env: dict | None = None,
            launcher: list[str] | None = None, run_dir: bool = True) -> Run:
        tag = uuid.uuid4().hex
        job_dir = tmp_path / job
        args = list(overrides) + ([f"hydra.run.dir={job_dir}"] if run_dir else [])
        cmd = (launcher or [sys.executable, "-m", "ddp_exp"]) + args
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=tmp_path, env=cli_env(tag, **(env or {})),
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
        seconds = time.monotonic() - start
        assert_no_orphans(tag)
        return Run(proc.returncode, proc.stdout, proc.stderr, job_dir, seconds)

    return run


def scalars(job_dir: Path, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` pairs of one TensorBoard scalar tag in the job's single event stream."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list((job_dir / "tensorboard").glob("events.out.tfevents*"))
    assert len(files) == 1, files
    acc = EventAccumulator(str(files[0]), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]
