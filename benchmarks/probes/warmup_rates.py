"""Throughput that leaves warm-up out (issue 41 item 3), measured against the run itself: each
epoch's rate from its log line (``epoch e/E | step s | ... | N samples/s``) against the
combined rate of the same epoch's steady TensorBoard intervals (every interval after the
epoch's first: equal samples each, so the harmonic mean of their rates), which span the same
minutes, so a busy machine's drift between runs does not enter the ratio.

* ``digits``: world_size 1, 2 epochs, ``data.batch_size=16``, ``trainer.log_every_n_steps=5``,
  ``train/samples_per_sec``: before the fix the first epoch's rate carried the first step's
  warm-up (0.03 s in a 0.11 s epoch);
* ``gpt``: ``experiment=gpt_tokens model.n_layer=1 model.n_embd=64 data.batch_size=8
  trainer.compile=true trainer.max_steps=40``, ``train/tokens_per_sec``: the epoch's rate
  against its intervals after compilation (``perf/compile_s`` reported apart).

    python -m benchmarks.probes.warmup_rates [--only digits,gpt]

Prints ``BENCH_RESULT {json}``: per job, each epoch's logged rate, its steady rate, the
interval rates read, and metrics.json's rate and ``perf/warmup_s`` / ``perf/compile_s``.
Not a unit test: a rate comparison fails on a loaded machine with the accounting right
(tests/test_throughput_warmup.py holds the accounting).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

EVERY = 5
JOBS = {
    "digits": ("samples", ["world_size=1", "data.batch_size=16", "trainer.epochs=2"]),
    "gpt": ("tokens", ["experiment=gpt_tokens", "world_size=1", "model.n_layer=1",
                       "model.n_embd=64", "data.batch_size=8", "trainer.compile=true",
                       "trainer.epochs=1", "trainer.max_steps=40", "trainer.limit_val_batches=1",
                       "trainer.sample_every_n_epochs=0"]),
}
COMMON = [f"trainer.log_every_n_steps={EVERY}", "trainer.progress=off", "print_config=false",
          "trainer.save_last=false"]


def epoch_rates(stdout: str, unit: str) -> list[tuple[int, float]]:
    """``(last step, rate)`` of each epoch line (``epoch e/E | step s | ... | N <unit>/s``)."""
    return [(int(step), float(rate.replace(",", ""))) for step, rate in re.findall(
        rf"epoch \d+/\d+ \| step (\d+) .*\| ([\d,.]+) {unit}/s$", stdout, re.M)]


def scalars(job_dir: Path, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of one TensorBoard scalar of the job's event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted((job_dir / "tensorboard").glob("events.out.tfevents*"))
    if not files:
        raise RuntimeError(f"no TensorBoard event file under {job_dir}")
    acc = EventAccumulator(str(files[-1]), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def steady_rate(points: list[tuple[int, float]], first_step: int, last_step: int) -> float:
    """The combined rate of an epoch's intervals after its first (steps ``first_step`` exclusive
    to ``last_step`` inclusive): the harmonic mean of their rates. Raises ValueError with fewer
    than 2 such intervals."""
    rates = [v for s, v in points if first_step + EVERY < s <= last_step]
    if len(rates) < 2:
        raise ValueError(f"{len(rates)} steady intervals in steps {first_step}-{last_step}")
    return statistics.harmonic_mean(rates)


def run_job(name: str, folder: Path) -> dict:
    """One job of :data:`JOBS`; its epochs' logged and steady rates."""
    unit, overrides = JOBS[name]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    job = folder / name
    done = subprocess.run([sys.executable, "-m", "ddp_exp", *overrides, *COMMON,
                           f"hydra.run.dir={job}"], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, cwd=folder)
    if done.returncode:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{name}: exit {done.returncode}: {tail}")
    metrics = json.loads((job / "metrics.json").read_text())
    points = scalars(job, f"train/{unit}_per_sec")
    epochs, first = [], 0
    for last, rate in epoch_rates(done.stdout + done.stderr, unit):
        epochs.append({"rate": rate, "steady": steady_rate(points, first, last),
                       "steps": [first + 1, last]})
        first = last
    if not epochs:
        raise RuntimeError(f"{name}: no epoch line in its output")
    return {"unit": unit, "epochs": epochs, "intervals": points,
            "metrics_rate": metrics.get(f"train/{unit}_per_sec"),
            "warmup_s": metrics.get("perf/warmup_s"), "compile_s": metrics.get("perf/compile_s")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(JOBS), help="comma-separated jobs")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-warmup-") as tmp:
        result = {name: run_job(name, Path(tmp)) for name in args.only.split(",")}
    for name, r in result.items():
        for e, ep in enumerate(r["epochs"]):
            print(f"{name} epoch {e + 1}: {ep['rate']:,.0f} {r['unit']}/s logged, "
                  f"{ep['steady']:,.0f} steady: ratio {ep['rate'] / ep['steady']:.3f}")
    print("BENCH_RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
