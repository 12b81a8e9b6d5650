"""What the rows are compared by: medians with their spread, a target (a ratio of two variants'
medians against a bound, PASS/MISS) and the thread rule (``threads_per_rank`` of every ddp_exp
run is ``cores // world_size``).

May use: the standard library and ``benchmarks.common`` (the cores).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from benchmarks import common


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
    """``num``'s median ``field`` over ``den``'s (variant keys) against ``bound``; ``den`` None:
    ``num``'s median itself (an absolute bound, in ``field``'s unit). ``op``: ``>=``, ``<=``,
    ``<``, or ``within`` (``|ratio - 1| <= bound``). ``name``: the target's key in
    docs/benchmarks.md's table (what it measures, e.g. ``digits.ws2.vs_tight``)."""

    name: str
    what: str
    num: str
    den: str | None
    field: str
    op: str  # ">=", "<=", "<" or "within"
    bound: float
    ratio: float | None = None
    extra: dict = field(default_factory=dict)

    def evaluate(self, rows: list[dict]) -> None:
        a = stat(rows, self.num, self.field)
        if self.den is None:
            self.ratio = a.median if a else None
            return
        b = stat(rows, self.den, self.field)
        self.ratio = a.median / b.median if a and b and b.median else None

    @property
    def keys(self) -> set[str]:
        """The variant keys the target reads."""
        return {self.num} | ({self.den} if self.den else set())

    @property
    def bound_text(self) -> str:
        """The bound as the tables print it: ``>= 0.97``, ``1 +- 0.1``."""
        return f"1 +- {self.bound:g}" if self.op == "within" else f"{self.op} {self.bound:g}"

    @property
    def verdict(self) -> str:
        if self.ratio is None:
            return "n/a"
        if self.op == "within":
            off = abs(self.ratio - 1.0)
            return "PASS" if off <= self.bound else f"MISS by {off - self.bound:.1%}"
        ok = {">=": self.ratio >= self.bound, "<=": self.ratio <= self.bound,
              "<": self.ratio < self.bound}[self.op]
        if ok:
            return "PASS"
        miss = (self.bound - self.ratio) / self.bound if self.op == ">=" else (
            self.ratio - self.bound) / self.bound
        return f"MISS by {miss:.1%}"


def threads_check(rows: list[dict]) -> list[str]:
    """The thread rule (case C17): ``threads_per_rank == max(1, cores // world_size)`` on every
    ddp_exp run (the runner unsets OMP_NUM_THREADS)."""
    cores = common.cores()
    lines = []
    for r in rows:
        if r["impl"] == "ddp_exp" and r["status"] == "ok" and r["repeat"] == 0:
            want = max(1, cores // r["world_size"])
            got = r.get("threads_per_rank")
            lines.append(f"{r['variant']}: threads_per_rank {got}, expected {want}: "
                         f"{'PASS' if got == want else 'MISS'}")
    return lines
