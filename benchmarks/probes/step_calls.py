"""The calls ddp_exp's training step makes that the tight loop's does not (issue 42 item 2),
from two cProfile profiles of the same number of steps (``step_overhead.py --calls CSV``).

A function's *calls per step* is exact whatever the machine's load; its *own time per step*
(cProfile's ``tottime``, this thread's CPU time) includes the profiler's own cost of about
0.3-1 us per call, so the absolute figures are high (the unprofiled difference is
``step_overhead``'s median) but their order is right. A function the tight loop calls too
appears with the difference of the two loops' counts and times.

May use: ``benchmarks.harness.results`` (the stamp), the standard library.
"""

from __future__ import annotations

import csv
import os
import pstats
from dataclasses import dataclass

FIELDS = ("measured", "commit", "group", "function", "where", "calls_per_step",
          "tight_calls_per_step", "us_per_step", "tight_us_per_step", "added_us_per_step")


@dataclass
class Row:
    """One function: calls and own time (us) per step in ddp_exp's and the tight loop's."""

    function: str
    where: str
    calls: float
    tight_calls: float
    us: float
    tight_us: float

    @property
    def added_us(self) -> float:
        return self.us - self.tight_us

    def values(self) -> tuple:
        return (self.function, self.where, round(self.calls, 3), round(self.tight_calls, 3),
                round(self.us, 2), round(self.tight_us, 2), round(self.added_us, 2))


def _per_function(profile, steps: int) -> dict[tuple, tuple[float, float]]:
    """(file, line, name) -> (calls, own us) per step."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return {key: (value[1] / steps, value[2] * 1e6 / steps) for key, value in stats.items()}


def _name(key: tuple) -> tuple[str, str]:
    file, line, name = key
    if file == "~":  # a builtin or C method: "<built-in method torch.xxx>"
        return name, "C"
    parts = file.replace(os.sep, "/").split("/")
    for root in ("ddp_exp", "torch", "benchmarks"):
        if root in parts:
            parts = parts[len(parts) - parts[::-1].index(root) - 1:]
            break
    else:
        parts = parts[-2:]
    return name, f"{'/'.join(parts)}:{line}"


def added_calls(profile, tight_profile, steps: int) -> list[Row]:
    """The functions ddp_exp's loop calls more often per step than the tight loop, or spends
    more own time in (> 0.05 us per step), and those only the tight loop calls (its own loop,
a negative added time), most added time first. ``steps``: the number of
    steps each profile covers (the same for both)."""
    mine, tight = _per_function(profile, steps), _per_function(tight_profile, steps)
    rows = []
    for key, (calls, us) in mine.items():
        t_calls, t_us = tight.get(key, (0.0, 0.0))
        if calls - t_calls > 1e-3 or us - t_us > 0.05:
            rows.append(Row(*_name(key), calls, t_calls, us, t_us))
    for key, (t_calls, t_us) in tight.items():  # the tight loop's own (its loop's body)
        if key not in mine and t_us > 0.05:
            rows.append(Row(*_name(key), 0.0, t_calls, 0.0, t_us))
    return sorted(rows, key=lambda r: -r.added_us)


def calls_per_step(profile, steps: int) -> float:
    """All function calls (Python and C) per step in ``profile``, which covers ``steps``
    steps: the load-proof total."""
    return pstats.Stats(profile).total_calls / steps  # type: ignore[attr-defined]


def write_csv(path: str, rows: list[Row]) -> None:
    """``rows`` as CSV (:data:`FIELDS`), replacing ``path``; each row stamped with when and at
    which commit it was measured and the group ``step_overhead``. Kept as
    ``benchmarks/results/step_overhead/calls.csv``: the folder of the group's details, beside
    the ``<group>.csv`` files of runs."""
    from benchmarks.harness.results import stamp

    when = stamp()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(FIELDS)
        out.writerows((when["measured"], when["commit"], "step_overhead", *row.values())
                      for row in rows)


def table(rows: list[Row], limit: int = 40) -> str:
    """The ``limit`` rows that add the most time, as aligned text, with the totals of all."""
    lines = [f"{'added us/step':>13} {'calls/step':>10} {'(tight)':>8}  function (where)"]
    for r in rows[:limit]:
        lines.append(f"{r.added_us:13.2f} {r.calls:10.2f} {r.tight_calls:8.2f}  "
                     f"{r.function} ({r.where})")
    added_calls = sum(r.calls - r.tight_calls for r in rows)
    lines.append(f"{sum(r.added_us for r in rows):13.2f} {added_calls:10.2f} {'':8}  all "
                 f"{len(rows)} functions (profiled us: inflated by cProfile)")
    return "\n".join(lines)
