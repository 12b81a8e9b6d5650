"""The ``step_overhead`` group (issue 13; issue 42 item 2): what ddp_exp's training loop adds
per step to the tight hand-written loop, in one process (``benchmarks/probes/step_overhead.py``:
a world of one rank, one intra-op thread, epochs of ``Trainer.train_epoch`` alternated with
epochs of the tight loop, this thread's CPU seconds per step). No interleaved runs: the probe's
lines are the report. Opt-in: ``make bench ARGS="--only step_overhead"``; for a profile or an
A/B of overrides run the probe itself (``python -m benchmarks.probes.step_overhead --help``).

May use: ``benchmarks.common``, ``benchmarks.harness``.
"""

from __future__ import annotations

import subprocess

from benchmarks import common
from benchmarks.harness.group import Group, ProbeFailed
from benchmarks.harness.variant import PY

PROBE = "benchmarks.probes.step_overhead"
EPOCHS, QUICK_EPOCHS = 30, 2


def in_one_process(quick: bool, timeout_s: float) -> list[str]:
    """The probe's table (per-step CPU time of each loop, ddp_exp's addition over the tight
    loop), one line per loop. Raises ProbeFailed where the probe failed."""
    argv = [PY, "-m", PROBE, "--epochs", str(QUICK_EPOCHS if quick else EPOCHS)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                              cwd=common.ROOT)
    except subprocess.TimeoutExpired:
        raise ProbeFailed(f"{PROBE}: no result within {timeout_s:g} s") from None
    lines = [ln.strip() for ln in done.stdout.splitlines() if ln.strip()]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ProbeFailed(f"{PROBE}: exit {done.returncode} ({tail[:200]})")
    return lines


STEP_OVERHEAD = Group("step_overhead", "Step overhead: ddp_exp's loop against the tight loop, "
                      "per step, in one process", lambda quick: [], extra=in_one_process,
                      opt_in=True)
