"""The ``startup`` group (issues 5 and 13): the whole 1-epoch digits job at world_size 2, timed
from outside (interpreter start to exit), against bare 2-rank launches that import torch and
initialise gloo and nothing else (``baselines/bare_launch.py``: mp fork, the elastic launcher,
mp spawn), and against the hand-written scripts' own 1-epoch jobs (hand-tuned, tight) with
ddp_exp's default keys beside them.

May use: ``benchmarks.workloads``, ``benchmarks.harness``.
"""

from __future__ import annotations

from benchmarks import workloads
from benchmarks.harness.group import Group
from benchmarks.harness.stats import Target
from benchmarks.harness.variant import Variant


def variants(quick: bool) -> list[Variant]:
    """The same runs with or without ``quick`` (a 1-epoch job is already short)."""
    b = workloads.spec("digits")["batch_size"]
    return [Variant("startup", "ddp_exp", "digits", 2, b, 1)] + [
        Variant("startup", impl, "digits", 2, b, 1)
        for impl in ("bare-mp-fork", "bare-elastic", "bare-mp-spawn", "tuned")] + [
        Variant("startup", "ddp_exp", "digits", 2, b, 1, label="defaults", user_defaults=True),
        Variant("startup", "tight", "digits", 2, b, 1)]


def targets() -> list[Target]:
    return [Target("startup.vs_bare_launch", "1-epoch digits job, ws=2: ddp_exp / bare 2-rank "
                   "launch (mp fork), wall s", "startup/ws2/ddp_exp", "startup/ws2/bare-mp-fork",
                   "wall_s", "<=", 1.3),
            Target("startup.vs_tuned", "1-epoch digits job, ws=2, default keys: ddp_exp / "
                   "hand-tuned script, wall s", "startup/ws2/defaults/ddp_exp",
                   "startup/ws2/tuned", "wall_s", "<=", 1.1)]


STARTUP = Group(
    "startup", "Start-up: the 1-epoch digits job against bare 2-rank launches and the "
    "hand-written scripts' 1-epoch jobs", variants, targets,
    ratios=(("startup/ws2/ddp_exp", "startup/ws2/bare-elastic", "wall_s",
             "1-epoch job wall / bare elastic launch"),
            ("startup/ws2/ddp_exp", "startup/ws2/tuned", "wall_s",
             "1-epoch job wall: ddp_exp / hand-tuned script (which also builds DDP and trains)"),
            ("startup/ws2/bare-mp-spawn", "startup/ws2/bare-mp-fork", "wall_s",
             "bare launch: spawn / fork, wall s")))
