"""What the trackers cost the training loop (issue 38): digits at world_size 2, pairs of whole
runs alternating ``logger=tensorboard`` and ``logger=[tensorboard,csv,mlflow]`` (local SQLite
store), compared by ``train/samples_per_sec`` of ``metrics.json`` (the training loop only: the
trackers run on a background thread of rank 0, so the target is a ratio near 1) and by the
job's wall seconds (which include MLflow's import and store creation, paid once per job).

    python benchmarks/trackers_cost.py [--pairs 5] [--epochs 10]

Prints ``BENCH_RESULT {json}``: per variant the median samples/s and wall seconds, and the
ratio of the medians (with trackers / without). Whole runs on a shared machine vary by +-20%
from one run to the next: read the ratio over several pairs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {"tensorboard": "logger=tensorboard", "csv+mlflow": "logger=[tensorboard,csv,mlflow]"}


def one_run(folder: Path, logger: str, epochs: int) -> tuple[float, float]:
    """(train/samples_per_sec, wall seconds) of one digits run at world_size 2."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "ddp_exp", logger, "world_size=2", "backend=gloo",
                    f"trainer.epochs={epochs}", "print_config=false", "trainer.progress=off",
                    f"hydra.run.dir={folder}"], check=True, capture_output=True, cwd=folder.parent)
    wall = time.monotonic() - start
    metrics = json.loads((folder / "metrics.json").read_text())
    return metrics["train/samples_per_sec"], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for name, logger in VARIANTS.items():
                results[name].append(one_run(Path(tmp) / f"{name}-{i}", logger, args.epochs))
    summary = {name: {"samples_per_sec": statistics.median(s for s, _ in runs),
                      "wall_s": statistics.median(w for _, w in runs)}
               for name, runs in results.items()}
    summary["ratio_samples_per_sec"] = (summary["csv+mlflow"]["samples_per_sec"]
                                        / summary["tensorboard"]["samples_per_sec"])
    summary["pairs"] = args.pairs
    print("BENCH_RESULT " + json.dumps(summary))


if __name__ == "__main__":
    main()
