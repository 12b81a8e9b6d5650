"""The in-process probes of benchmarks/ (issue 42 item 4) still run against today's ddp_exp: they
import its internals (the Trainer, the typed config, the step checkpoint), so a change there can
break them while nothing else notices (step_overhead.py read its typed config as a dict). Each
runs briefly; the figures are not checked (no timed unit tests: speed belongs in `make bench`),
that it ran to its result line is. And a probe that fails makes `python -m benchmarks` exit 1."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def probe(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}
    return subprocess.run([sys.executable, "-m", f"benchmarks.probes.{name}", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_step_overhead_prints_both_loops_per_step():
    done = probe("step_overhead", "--epochs", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("47 steps/epoch, 1 epochs each")  # 1,500 samples / 32 per step
    assert [ln.split()[0] for ln in lines[1:3]] == ["tight", "ddp_exp"]
    assert all("us/step over tight" in ln for ln in lines[1:3])


@pytest.mark.slow
def test_step_checkpoint_cost_writes_its_result_line():
    done = probe("step_checkpoint_cost", "--rounds", "2", "--epochs-per-block", "3")
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(done.stdout.rsplit("BENCH_RESULT ", 1)[1])
    # 2 rounds x 3 epochs x 24 steps (1,500 samples, 32 per rank, 2 ranks): a checkpoint at
    # steps 50, 100 (not 150, an epoch's end)
    assert r["steps"] == {"every-50": 144, "none": 144}
    assert r["step_checkpoints"] == 2 and 0 < r["direct_cost"] < 1


def test_a_failed_probe_fails_the_run(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(ROOT))
    main = importlib.import_module("benchmarks.__main__")
    registry = importlib.import_module("benchmarks.registry")
    group = importlib.import_module("benchmarks.harness.group")

    def broken(quick, timeout_s):
        raise group.ProbeFailed("benchmarks.probes.x: exit 1 (TypeError)")

    monkeypatch.setitem(registry.GROUPS, "step_overhead", dataclasses.replace(
        registry.GROUPS["step_overhead"], extra=broken))
    monkeypatch.setattr(main, "warm_up", lambda timeout_s: None)
    report = tmp_path / "report.md"
    assert main.main(["--only", "step_overhead", "--quick", "--csv", str(tmp_path / "q.csv"),
                      "--markdown", str(report)]) == 1
    assert "the measurement apart from the runs failed in: step_overhead" in capsys.readouterr().out
    assert "- failed: benchmarks.probes.x: exit 1 (TypeError)" in report.read_text()
