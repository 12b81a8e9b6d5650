"""What a benchmark group is: the runs it interleaves, the targets it is judged by, and the hooks
the runner calls around them. Each module of ``benchmarks/groups/`` defines one or two
:class:`Group` values and ``benchmarks/registry.py`` lists them.

May use: ``stats`` (Target), ``variant`` (Variant), ``measure`` (the arrays' check).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.harness.measure import check_arrays
from benchmarks.harness.stats import Target
from benchmarks.harness.variant import Variant


class ProbeFailed(RuntimeError):
    """A group's ``extra`` measured nothing: the message says why in one line."""


def _no_targets() -> list[Target]:
    return []


@dataclass(frozen=True)
class Group:
    """One group of ``make bench`` (``--only NAME``).

    * ``variants(quick)``: the runs, in the order they are interleaved (``quick``: the smoke
      test's smaller settings: it must still run every variant, briefly);
    * ``targets()``: the group's targets (a target is kept only where both its variants run);
    * ``title`` and ``table(rows, variants)``: the report's section (None: one row per variant,
      ``report.group_table``);
    * ``prepare(variants)``: writes the group's data (a temporary folder the runner deletes
      afterwards; returned, or None) and points the variants at it;
    * ``check(variants)``: raises AssertionError unless the hand-written scripts read what
      ddp_exp reads; returns what was checked, for the report;
    * ``extra(quick, timeout_s)``: a measurement that is not a set of interleaved runs (a probe
      in one process, ``benchmarks/probes/``), as lines for the report; run after the runs;
      raises :class:`ProbeFailed` when it measured nothing (the run then exits 1);
    * ``probe(quick, repeats, timeout_s)``: a measurement that is not a set of interleaved runs
      whose figures are rows of the group's results file (:func:`probe_row`), so that its
      targets land in docs/benchmarks.md's table like the runs'; run after the runs; raises
      :class:`ProbeFailed` when it measured nothing;
    * ``ratios``: ``(num, den, field, what)`` of other ratios worth printing, no bound;
    * ``min_repeats``: interleaved repeats at least (not with ``--quick``); ``opt_in``: run
      only when ``--only`` names it (it takes too long for every ``make bench``);
    * ``notes``: lines for the report's "how each figure is measured".
    """

    name: str
    title: str
    variants: Callable[[bool], list[Variant]]
    targets: Callable[[], list[Target]] = _no_targets
    table: Callable[[list[dict], list[Variant]], list[str]] | None = None
    prepare: Callable[[list[Variant]], str | None] | None = None
    check: Callable[[list[Variant]], list[str]] = check_arrays
    extra: Callable[[bool, float], list[str]] | None = None
    probe: Callable[[bool, int, float], list[dict]] | None = None
    ratios: tuple[tuple[str, str, str, str], ...] = ()
    min_repeats: int = 0
    opt_in: bool = False
    notes: tuple[str, ...] = field(default=())

    def command(self) -> str:
        """The ``make`` command that measures this group alone."""
        return f'make bench ARGS="--only {self.name}"'


def probe_row(group: str, label: str, repeat: int, world_size: int = 1, *, workload: str = "",
              impl: str = "probe", status: str = "ok", **figures) -> dict:
    """One row of a group's results file measured by its ``probe``: the variant key
    ``<group>/ws<world_size>/<label>/<impl>`` (the keys its targets name; ``impl`` "probe": not
    one of the runner's ddp_exp runs, whose thread rule it is not held to), the row's
    description, and ``figures`` (columns of ``results.CSV_FIELDS``: ``samples_per_sec``,
    ``wall_s``, ``first_line_s``, ...)."""
    return {"group": group, "variant": f"{group}/ws{world_size}/{label}/{impl}", "impl": impl,
            "workload": workload, "world_size": world_size, "batch_size": None, "epochs": None,
            "repeat": repeat, "rc": 0 if status == "ok" else None, "status": status,
            "loadavg_1m": round(os.getloadavg()[0], 2), "note": "", **figures}
