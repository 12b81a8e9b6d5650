"""The ``perf`` group (issue 14): what the ``perf/*`` dashboards cost, ddp_exp on digits at
world_size 2 with ``trainer.perf_metrics=true`` against ``false``.

May use: ``benchmarks.workloads``, ``benchmarks.harness``.
"""

from __future__ import annotations

from benchmarks import workloads
from benchmarks.harness.group import Group
from benchmarks.harness.stats import Target
from benchmarks.harness.variant import Variant


def variants(quick: bool) -> list[Variant]:
    d = workloads.spec("digits")
    return [Variant("perf", "ddp_exp", "digits", 2, d["batch_size"], 1 if quick else d["epochs"],
                    overrides=(f"trainer.perf_metrics={on}",), label=f"perf-{on}")
            for on in ("true", "false")]


def targets() -> list[Target]:
    return [Target("perf_metrics.on_vs_off", "digits, ws=2: ddp_exp perf_metrics on / off, "
                   "samples/s", "perf/ws2/perf-true/ddp_exp", "perf/ws2/perf-false/ddp_exp",
                   "samples_per_sec", ">=", 0.98)]


PERF = Group("perf", "perf/* dashboards: trainer.perf_metrics on and off (ddp_exp, digits)",
             variants, targets)
