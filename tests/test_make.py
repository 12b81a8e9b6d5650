"""The make targets people expect (issue 7): each exits 0 and does what it says.

They run against this checkout's own .venv (created by `make test`/`make install`), so nothing is
reinstalled; `make clean` runs on a fresh clone. `make test` is the suite itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (VENV / ".installed").exists(),
                       reason="needs the Makefile's .venv (run `make install` first)"),
]


def make(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-C", str(ROOT), *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_make_run_trains_the_main_job(tmp_path):
    out = make("run", f"ARGS=trainer.epochs=1 print_config=false hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stdout + out.stderr
    metrics = (tmp_path / "run" / "metrics.json").read_text()
    assert '"world_size": 2' in metrics and '"backend": "gloo"' in metrics


def test_make_sweep_writes_a_summary(tmp_path):
    sweep = tmp_path / "sweep"
    out = make("sweep", f"ARGS=trainer.epochs=1 print_config=false hydra.sweep.dir={sweep}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1", "2"]
    assert len((sweep / "summary.csv").read_text().splitlines()) == 4


def test_make_lint_is_clean():
    out = make("lint")
    assert out.returncode == 0, out.stdout + out.stderr


def test_make_tensorboard_answers_on_loopback_then_stops():
    port = free_port()
    proc = subprocess.Popen(["make", "-C", str(ROOT), "tensorboard", f"PORT={port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline, status = time.monotonic() + 90, None
        while time.monotonic() < deadline and status is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as resp:
                    status = resp.status
            except OSError:
                time.sleep(0.5)
        assert status == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_make_clean_on_a_fresh_clone(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    (clone / "outputs" / "runs").mkdir(parents=True)
    (clone / "outputs" / "runs" / "x.txt").write_text("x")
    out = subprocess.run(["make", "-C", str(clone), "clean"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not (clone / "outputs").exists()
    assert (clone / "src" / "ddp_exp" / "__main__.py").exists()


def test_make_bench_smoke_run_writes_its_report(tmp_path):
    """`make bench` on its quickest setting (the two-run perf group, one repeat) into temp
    files (the startup group's seven launches took 50 s of the suite for the same check)."""
    csv, md = tmp_path / "results.csv", tmp_path / "BENCHMARKS.md"
    out = make("bench", "NO_BENCH_EXTRA=1",
               f"ARGS=--quick --only perf --csv {csv} --markdown {md}", timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert len(csv.read_text().splitlines()) >= 3
    assert "perf_metrics.on_vs_off" in md.read_text()
