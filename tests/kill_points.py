"""Kill points for the resume tests: a CLI run SIGKILLed, whole process group, at a chosen
moment (``chaos_site/sitecustomize.py``: just before the n-th rename onto a file, the temp file
written), and the check that a resumed run's outputs are the uninterrupted run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import torch
from helpers import QUIET, TESTS, cli_env, kill_group_when, run_tagged

CHAOS_SITE = TESTS / "chaos_site"
# The reference run's overrides: conftest's default_run_2_epochs.
RUN = ["world_size=2", "trainer.epochs=2", QUIET]
# What differs between two runs of the same computation: wall-clock measures and memory.
TIMING = ("time/", "perf/", "train/samples_per_sec")


def kill_at(job: Path, cwd: Path, point: str | None, *args: str, env: dict | None = None) -> None:
    """Start the run in ``job`` (overrides ``args``, :data:`RUN` if none) and SIGKILL its
    process group: at ``point`` (``<file>:<n>``: just before the n-th rename onto that file),
    or, with None, as soon as the first TensorBoard event file exists (inside the first
    epoch)."""
    tag = uuid.uuid4().hex
    marker = cwd / f"marker-{tag}"
    env = cli_env(tag, PYTHONPATH=os.pathsep.join([str(CHAOS_SITE),
                                                   os.environ.get("PYTHONPATH", "")]),
                  **(env or {}))
    if point:
        env.update(DDP_EXP_TEST_CHAOS=point, DDP_EXP_TEST_MARKER=str(marker))
    done = (marker.exists if point else
            lambda: bool(list((job / "tensorboard").glob("events.out.tfevents*"))))
    kill_group_when(job, cwd, list(args or RUN), env, tag, done,
                    f"not killed at {point or 'the first event file'}", poll_s=0.005)


def resume_auto(job: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``trainer.resume=auto`` in ``job`` (overrides ``args``, :data:`RUN` if none): exit 0."""
    proc, _ = run_tagged([sys.executable, "-m", "ddp_exp", *(args or RUN), "trainer.resume=auto",
                          f"hydra.run.dir={job}"], cwd, uuid.uuid4().hex, 180)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def same_outputs(job: Path, reference: Path) -> None:
    """The resumed job's outputs are the uninterrupted run's: metrics.json (wall-clock keys
    aside), model.pt and best.pt's weights bit for bit (the same computation in the same order
    on this machine), status completed, no temp file left."""
    def measured(path: Path) -> dict:
        return {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith(TIMING)}

    assert measured(job / "metrics.json") == measured(reference / "metrics.json")
    assert json.loads((job / "status.json").read_text())["status"] == "completed"
    for name in ("model.pt", "checkpoints/best.pt", "checkpoints/last.pt"):
        got, want = (torch.load(d / name, weights_only=True) for d in (job, reference))
        if name != "model.pt":
            assert got["epoch"] == want["epoch"], name
            got, want = got["model"], want["model"]
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), name
    assert [p for p in job.rglob("*.tmp")] == []
