"""The in-process probes of benchmarks/ (issue 42 item 4) still run against today's ddp_exp: they
import its internals (the Trainer, the typed config, the step checkpoint), so a change there can
break them while nothing else notices (step_overhead.py read its typed config as a dict). Each
runs briefly; the figures are not checked (no timed unit tests: speed belongs in `make bench`),
that it ran to its result line is. And a probe that fails makes `python -m benchmarks` exit 1."""

from __future__ import annotations

import csv
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


def result_of(name: str, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The probe run to its end (exit 0) and its ``BENCH_RESULT {json}``."""
    done = probe(name, *args)
    assert done.returncode == 0, done.stderr[-2000:]
    return done, json.loads(done.stdout.rsplit("BENCH_RESULT ", 1)[1])


@pytest.mark.slow
def test_step_overhead_prints_both_loops_and_lists_what_the_step_adds(tmp_path):
    out = tmp_path / "step_overhead.csv"
    done = probe("step_overhead", "--epochs", "1", "--calls", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("47 steps/epoch, 1 epochs each")  # 1,500 samples / 32 per step
    assert [ln.split()[0] for ln in lines[1:3]] == ["tight", "ddp_exp"]
    assert all("us/step over tight" in ln for ln in lines[1:3])
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
def test_step_checkpoint_cost_writes_its_result_line():
    _, r = result_of("step_checkpoint_cost", "--rounds", "2", "--epochs-per-block", "3")
    # 2 rounds x 3 epochs x 24 steps (1,500 samples, 32 per rank, 2 ranks): a checkpoint at
    # steps 50, 100 (not 150, an epoch's end)
    assert r["steps"] == {"every-50": 144, "none": 144}
    assert r["step_checkpoints"] == 2 and 0 < r["direct_cost"] < 1


@pytest.mark.slow
def test_epoch_checkpoint_cost_writes_its_result_line():
    done, r = result_of("epoch_checkpoint_cost", "--rounds", "2", "--epochs-per-block", "2")
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


def test_warmup_rates_reads_epoch_lines_and_combines_steady_intervals(monkeypatch):
    """The warmup probe's reading, without a run: each epoch line's rate and last step, and an
    epoch's steady rate, the harmonic mean of its intervals after the first (equal samples
    each: the samples over the seconds of those intervals)."""
    monkeypatch.syspath_prepend(str(ROOT))
    w = importlib.import_module("benchmarks.probes.warmup_rates")
    out = ("[..][rank0][ddp_exp.train][INFO] - epoch 1/2 | step 94 | train/epoch_loss 0.97 | "
           "val/loss 0.37 | val/accuracy 0.88 (263/297) | 7,211 samples/s\n"
           "[..][rank0][ddp_exp.train][INFO] - epoch 2/2 | step 188 | train/epoch_loss 0.21 | "
           "1,664 samples/s\n")
    assert w.epoch_rates(out, "samples") == [(94, 7211.0), (188, 1664.0)]
    assert w.epoch_rates(out, "tokens") == []
    # steps 5 (the first interval, left out), 10, 15, 20 of the first epoch; 25 is the next's
    points = [(5, 10.0), (10, 100.0), (15, 300.0), (20, 300.0), (25, 1.0)]
    assert w.steady_rate(points, 0, 20) == pytest.approx(3 / (1 / 100 + 2 / 300))
    with pytest.raises(ValueError, match="1 steady intervals"):
        w.steady_rate(points, 0, 10)


def test_probe_groups_turn_their_probes_results_into_rows(monkeypatch):
    """first_line: a command's exit outside what it may exit with fails its row, and each
    repeat's slowest first line is a row of its own; warmup: each epoch's rate, its steady and
    first intervals' and the run's ratio; prepare_text: prepare's seconds, RSS and tokens/s."""
    monkeypatch.syspath_prepend(str(ROOT))
    first = importlib.import_module("benchmarks.groups.first_line")
    runs = [{"command": "help", "first_line_s": 0.4, "whole_s": 0.5, "exit": 0},
            {"command": "debug", "first_line_s": 2.5, "whole_s": 9.0, "exit": 2},
            {"command": "job-fork", "first_line_s": 1.0, "whole_s": 8.0, "exit": 2}]
    monkeypatch.setattr(first, "probe_result", lambda probe, args, timeout: {"runs": runs})
    rows = {r["variant"]: r for r in first.measure(False, 1, 10.0)}
    assert rows["first_line/ws1/debug/probe"]["status"] == "ok"  # refused in one line
    assert rows["first_line/ws1/job-fork/probe"]["status"] == "failed"  # a job must run
    slow = rows["first_line/ws1/slowest/probe"]
    assert (slow["first_line_s"], slow["note"]) == (2.5, "debug")

    warm = importlib.import_module("benchmarks.groups.warmup")
    epochs = [{"rate": 90.0, "steady": 100.0, "steps": [1, 20]},
              {"rate": 200.0, "steady": 100.0, "steps": [21, 40]}]
    result = {"digits": {"epochs": epochs, "intervals": [(5, 7.0), (10, 100.0), (25, 8.0)]},
              "gpt": {"epochs": epochs[:1], "intervals": [(5, 3.0)]}}
    monkeypatch.setattr(warm, "probe_result", lambda probe, args, timeout: result)
    rows = {r["variant"]: r for r in warm.measure(False, 2, 10.0)}
    assert rows["warmup/ws1/digits-epoch2-ratio/probe"]["ratio"] == 2.0
    assert rows["warmup/ws1/digits-epoch1-first-interval/probe"]["samples_per_sec"] == 7.0
    assert rows["warmup/ws1/digits-epoch2-first-interval/probe"]["samples_per_sec"] == 8.0
    targets = {t.name: t for t in warm.targets()}
    all_rows = warm.measure(False, 2, 10.0)
    for t in targets.values():
        t.evaluate(all_rows)
    assert [targets[n].verdict for n in ("warmup.digits.epoch1", "warmup.digits.epoch2",
                                         "warmup.gpt.epoch1")] == ["PASS", "MISS by 90.0%",
                                                                   "PASS"]

    prep = importlib.import_module("benchmarks.groups.prepare_text")
    monkeypatch.setattr(prep, "probe_result", lambda probe, args, timeout: {
        "corpus_mb": 10.1, "cores": 2, "prepare_s": 8.0, "peak_rss_mb": 464.6,
        "tokens": 2_000_000, "encode_tokens_per_s": 562_559})
    rows = {r["variant"]: r for r in prep.measure(True, 1, 10.0)}
    assert rows["prepare_text/ws1/prepare/probe"]["samples_per_sec"] == 250_000.0
    assert rows["prepare_text/ws1/encode_batch/probe"]["samples_per_sec"] == 562_559
