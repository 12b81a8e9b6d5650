"""The ``step_checkpoint`` group (issue 30): what a step checkpoint every 50 steps costs digits'
training at world_size 2 (bound: >= 0.97 of the samples/s without), measured two ways.

* Pairs of whole runs: ddp_exp with ``trainer.checkpoint_every_n_steps=50`` against none (digits:
  24 steps an epoch at world_size 2, so one about every other epoch, written on the background
  thread), interleaved.
* Inside one world (:func:`in_world`, ``benchmarks/probes/step_checkpoint_cost.py``): the pairs
  cannot resolve 3% on a machine whose speed drifts by +-20% between runs; alternating blocks
  of epochs of two Trainers in one pair of processes can. The share of the blocks' time the
  checkpoints took (the loop's wait in them plus the writer thread's CPU), as the throughput
  kept, against the same bound.

The epoch checkpoint's cost (issue 42) is another group, in a module of its own.

May use: ``benchmarks.workloads``, ``benchmarks.harness``.
"""

from __future__ import annotations

import json
import subprocess

from benchmarks import common, workloads
from benchmarks.harness.group import Group, ProbeFailed
from benchmarks.harness.stats import Target
from benchmarks.harness.variant import PY, Variant

BOUND = 0.97
PROBE = "benchmarks.probes.step_checkpoint_cost"


def variants(quick: bool) -> list[Variant]:
    d = workloads.spec("digits")
    return [Variant("step_checkpoint", "ddp_exp", "digits", 2, d["batch_size"],
                    1 if quick else d["epochs"],
                    overrides=(f"trainer.checkpoint_every_n_steps={every}",),
                    label=f"every-{every}")
            for every in ("50", "null")]


def targets() -> list[Target]:
    return [Target("step_checkpoint.pairs", "digits, ws=2: a step checkpoint every 50 steps / "
                   "none, samples/s (pairs of whole runs)", "step_checkpoint/ws2/every-50/ddp_exp",
                   "step_checkpoint/ws2/every-null/ddp_exp", "samples_per_sec", ">=", BOUND)]


def in_world(quick: bool, timeout_s: float) -> list[str]:
    """The probe's result as one line: throughput kept (1 - the checkpoints' share of the
    blocks' time) against :data:`BOUND`, the loop's wait and the writer's CPU per checkpoint (ms),
    the CPU share and the blocks' ratio. Raises ProbeFailed where the probe gave no result."""
    r = probe_result(PROBE, ["--rounds", "4" if quick else "40",
                             "--epochs-per-block", "2" if quick else "4"], timeout_s)
    kept = 1.0 - r["direct_cost"]
    n = max(1, r["step_checkpoints"])
    cpu = (r["take_cpu_s"] + r["writer_cpu_s"]) / r["seconds"]["every-50"]
    return [f"in one world ({n} step checkpoints, blocks of {r['epochs_per_block']} epochs "
            f"alternated {r['rounds']} times): throughput kept {kept:.3f} (bound >= {BOUND}: "
            f"{'PASS' if kept >= BOUND else 'MISS'}); per checkpoint the loop waits "
            f"{1000 * r['take_s'] / n:.2f} ms (its CPU {1000 * r['take_cpu_s'] / n:.2f} ms) and "
            f"the writer thread uses {1000 * r['writer_cpu_s'] / n:.2f} ms of CPU; CPU share "
            f"{100 * cpu:.2f}%; the blocks' ratio (with / without) {r['ratio']:.3f}"]


def probe_result(probe: str, args: list[str], timeout_s: float) -> dict:
    """Run ``python -m probe *args`` and return its ``BENCH_RESULT`` JSON. Raises ProbeFailed
    where it gave none within ``timeout_s`` seconds."""
    try:
        done = subprocess.run([PY, "-m", probe, *args], capture_output=True, text=True,
                              timeout=timeout_s, cwd=common.ROOT)
        return json.loads(done.stdout.rsplit("BENCH_RESULT ", 1)[1])
    except subprocess.TimeoutExpired:
        raise ProbeFailed(f"{probe}: no result within {timeout_s:g} s") from None
    except (IndexError, ValueError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ProbeFailed(f"{probe}: exit {done.returncode}, no result ({tail[:200]})") from None


STEP_CHECKPOINT = Group("step_checkpoint", "Step checkpoints: every 50 steps against none "
                        "(ddp_exp, digits, ws=2)", variants, targets, extra=in_world)
