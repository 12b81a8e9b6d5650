"""A run's report, as markdown: the machine and its noise, the targets with PASS/MISS, the thread
rule, the same-training check, other ratios, one section per group (its own table or one row
per variant), the lines of measurements taken apart from the runs (``Group.extra``), and how
each figure is measured. ``make bench`` writes it to ``outputs/bench/report.md``; the rows of
its targets also go into docs/benchmarks.md (``results.update_docs_table``).

May use: ``benchmarks.common``, ``group``, ``stats``, ``variant``.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import statistics

from benchmarks import common
from benchmarks.harness.group import Group
from benchmarks.harness.stats import Target, stat, threads_check
from benchmarks.harness.variant import IMPL_LABELS, Variant

SAME_STEPS = ("ddp_exp", "tuned", "tight", "tutorial", "tutorial-1t", "handwritten")


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def group_table(rows: list[dict], variants: list[Variant]) -> list[str]:
    out = ["| variant | ws | batch/rank | epochs | train samples/s | wall s | peak RSS/rank MiB "
           "| threads/rank | val loss | other cores busy | runs |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in variants:
        mine = [r for r in rows if r["variant"] == v.key]
        ok = [r for r in mine if r["status"] == "ok"]
        label = IMPL_LABELS[v.impl] + (f" ({v.label})" if v.label else "")
        if v.skipped and not ok:
            out.append(f"| {label} | {v.world_size} | | | {v.skipped} | | | | | | 0 |")
            continue
        if not ok:
            why = mine[-1]["note"] if mine else "not run"
            out.append(f"| {label} | {v.world_size} | | | failed: {why} | | | | | | 0 |")
            continue
        s = {f: stat(rows, v.key, f) for f in ("samples_per_sec", "wall_s",
                                                "peak_rss_mib_per_rank", "val_loss",
                                                "other_cpu_cores")}
        threads = sorted({r.get("threads_per_rank") for r in ok} - {None})
        cells = [label, str(v.world_size), str(v.batch_size),
                 str(v.epochs) if not v.impl.startswith("bare") else "-",
                 s["samples_per_sec"].fmt(",.0f") if s["samples_per_sec"] else "-",
                 s["wall_s"].fmt(".2f") if s["wall_s"] else "-",
                 s["peak_rss_mib_per_rank"].fmt(".0f") if s["peak_rss_mib_per_rank"] else "-",
                 ",".join(map(str, threads)) or "-",
                 f"{s['val_loss'].median:.4f}" if s["val_loss"] else "-",
                 s["other_cpu_cores"].fmt(".2f") if s["other_cpu_cores"] else "-",
                 f"{len(ok)}/{len(mine)}"]
        out.append("| " + " | ".join(cells) + " |")
    return out


FIGURES = ("samples_per_sec", "ratio", "wall_s", "first_line_s", "peak_rss_mib_per_rank",
           "state_mib_per_rank")


def probe_table(rows: list[dict]) -> list[str]:
    """One line per variant key of a group's ``probe`` rows: the median (min-max) of each
    figure of :data:`FIGURES` the rows hold, and the runs that succeeded."""
    keys = list(dict.fromkeys(r["variant"] for r in rows))
    shown = [f for f in FIGURES if any(r.get(f) is not None for r in rows)]
    out = ["| variant | " + " | ".join(shown) + " | runs |", "|---" * (len(shown) + 2) + "|"]
    for key in keys:
        cells = [(s.fmt(",.2f") if (s := stat(rows, key, f)) else "-") for f in shown]
        ok = sum(r["variant"] == key and r["status"] == "ok" for r in rows)
        total = sum(r["variant"] == key for r in rows)
        out.append(f"| {key} | " + " | ".join(cells) + f" | {ok}/{total} |")
    return out


def same_training(rows: list[dict], groups: dict[str, list[Variant]]) -> list[str]:
    """Per group and world size, the final validation loss of the first repeat of every
    implementation that trains the same steps on the same data (:data:`SAME_STEPS`), and
    whether they agree to float rounding (spread < 1e-4)."""
    out = []
    for name in groups:
        for ws in sorted({r["world_size"] for r in rows if r["group"] == name}):
            vals = {r["variant"].split("/", 2)[2]: r["val_loss"] for r in rows
                    if r["group"] == name and r["world_size"] == ws and r["status"] == "ok"
                    and r["repeat"] == 0 and r.get("val_loss") is not None
                    and r["impl"] in SAME_STEPS}
            if len({k.rsplit("/", 1)[-1] for k in vals}) > 1:
                spread = max(vals.values()) - min(vals.values())
                out.append(f"{name}, ws={ws}: " + ", ".join(f"{k} {v:.6f}" for k, v in vals.items())
                           + f" (spread {spread:.1e}: {'same' if spread < 1e-4 else 'DIFFERENT'})")
    return out


def extra_ratios(rows: list[dict], ratios: list[tuple[str, str, str, str]]) -> list[str]:
    """``what: num / den`` of the medians of each ``(num, den, field, what)`` both of whose
    variants ran."""
    out = []
    for num, den, f, what in ratios:
        a, b = stat(rows, num, f), stat(rows, den, f)
        if a and b and b.median:
            out.append(f"{what}: {a.median / b.median:.3f}")
    return out


def write_markdown(path: str, rows: list[dict], groups: dict[str, list[Variant]],
                   targets: list[Target], info: dict, args,
                   defs: dict[str, Group] | None = None) -> None:
    """The report of a run of ``groups`` (name -> the variants that ran; ``defs``: the groups'
    definitions, for their titles, tables, ratios and notes) to ``path``."""
    defs = defs or {}
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = ["# Benchmarks", ""]
    if args.quick:
        md += ["> **Quick smoke run** (`--quick`: 1 repeat, 1 epoch, 2,048 compute samples). "
               "These numbers only show that the suite runs; they are not a measurement. "
               "Run `make bench` on a quiet machine for the real tables.", ""]
    md += [f"Written by `python -m benchmarks` ({'--quick' if args.quick else 'make bench'}) on "
           f"{now}: {args.repeats} interleaved repeat(s) per variant; medians with (min-max) "
           "over the repeats.", "",
           f"Machine: {common.cores()} usable cores, {platform.platform()}, Python "
           f"{platform.python_version()}, torch {_version('torch')}, lightning "
           f"{_version('lightning')}. `OMP_NUM_THREADS`/`MKL_NUM_THREADS` removed from every "
           "run's environment. Load average (1 min) at the start and end of each group: "
           + ", ".join(f"{g} {v[0]:.2f} -> {v[-1]:.2f}" for g, v in info["load"].items())
           + ".", "",
           "Noise: every run also records how many cores *other* processes kept busy while it "
           "ran (all busy CPU time from `/proc/stat` minus the run's own from `wait4`, over its "
           "wall time; column `other cores busy`). Median over all runs: "
           f"{_median_other(rows):.2f} cores of {common.cores()}. On this 2-core machine a rank "
           "with 2 intra-op threads (world_size 1) is slowed down up to 100x when anything else "
           "runs (OpenMP waits for a descheduled thread at every parallel region): trust a "
           "table only where that column is near 0.", ""]
    if info.get("data_check"):
        md += [f"Data: {info['data_check']}", ""]
    md += ["## Targets", "",
           "Ratios of medians. `MISS by x%`: the ratio is x% short of (or over) the bound.", "",
           "| target | what | ratio | bound | result |", "|---|---|---|---|---|"]
    for t in targets:
        ratio = f"{t.ratio:.3f}" if t.ratio is not None else "n/a"
        md.append(f"| `{t.name}` | {t.what} | {ratio} | {t.bound_text} | {t.verdict} |")
    for name, lines in info.get("extra", {}).items():
        md += ["", f"{name}, measured apart from the interleaved runs:", ""]
        md += [f"- {line}" for line in lines]
    skipped = sorted({r["note"] for r in rows if r["status"] == "skipped"})
    if skipped:
        md += ["", "Lightning Trainer: " + "; ".join(skipped) + " (`pip install -e \".[bench]\"`,"
               " which `make bench` tries); its targets are n/a."]
    checks = threads_check(rows)
    if checks:
        md += ["", "Threads per rank (`threads_per_rank` in metrics.json, OMP_NUM_THREADS "
               "unset; case C17):", ""] + [f"- {c}" for c in checks]
    same = same_training(rows, groups)
    if same:
        md += ["", "Same training (final validation loss, first repeat; ddp_exp, the hand-tuned, "
               "the tutorial and the image-folder scripts run the same steps on the same data, so "
               "these agree to float rounding; Lightning, not listed, pads the validation "
               "shards):", ""]
        md += [f"- {x}" for x in same]
    extra = extra_ratios(rows, [r for g in groups if g in defs for r in defs[g].ratios])
    if extra:
        md += ["", "Other ratios (no target):", ""] + [f"- {e}" for e in extra]
    for name, variants in groups.items():
        g = defs.get(name)
        probed = [r for r in rows if r["group"] == name] if not variants else []
        if not variants and not probed:
            continue
        md += ["", f"## {g.title if g else name}", ""]
        if g and g.table:
            md += g.table(rows, variants)
        else:
            md += group_table(rows, variants) if variants else probe_table(probed)
    md += ["", "## How each figure is measured", "",
           "- **train samples/s**: training loop only, all ranks together. ddp_exp: "
           "`train/samples_per_sec` of `metrics.json` (samples of all ranks / rank 0's seconds in "
           "the training loop, validation excluded). The scripts measure the same way: "
           "`time.perf_counter()` around each epoch's loop on rank 0 (the hand-tuned script "
           "includes building the epoch's index tensor, as ddp_exp does), samples all-reduced; "
           "Lightning: a callback from `on_train_epoch_start` to the last `on_train_batch_end`.",
           "- **wall s**: the whole process, timed by the runner from just before `Popen` to "
           "its exit (interpreter start, imports, data, launch, training, validation, writing "
           "outputs). Each script also reports its own wall time from its first line, ddp_exp "
           "its `time/total_s` (CSV column `wall_s_inside`).",
           "- **peak RSS/rank**: while a run is alive the runner lists the started process's "
           "children (`/proc/<pid>/task/*/children`) every 50 ms and reads each one's `VmHWM` (the "
           "kernel's high-water mark of resident memory, so only growth in a process's last "
           "50 ms can be missed); the ranks are the children of the started process (for "
           "Lightning, whose launcher makes the first process rank 0, the process too; never "
           "the ranks' own DataLoader workers), "
           "multiprocessing's resource tracker excluded; the figure is the largest rank. "
           "Forked ranks count the pages they share with their parent, as `ru_maxrss` does. "
           "The scripts also report `getrusage(RUSAGE_SELF).ru_maxrss` of each rank, "
           "max-reduced (CSV column `peak_rss_mib_self_reported`), as a cross-check.",
           "- Same model (seeded MLP), data (ddp_exp's arrays: `benchmarks/workloads.py`, "
           "checked equal to `ddp_exp.data` at the start), optimizer (SGD lr 0.05, momentum "
           "0.9), sampler (`DistributedSampler`, seed 0), per-rank batch and epochs everywhere; "
           "ddp_exp runs with `trainer.save_last=false print_config=false "
           "trainer.progress=off`. The tutorial script uses `mp.spawn`, the hand-tuned one fork "
           "with the data loaded once in the parent, Lightning its own subprocess launcher.",
           "- Per-run data: `benchmarks/results/<group>.csv` (the latest rows of each "
           "variant) or the `--csv` file."]
    md += [f"- {note}" for name in groups if name in defs for note in defs[name].notes]
    md += ["", "What each target's misses were traced to: docs/benchmarks.md."]
    with open(path, "w") as fh:
        fh.write("\n".join(md) + "\n")


def _median_other(rows: list[dict]) -> float:
    vals = [r["other_cpu_cores"] for r in rows if r.get("other_cpu_cores") is not None]
    return statistics.median(vals) if vals else float("nan")
