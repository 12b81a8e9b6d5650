"""What a training step may not repeat (issue 42 item 2): the perf timer looks up autograd's
end-of-backward queue once, not per step (the version check it takes was ~10 us a step), and
the probes that count the step's calls and the epoch checkpoint's share run to their result."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_exp.distributed.process_group import World
from ddp_exp.metrics import perf

ROOT = Path(__file__).resolve().parents[1]
WORLD = World(rank=0, local_rank=0, world_size=1, local_world_size=1)


def test_the_timer_looks_up_the_backward_end_queue_once_and_stamps_every_step(monkeypatch):
    looked_up = []
    queued = []

    def lookup():
        looked_up.append(1)
        from ddp_exp.compat.tensors import backward_end_queue

        queue = backward_end_queue()

        def counting(callback):
            queued.append(1)
            queue(callback)
        return counting

    monkeypatch.setattr(perf, "backward_end_queue", lookup)
    model = torch.nn.Linear(3, 2)
    timer = perf.StepTimer(WORLD, torch.device("cpu"))
    timer.attach(model)
    batches = [torch.ones(4, 3)] * 5
    for x in timer.timed(batches):
        model(x).sum().backward()
        timer.backward_done()
        timer.step_done()
    assert looked_up == [1]  # at attach, not per step
    assert len(queued) == 5  # one end-of-backward stamp per step
    data, compute, sync, optim, steps = timer.sums
    assert steps == 5 and compute > 0 and sync >= 0 and optim >= 0


def _probe(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return subprocess.run([sys.executable, "-m", f"benchmarks.probes.{name}", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env,
                          stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_step_calls_lists_what_the_step_adds_per_step(tmp_path):
    out = tmp_path / "step_overhead.csv"
    done = _probe("step_overhead", "--epochs", "1", "--calls", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "function calls per step: ddp_exp" in done.stdout
    with open(out, newline="") as fh:
        rows = {r["function"]: r for r in csv.DictReader(fh)}
    assert {r["group"] for r in rows.values()} == {"step_overhead"}
    # counts are exact: one train_step per step, which the tight loop never calls
    assert float(rows["train_step"]["calls_per_step"]) == 1.0
    assert float(rows["train_step"]["tight_calls_per_step"]) == 0.0
    # the version check of compat runs at logging steps only (the norm), not per step
    assert float(rows.get("written_for", {"calls_per_step": 0})["calls_per_step"]) < 0.5


@pytest.mark.slow
def test_epoch_checkpoint_cost_writes_its_result_line():
    done = _probe("epoch_checkpoint_cost", "--rounds", "2", "--epochs-per-block", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(done.stdout.rsplit("BENCH_RESULT ", 1)[1])
    # 2 rounds x 2 epochs x 24 steps (1,500 samples, 32 per rank, 2 ranks), a checkpoint after
    # each save_last epoch
    assert r["steps"] == {"save_last": 96, "none": 96}
    assert r["epoch_checkpoints"] == 4
    assert 0 < r["cpu_cost"] < 1 and 0 < r["direct_cost"] < 1 and r["writer_cpu_s"] > 0
    # the loop thread's share (what the bound judges) is its own CPU in at_epoch_end over its
    # CPU; the whole process's adds the writer thread's CPU to both sides, so it is larger
    assert r["loop_thread_cost"] == pytest.approx(r["take_cpu_s"] / r["loop_cpu_s"]["save_last"])
    assert 0 < r["loop_thread_cost"] < r["cpu_cost"]
    labels = ("loop thread share", "whole process share", "direct share", "per checkpoint (4)")
    assert all(any(ln.startswith(label) for ln in done.stdout.splitlines()) for label in labels)
