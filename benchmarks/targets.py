"""What the rows are compared by: medians with their spread, the targets (issues 5, 11, 13 and
C17: a ratio of two variants' medians against a bound, PASS/MISS), the thread rule of C17, the
same-training check and the other ratios worth printing.

May use: ``common``, ``workloads``, ``variants``. Used by ``report`` and ``run``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import common
import workloads
from variants import Variant


@dataclass
class Stat:
    median: float
    lo: float
    hi: float
    n: int

    def fmt(self, spec: str) -> str:
        return (f"{self.median:{spec}} ({self.lo:{spec}}-{self.hi:{spec}})" if self.n > 1
                else f"{self.median:{spec}}")


def stat(rows: list[dict], key: str, field_: str) -> Stat | None:
    vals = [r[field_] for r in rows
            if r["variant"] == key and r["status"] == "ok" and r.get(field_) is not None]
    if not vals:
        return None
    return Stat(statistics.median(vals), min(vals), max(vals), len(vals))


@dataclass
class Target:
    name: str
    what: str
    num: str
    den: str
    field: str
    op: str  # ">=" or "<="
    bound: float
    ratio: float | None = None
    extra: dict = field(default_factory=dict)

    def evaluate(self, rows: list[dict]) -> None:
        a, b = stat(rows, self.num, self.field), stat(rows, self.den, self.field)
        self.ratio = a.median / b.median if a and b and b.median else None

    @property
    def verdict(self) -> str:
        if self.ratio is None:
            return "n/a"
        ok = self.ratio >= self.bound if self.op == ">=" else self.ratio <= self.bound
        if ok:
            return "PASS"
        miss = (self.bound - self.ratio) / self.bound if self.op == ">=" else (
            self.ratio - self.bound) / self.bound
        return f"MISS by {miss:.1%}"


def build_targets(groups: dict[str, list[Variant]]) -> list[Target]:
    sps, wall, rss = "samples_per_sec", "wall_s", "peak_rss_mib_per_rank"
    t: list[Target] = []
    for wl in ("digits", "compute"):
        for ws in (1, 2):
            t.append(Target("(a)", f"{wl}, ws={ws}: ddp_exp / hand-tuned, samples/s",
                            f"{wl}/ws{ws}/ddp_exp", f"{wl}/ws{ws}/tuned", sps, ">=", 0.97))
    for wl in ("digits", "compute"):
        for ws in (1, 2):
            t.append(Target("I13", f"{wl}, ws={ws}: ddp_exp (default keys) / tight script, "
                            "samples/s", f"{wl}/ws{ws}/defaults/ddp_exp", f"{wl}/ws{ws}/tight",
                            sps, ">=", 0.97))
    t.append(Target("(b)", "digits, ws=2: ddp_exp / Lightning, samples/s",
                    "digits/ws2/ddp_exp", "digits/ws2/lightning", sps, ">=", 2.0))
    t.append(Target("(b)", "digits, ws=2: ddp_exp / Lightning, wall s",
                    "digits/ws2/ddp_exp", "digits/ws2/lightning", wall, "<=", 0.5))
    t.append(Target("(c)", "compute: ddp_exp ws=2 / ws=1, samples/s",
                    "compute/ws2/ddp_exp", "compute/ws1/ddp_exp", sps, ">=", 0.95))
    t.append(Target("(d)", "1-epoch digits job wall / bare 2-rank launch (mp fork)",
                    "startup/ws2/ddp_exp", "startup/ws2/bare-mp-fork", wall, "<=", 1.3))
    t.append(Target("I13", "1-epoch digits job, ws=2, default keys: ddp_exp / hand-tuned "
                    "script, wall s", "startup/ws2/defaults/ddp_exp", "startup/ws2/tuned", wall,
                    "<=", 1.1))
    for wl in ("digits", "compute"):
        for ws in (1, 2):
            t.append(Target("(e)", f"{wl}, ws={ws}: ddp_exp / hand-tuned, peak RSS per rank",
                            f"{wl}/ws{ws}/ddp_exp", f"{wl}/ws{ws}/tuned", rss, "<=", 1.2))
    b = workloads.spec("digits")["batch_size"]
    t.append(Target("C17", f"digits: ddp_exp ws=2 (b={b}) / ws=1 (b={2 * b}), samples/s",
                    f"c17/ws2/b{b}/ddp_exp", f"c17/ws1/b{2 * b}/ddp_exp", sps, ">=", 0.5))
    t.append(Target("perf", "digits, ws=2: ddp_exp perf_metrics on / off, samples/s",
                    "perf/ws2/perf-true/ddp_exp", "perf/ws2/perf-false/ddp_exp", sps, ">=", 0.98))
    t.append(Target("I30", "digits, ws=2: a step checkpoint every 50 steps / none, samples/s",
                    "step_checkpoint/ws2/every-50/ddp_exp",
                    "step_checkpoint/ws2/every-null/ddp_exp", sps, ">=", 0.97))
    t.append(Target("I11", "image folder, ws=2: ddp_exp / hand-written script, samples/s",
                    "image_folder/ws2/ddp_exp", "image_folder/ws2/handwritten", sps, ">=", 0.95))
    present = {v.key for vs in groups.values() for v in vs}
    return [x for x in t if x.num in present and x.den in present]


def threads_check(rows: list[dict]) -> list[str]:
    """C17's other half: ``threads_per_rank == max(1, cores // world_size)`` on every ddp_exp
    run (the runner unsets OMP_NUM_THREADS)."""
    cores = common.cores()
    lines = []
    for r in rows:
        if r["impl"] == "ddp_exp" and r["status"] == "ok" and r["repeat"] == 0:
            want = max(1, cores // r["world_size"])
            got = r.get("threads_per_rank")
            lines.append(f"{r['variant']}: threads_per_rank {got}, expected {want}: "
                         f"{'PASS' if got == want else 'MISS'}")
    return lines




def same_training(rows: list[dict], groups: dict[str, list[Variant]]) -> list[str]:
    out = []
    for wl in ("digits", "compute", "image_folder"):
        if wl not in groups:
            continue
        for ws in (1, 2):
            vals = {r["variant"].split("/", 2)[2]: r["val_loss"] for r in rows
                    if r["group"] == wl and r["world_size"] == ws and r["status"] == "ok"
                    and r["repeat"] == 0 and r.get("val_loss") is not None
                    and r["impl"] in ("ddp_exp", "tuned", "tight", "tutorial", "tutorial-1t",
                                      "handwritten")}
            if len(vals) > 1:
                spread = max(vals.values()) - min(vals.values())
                out.append(f"{wl}, ws={ws}: " + ", ".join(f"{k} {v:.6f}" for k, v in vals.items())
                           + f" (spread {spread:.1e}: {'same' if spread < 1e-4 else 'DIFFERENT'})")
    return out


def extra_ratios(rows: list[dict], groups: dict[str, list[Variant]]) -> list[str]:
    out = []
    present = {v.key for vs in groups.values() for v in vs}
    pairs = [("digits/ws2/tutorial-1t", "digits/ws2/tutorial", "samples_per_sec",
              "digits ws=2, tutorial: 1 thread/rank vs default threads, samples/s"),
             ("compute/ws2/tutorial-1t", "compute/ws2/tutorial", "samples_per_sec",
              "compute ws=2, tutorial: 1 thread/rank vs default threads, samples/s"),
             ("digits/ws2/ddp_exp", "digits/ws2/tuned", "wall_s",
              "digits ws=2: ddp_exp / hand-tuned, wall s"),
             ("startup/ws2/ddp_exp", "startup/ws2/bare-elastic", "wall_s",
              "1-epoch job wall / bare elastic launch"),
             ("startup/ws2/ddp_exp", "startup/ws2/tuned", "wall_s",
              "1-epoch job wall: ddp_exp / hand-tuned script (which also builds DDP and trains)"),
             ("startup/ws2/bare-mp-spawn", "startup/ws2/bare-mp-fork", "wall_s",
              "bare launch: spawn / fork, wall s"),
             ("c17/ws4/b16/ddp_exp", "c17/ws1/b64/ddp_exp", "samples_per_sec",
              "C17: ddp_exp ws=4 (b=16) / ws=1 (b=64), samples/s")]
    for num, den, f, what in pairs:
        if num in present and den in present:
            a, b = stat(rows, num, f), stat(rows, den, f)
            if a and b and b.median:
                out.append(f"{what}: {a.median / b.median:.3f}")
    return out
