"""The ``threads`` group (case C17, thread oversubscription; ``--only c17`` still names it):
ddp_exp on digits at the same global batch 64, ``world_size=1`` with 64 per rank, ``2`` with 32,
``4`` with 16; with every ddp_exp run's ``threads_per_rank`` checked against
``cores // world_size`` (the report's thread lines).

May use: ``benchmarks.workloads``, ``benchmarks.harness``.
"""

from __future__ import annotations

from benchmarks import workloads
from benchmarks.harness.group import Group
from benchmarks.harness.stats import Target
from benchmarks.harness.variant import Variant

B = workloads.spec("digits")["batch_size"]


def variants(quick: bool) -> list[Variant]:
    epochs = 1 if quick else workloads.spec("digits")["epochs"]
    return [Variant("threads", "ddp_exp", "digits", ws, bs, epochs)
            for ws, bs in ((1, 2 * B), (2, B), (4, B // 2))]


def targets() -> list[Target]:
    return [Target("threads.ws2_vs_ws1", f"digits: ddp_exp ws=2 (b={B}) / ws=1 (b={2 * B}), "
                   "samples/s", f"threads/ws2/b{B}/ddp_exp", f"threads/ws1/b{2 * B}/ddp_exp",
                   "samples_per_sec", ">=", 0.5)]


THREADS = Group("threads", "Threads: oversubscription (ddp_exp, digits, the same global batch "
                "64)", variants, targets,
                ratios=((f"threads/ws4/b{B // 2}/ddp_exp", f"threads/ws1/b{2 * B}/ddp_exp",
                         "samples_per_sec", f"ddp_exp ws=4 (b={B // 2}) / ws=1 (b={2 * B}), "
                         "samples/s"),))
