"""``make bench``: ddp_exp side by side with hand-written DDP, Lightning and a nanoGPT-style loop.

    python -m benchmarks                       # the default groups: 5 interleaved repeats each
    python -m benchmarks --repeats 7
    python -m benchmarks --quick               # smoke test: 1 repeat, tiny epochs (no numbers)
    python -m benchmarks --only digits,startup
    python -m benchmarks --only digits --impls defaults/ddp_exp,tight --repeats 10
    python -m benchmarks --only scaling        # opt-in groups run only when named
    python -m benchmarks --list                # the groups, and the command of each

(``make bench ARGS="..."`` runs the same with the bench extra, Lightning, installed.) Each group
(``benchmarks/registry.py``; one module each in ``benchmarks/groups/``) runs its variants
interleaved: for every repeat, every variant once, A B C A B C ... Each run is one process
started from here with ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` removed from its environment;
figures: training samples/s of the loop only, end-to-end wall seconds of the whole process, peak
resident memory per rank (``benchmarks/harness/``).

Writes: each group's rows into ``benchmarks/results/<group>.csv`` (replacing the rows of the
variants that ran), the run's report to ``outputs/bench/report.md``, and each target's row of
docs/benchmarks.md's table. ``--quick`` is not a measurement: it writes
``outputs/bench/quick.csv`` and the report only, and leaves the results and the docs alone; so
does a run given ``--csv`` (all rows into that one file).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from benchmarks import common
from benchmarks.harness import report, results
from benchmarks.harness.group import ProbeFailed
from benchmarks.harness.measure import run_groups, warm_up
from benchmarks.harness.stats import threads_check
from benchmarks.harness.variant import Variant
from benchmarks.registry import ALIASES, GROUPS

OUT = os.path.join(common.ROOT, "outputs", "bench")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks",
                                description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="interleaved runs per variant")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 1 repeat, 1 epoch, small data; no results written")
    default = ",".join(n for n, g in GROUPS.items() if not g.opt_in)
    opt_in = ",".join(n for n, g in GROUPS.items() if g.opt_in)
    p.add_argument("--only", default=None,
                   help=f"comma-separated groups (default: {default}; opt-in: {opt_in})")
    p.add_argument("--impls", default=None,
                   help="comma-separated variants to keep in the chosen groups, by key suffix: "
                        "e.g. 'defaults/ddp_exp,tight' (default: all)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--csv", default=None,
                   help="write every row into this one file (not benchmarks/results/)")
    p.add_argument("--markdown", default=os.path.join(OUT, "report.md"), help="the run's report")
    p.add_argument("--no-docs", action="store_true",
                   help="leave docs/benchmarks.md's table of targets as it is")
    p.add_argument("--keep-outputs", default=None,
                   help="copy every run's output folder here (default: deleted)")
    p.add_argument("--list", action="store_true", help="list the groups and exit")
    p.add_argument("--table", action="store_true",
                   help="run nothing: recompute every target from benchmarks/results/ and write "
                        "its row of docs/benchmarks.md's table")
    args = p.parse_args(argv)
    if args.quick and "--repeats" not in (argv if argv is not None else sys.argv):
        args.repeats = 1
    names = [ALIASES.get(n, n) for n in args.only.split(",")] if args.only else None
    unknown = sorted(set(names or ()) - set(GROUPS))
    if unknown:
        p.error(f"unknown group(s) {unknown}; choose from {sorted(GROUPS)}")
    args.groups = names or [n for n, g in GROUPS.items() if not g.opt_in]
    return args


def chosen(args: argparse.Namespace) -> dict[str, list[Variant]]:
    """The variants of each chosen group (``--impls``: those whose key ends with one of them;
    a group of runs left with none is dropped)."""
    groups = {n: GROUPS[n].variants(args.quick) for n in args.groups}
    if args.impls:
        keep = args.impls.split(",")
        groups = {n: [v for v in vs if any(v.key.endswith("/" + k) for k in keep)]
                  for n, vs in groups.items()}
        groups = {n: vs for n, vs in groups.items()
                  if vs or GROUPS[n].extra or GROUPS[n].probe}
    return groups


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.list:
        width = max(map(len, GROUPS))
        for n, g in GROUPS.items():
            print(f"{n:<{width}} {'opt-in ' if g.opt_in else ''}{g.title}\n{'':<{width}} "
                  f"{g.command()}")
        return 0
    if args.table:
        return table(args)
    groups = chosen(args)
    load = os.getloadavg()[0]
    if load > 1.0:
        print(f"warning: load average {load:.2f} on {common.cores()} cores: other work is "
              "running, the figures will be noisy", flush=True)
    folders: list[str | None] = []
    info: dict = {"extra": {}}
    t0 = time.time()
    try:
        for n, vs in groups.items():  # each group's data, deleted below even if one fails
            if GROUPS[n].prepare:
                folders.append(GROUPS[n].prepare(vs))
        checked = [what for n, vs in groups.items() for what in GROUPS[n].check(vs)]
        info["data_check"] = ("benchmark data identical to ddp_exp.data's for "
                              + ", ".join(dict.fromkeys(checked)) + "." if checked else "")
        print(info["data_check"] or "no hand-written script reads data in these groups.",
              flush=True)
        warm_up(args.timeout)
        repeats_of = {n: args.repeats if args.quick else max(args.repeats, GROUPS[n].min_repeats)
                      for n in groups}
        runs = {n: vs for n, vs in groups.items() if vs}
        rows, more = run_groups(runs, args.repeats, args.timeout, args.keep_outputs,
                                lambda s: print(s, flush=True), repeats_of=repeats_of)
    finally:
        for folder in folders:
            if folder:
                shutil.rmtree(folder, ignore_errors=True)
    info.update(more)
    probes_failed = []
    for n in groups:
        if GROUPS[n].probe:
            print(f"== {n}: measured by its probe", flush=True)
            try:
                rows += GROUPS[n].probe(args.quick, repeats_of[n], args.timeout)
            except ProbeFailed as exc:
                info["extra"][n] = [f"failed: {exc}"]
                probes_failed.append(n)
        if GROUPS[n].extra:
            print(f"== {n}: measured apart from the runs", flush=True)
            try:
                info["extra"][n] = GROUPS[n].extra(args.quick, args.timeout)
            except ProbeFailed as exc:
                info["extra"][n] = [f"failed: {exc}"]
                probes_failed.append(n)
    targets = [t for n, vs in groups.items() for t in GROUPS[n].targets()
               if t.keys <= {v.key for v in vs} | {r["variant"] for r in rows if r["group"] == n}]
    for t in targets:
        t.evaluate(rows)
    when = results.stamp()
    for r in rows:
        r.update(when)
    os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
    written = write_rows(rows, groups, args)
    report.write_markdown(args.markdown, rows, groups, targets, info, args, GROUPS)
    measured = not (args.quick or args.csv)
    lines = docs_rows(list(groups)) if measured and not args.no_docs else {}
    if lines:
        results.update_docs_table(lines)
        written.append(os.path.relpath(results.DOCS, common.ROOT))
    print(f"\n{len(rows)} runs in {time.time() - t0:.0f} s; wrote {', '.join(written)} and "
          f"{args.markdown}")
    for t in targets:
        ratio = f"{t.ratio:.3f}" if t.ratio is not None else "n/a"
        print(f"  {t.name:<30} {t.what:<70} {ratio:>7} ({t.bound_text}) {t.verdict}")
    for line in threads_check(rows):
        print(f"  threads  {line}")
    for n, lines in info["extra"].items():
        for line in lines:
            print(f"  {n}  {line}")
    failed = [r for r in rows if r["status"] in ("failed", "timeout")]
    if failed:
        print(f"{len(failed)} run(s) failed: see the note column of {', '.join(written)}")
    if probes_failed:
        print(f"the measurement apart from the runs failed in: {', '.join(probes_failed)}")
    return 1 if failed or probes_failed else 0


def docs_rows(names: list[str]) -> dict[str, str]:
    """docs/benchmarks.md's row of every target of the groups ``names`` that their results files
    can compute (``benchmarks/results/<group>.csv``: after a run, its rows and the variants it
    did not run), by target key."""
    lines = {}
    for n in names:
        rows = results.load_rows(n)
        for t in GROUPS[n].targets():
            t.evaluate(rows)
            if t.ratio is not None:
                when, runs = results.when_measured(rows, t)
                lines[t.name] = results.target_row(t, when, runs, GROUPS[n].command())
    return lines


def table(args: argparse.Namespace) -> int:
    """``--table``: every target of the chosen groups recomputed from its group's results file,
    its row written into docs/benchmarks.md (printed only, with ``--no-docs``)."""
    lines = docs_rows(args.groups)
    print("\n".join(lines.values()))
    if not args.no_docs:
        results.update_docs_table(lines)
    return 0


def write_rows(rows: list[dict], groups: dict[str, list[Variant]],
               args: argparse.Namespace) -> list[str]:
    """The rows into ``--csv``, ``outputs/bench/quick.csv`` (``--quick``) or each group's
    results file; returns the paths written."""
    if args.csv or args.quick:
        path = args.csv or os.path.join(OUT, "quick.csv")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        results.write_csv(rows, path)
        return [path]
    return [os.path.relpath(results.merge_group_csv(n, [r for r in rows if r["group"] == n]),
                            common.ROOT) for n in groups if any(r["group"] == n for r in rows)]


if __name__ == "__main__":
    raise SystemExit(main())
