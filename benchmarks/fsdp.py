"""``strategy=fsdp`` against ``strategy=ddp``: the state each rank holds, peak RSS and tokens/s
(issue 40).

    python benchmarks/fsdp.py                       # the issue's GPT (~25M parameters), 5 pairs
    python benchmarks/fsdp.py --repeats 10 --steps 10
    python benchmarks/fsdp.py --quick               # smoke test: a tiny GPT, 1 pair

Each repeat runs ``model=gpt data=tokens optim=adamw`` at ``world_size=2`` once per strategy
(alternating, ddp first), each run one ``python -m ddp_exp`` process with ``OMP_NUM_THREADS``
removed, and reads its ``metrics.json``: ``perf/state_mb_per_rank`` (parameters + gradients +
AdamW state, MiB, the largest over the ranks), ``perf/max_rss_mb`` (peak RSS, the largest rank)
and ``train/tokens_per_sec``. Prints the medians (min-max) per strategy and the ratios the issue
sets: state fsdp/ddp <= 0.55, RSS fsdp < ddp, tokens/s fsdp/ddp >= 0.85.

Why RSS falls less than the state: beside the shards, a rank holds each block's all-gathered
parameters while it runs (all of them at once with ``strategy.reshard_after_forward=false``),
the unsharded gradients of a block until they are reduce-scattered (and of every block during
an accumulating micro-batch), the activations (``strategy.activation_checkpointing=true`` cuts
them to one block's), and the allocator's free pages; the seeded full model the launching
process builds is shared with the forked ranks, and counts in a rank's RSS once it is read.

Standalone (``main()``); not yet one of ``benchmarks/run.py``'s groups.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KEYS = ("perf/state_mb_per_rank", "perf/max_rss_mb", "train/tokens_per_sec")
ISSUE_GPT = ["model.n_layer=8", "model.n_embd=512", "model.n_head=8", "data.block_size=128",
             "data.batch_size=2"]
QUICK_GPT = ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "data.block_size=64",
             "data.batch_size=4"]


def run_one(strategy: str, model: list[str], steps: int, folder: Path) -> dict[str, float]:
    """One ddp_exp job under ``strategy``; returns :data:`KEYS` from its ``metrics.json`` and
    its wall seconds (``wall_s``).

    Raises:
        RuntimeError: the job failed (its last lines).
    """
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    cmd = [sys.executable, "-m", "ddp_exp", "model=gpt", "data=tokens", "optim=adamw",
           "world_size=2", f"strategy={strategy}", *model, f"trainer.max_steps={steps}",
           "trainer.epochs=1", "trainer.limit_val_batches=2",
           "trainer.sample_every_n_epochs=0", "print_config=false",
           f"hydra.run.dir={folder}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{strategy}: exit {proc.returncode}: {proc.stderr[-800:]}")
    metrics = json.loads((folder / "metrics.json").read_text())
    return {**{k: float(metrics[k]) for k in KEYS}, "wall_s": wall}


def summary(rows: list[dict[str, float]], key: str) -> str:
    values = [r[key] for r in rows]
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main(argv: list[str] | None = None) -> int:
    """Run the pairs and print the table; returns 0, or 1 when a target is missed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per run")
    p.add_argument("--quick", action="store_true", help="a tiny GPT, 1 pair: not a measurement")
    args = p.parse_args(argv)
    repeats, model = (1, QUICK_GPT) if args.quick else (args.repeats, ISSUE_GPT)
    rows: dict[str, list[dict[str, float]]] = {"ddp": [], "fsdp": []}
    with tempfile.TemporaryDirectory(prefix="bench_fsdp_") as tmp:
        for i in range(repeats):
            for strategy in ("ddp", "fsdp"):
                rows[strategy].append(run_one(strategy, model, args.steps,
                                              Path(tmp) / f"{strategy}_{i}"))
    print(f"| strategy | {' | '.join(KEYS)} | wall_s |")
    print("|---|" + "---|" * (len(KEYS) + 1))
    for strategy, rs in rows.items():
        print(f"| {strategy} | " + " | ".join(summary(rs, k) for k in (*KEYS, "wall_s")) + " |")
    med = {s: {k: statistics.median(r[k] for r in rs) for k in KEYS} for s, rs in rows.items()}
    state = med["fsdp"][KEYS[0]] / med["ddp"][KEYS[0]]
    speed = med["fsdp"][KEYS[2]] / med["ddp"][KEYS[2]]
    rss_lower = med["fsdp"][KEYS[1]] < med["ddp"][KEYS[1]]
    print(f"state fsdp/ddp {state:.3f} (target <= 0.55); peak RSS lower under fsdp: "
          f"{rss_lower}; tokens/s fsdp/ddp {speed:.3f} (target >= 0.85)")
    return 0 if state <= 0.55 and rss_lower and speed >= 0.85 else 1


if __name__ == "__main__":
    sys.exit(main())
