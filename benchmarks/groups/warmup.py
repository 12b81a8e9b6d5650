"""The ``warmup`` group (issue 41 item 3): whether a logged rate leaves warm-up out, each run
measured against itself (``benchmarks/probes/warmup_rates.py``): each epoch's samples/s (digits,
world_size 1, 2 epochs) and the compiled GPT's tokens/s (``trainer.compile=true``) against the
harmonic mean of the same epoch's steady TensorBoard intervals after the first. Target: within
10%. Here because a rate comparison is a timing: as a unit test it failed on a loaded CI machine
with the accounting right (tests/test_throughput_warmup.py holds the accounting).

Rows (``benchmarks/results/warmup.csv``, ``samples_per_sec``: samples/s, or tokens/s for the
GPT): per repeat, ``<job>-epoch<e>`` the logged rate, ``<job>-epoch<e>-steady`` its steady
intervals', ``<job>-epoch<e>-first-interval`` the epoch's first interval's (left out of the
steady rate: where the warm-up was), and ``<job>-epoch<e>-ratio`` the run's ratio (``ratio``
column) logged / steady; a target is the median of the runs' ratios.

May use: ``benchmarks.harness``, ``benchmarks.groups.step_checkpoint`` (the probe runner).
"""

from __future__ import annotations

from benchmarks.groups.step_checkpoint import probe_result
from benchmarks.harness.group import Group, ProbeFailed, probe_row
from benchmarks.harness.stats import Target
from benchmarks.probes.warmup_rates import EVERY

GROUP = "warmup"
PROBE = "benchmarks.probes.warmup_rates"
BOUND = 0.10
EPOCHS = {"digits": 2, "gpt": 1}
WHAT = {"digits": "digits, ws=1, epoch {e} of 2: its log line's samples/s",
        "gpt": "GPT, trainer.compile=true, 40 steps: the epoch's tokens/s"}


def measure(quick: bool, repeats: int, timeout_s: float) -> list[dict]:
    """``repeats`` runs of the probe (1 with ``quick``: the same jobs), as rows. Raises
    ProbeFailed where a run gave no result."""
    rows = []
    for rep in range(1 if quick else repeats):
        r = probe_result(PROBE, [], timeout_s)
        for job, res in r.items():
            if len(res["epochs"]) != EPOCHS[job]:
                raise ProbeFailed(f"{PROBE}: {job} logged {len(res['epochs'])} epoch lines, "
                                  f"not {EPOCHS[job]}")
            for e, ep in enumerate(res["epochs"], 1):
                first = [v for s, v in res["intervals"] if ep["steps"][0] <= s < ep["steps"][0]
                         + EVERY]
                for label, rate in (("", ep["rate"]), ("-steady", ep["steady"]),
                                    ("-first-interval", first[0] if first else None)):
                    rows.append(probe_row(GROUP, f"{job}-epoch{e}{label}", rep, workload=job,
                                          samples_per_sec=rate))
                rows.append(probe_row(GROUP, f"{job}-epoch{e}-ratio", rep, workload=job,
                                      ratio=ep["rate"] / ep["steady"]))
            print(f"  [{rep}] {job}: " + ", ".join(
                f"epoch {e} {ep['rate']:,.0f} / steady {ep['steady']:,.0f} = "
                f"{ep['rate'] / ep['steady']:.3f}" for e, ep in enumerate(res["epochs"], 1))
                + (f" (perf/compile_s {res['compile_s']:.1f})" if res.get("compile_s") else ""),
                flush=True)
    return rows


def key(label: str) -> str:
    return f"{GROUP}/ws1/{label}/probe"


def targets() -> list[Target]:
    """The median over the runs of each run's own ratio (the rates of different runs differ by
    more than 10% on a busy machine; a run's epoch and its intervals span the same minutes)."""
    return [Target(f"warmup.{job}.epoch{e}", WHAT[job].format(e=e) + " / its steady "
                   "intervals' (harmonic mean after the first), median of the runs' ratios",
                   key(f"{job}-epoch{e}-ratio"), None, "ratio", "within", BOUND)
            for job, n in EPOCHS.items() for e in range(1, n + 1)]


WARMUP = Group(GROUP, "Warm-up left out of the rates: each epoch's logged rate against its own "
               "steady intervals (digits ws=1; GPT with trainer.compile=true)",
               lambda quick: [], targets, probe=measure, opt_in=True)
