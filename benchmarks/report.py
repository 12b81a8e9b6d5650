"""The report: one CSV row per run and the markdown page (machine, noise, targets with
PASS/MISS, one table per group, how each figure is measured, the hand-written analysis of the
misses from ``benchmarks/analysis.md``).

May use: ``common``, ``variants``, ``targets``, ``scaling`` and ``lm_group`` (their tables).
Used by ``run``.
"""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import os
import platform
import statistics

import common
import lm_group
import scaling
from targets import Target, extra_ratios, same_training, stat, threads_check
from variants import IMPL_LABELS, Variant

CSV_FIELDS = ["group", "variant", "impl", "workload", "world_size", "batch_size", "epochs",
              "repeat", "rc", "status", "samples_per_sec", "train_s", "wall_s",
              "wall_s_inside", "peak_rss_mib_per_rank", "peak_rss_mib_self_reported",
              "world_pss_mib", "ranks_seen", "threads_per_rank", "train_loss", "val_loss",
              "val_accuracy", "model_flops_per_sec", "loadavg_1m", "other_cpu_cores", "note"]


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


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


def write_markdown(path: str, rows: list[dict], groups: dict[str, list[Variant]],
                   targets: list[Target], info: dict, args) -> None:
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    md = ["# Benchmarks", ""]
    if args.quick:
        md += ["> **Quick smoke run** (`--quick`: 1 repeat, 1 epoch, 2,048 compute samples). "
               "These numbers only show that the suite runs; they are not a measurement. "
               "Run `make bench` on a quiet machine for the real tables.", ""]
    md += [f"Written by `benchmarks/run.py` ({'--quick' if args.quick else 'make bench'}) on "
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
    md += ["## Targets (issues 5, 11, 13, 29 and C17)", "",
           "Ratios of medians. `MISS by x%`: the ratio is x% short of (or over) the bound.", "",
           "| target | what | ratio | bound | result |", "|---|---|---|---|---|"]
    for t in targets:
        ratio = f"{t.ratio:.3f}" if t.ratio is not None else "n/a"
        md.append(f"| {t.name} | {t.what} | {ratio} | {t.op} {t.bound:g} | {t.verdict} |")
    if info.get("in_world"):
        md += ["", "I30 measured inside one world (`benchmarks/step_checkpoint_cost.py`; the "
               "pairs of runs above cannot resolve 3% on this machine):", ""]
        md += [f"- {line}" for line in info["in_world"]]
    skipped = sorted({r["note"] for r in rows if r["status"] == "skipped"})
    if skipped:
        md += ["", "Lightning Trainer: " + "; ".join(skipped) + " (`pip install -e \".[bench]\"`,"
               " which `make bench` tries); targets (b) are n/a."]
    checks = threads_check(rows)
    if checks:
        md += ["", "C17 threads per rank (`threads_per_rank` in metrics.json, OMP_NUM_THREADS "
               "unset):", ""] + [f"- {c}" for c in checks]
    same = same_training(rows, groups)
    if same:
        md += ["", "Same training (final validation loss, first repeat; ddp_exp, the hand-tuned, "
               "the tutorial and the image-folder scripts run the same steps on the same data, so "
               "these agree to float rounding; Lightning, not listed, pads the validation "
               "shards):", ""]
        md += [f"- {x}" for x in same]
    extra = extra_ratios(rows, groups)
    if extra:
        md += ["", "Other ratios (no target):", ""] + [f"- {e}" for e in extra]
    titles = {"digits": "Workload 1: digits (MLP 64-128-10, 32 per rank)",
              "compute": "Workload 2: compute-bound (synthetic 16,384 x 512, MLP 512-2048-2048-10,"
                         " 256 per rank)",
              "startup": "Workload 3: start-up (1-epoch digits job vs bare 2-rank launches; the "
                         "hand-tuned script's 1-epoch job for reference)",
              "c17": "C17: thread oversubscription (ddp_exp, digits, same global batch 64)",
              "perf": "perf/* dashboards: trainer.perf_metrics on and off (ddp_exp, digits)",
              "image_folder": "Issue 11: image folder (digits as 8x8 PNG files, Pillow, 2 "
                              "DataLoader workers per rank, model=cnn, 32 per rank)"}
    titles["scaling"] = "Scaling: how cost grows with the work (issue 13 point 3)"
    titles["memory"] = "Memory: the data's copies by world size (issue 13 point 3)"
    titles["lm"] = "Issue 29: a language model, ddp_exp against a nanoGPT-style loop"
    for name, variants in groups.items():
        md += ["", f"## {titles.get(name, name)}", ""]
        tables = {"scaling": scaling.table, "memory": scaling.memory_table,
                  "lm": lm_group.table}
        md += tables.get(name, group_table)(rows, variants)
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
           "- Image folder (issue 11): the runner writes the digits as 1,797 grey 8x8 PNG files "
           "into a temporary folder; ddp_exp runs `data=image_folder data.channels=1 "
           "data.val_size=297 data.num_workers=2 model=cnn`, the hand-written script "
           "(`benchmarks/ddp_image_folder.py`) a Pillow `Dataset` with `DataLoader(num_workers=2,"
           " persistent_workers=True)`, a `DistributedSampler` and torch's default collate. "
           "Checked at the start: the same training and validation files and decoded pixels, "
           "and the same initial CNN weights (seed 0). Both include the start of the loader's "
           "workers (first epoch) in the loop time.",
           "- Per-run data: `benchmarks/results.csv`."]
    if lm_group.GROUP in groups:
        md.insert(len(md) - 1, "- **train tokens/s** (group lm): ddp_exp's "
                  "`train/tokens_per_sec` of `metrics.json` (its samples/s: a window's every "
                  "token is a sample); the nanoGPT-style loop times rank 0's loop from before "
                  "its first batch to a barrier after its last step, the tokens of all ranks. "
                  "**model FLOP/s**: tokens/s x `GPT.flops_per_token()` (6N + 12 L d T, PaLM "
                  "appendix B; ddp_exp's `perf/model_flops_per_sec`). The ratio is of the "
                  "medians; the spread is that of the per-pair ratios (each repeat runs ddp_exp "
                  "then the loop).")
    if "scaling" in groups:
        md.insert(len(md) - 1, "- **world PSS** (group scaling): every second while a run is "
                  "alive the runner sums `Pss` from `/proc/<pid>/smaps_rollup` over the started "
                  "process and its children (the launcher and the ranks, multiprocessing's "
                  "helpers excluded); the figure is the largest sum. Shared pages count once "
                  "in the world, private ones fully (CSV column `world_pss_mib`).")
    misses = [t for t in targets if t.verdict.startswith("MISS")]
    analysis = os.path.join(common.BENCH, "analysis.md")
    if misses or os.path.exists(analysis):
        md += ["", "## Misses: why, and where the time goes", ""]
        md += [f"- {t.name} {t.what}: {t.ratio:.3f}, bound {t.op} {t.bound:g}: {t.verdict}"
               for t in misses]
        if os.path.exists(analysis):
            with open(analysis) as fh:
                md += ["", fh.read().rstrip()]
    with open(path, "w") as fh:
        fh.write("\n".join(md) + "\n")


def _median_other(rows: list[dict]) -> float:
    vals = [r["other_cpu_cores"] for r in rows if r.get("other_cpu_cores") is not None]
    return statistics.median(vals) if vals else float("nan")
