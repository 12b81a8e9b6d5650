"""One measured run of a variant -> one row (the CSV's columns), and the groups run interleaved
(for every repeat, every variant of a group once: A B C A B C ...); also what the runs need
first: the check that the scripts' arrays are ddp_exp's, and an untimed warm-up.

May use: ``benchmarks.common``, ``benchmarks.workloads``, ``variant``, ``timed``. Used by the
command line (``benchmarks/__main__.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from benchmarks import common, workloads
from benchmarks.harness.timed import timed_process
from benchmarks.harness.variant import PY, Variant


def measure(v: Variant, repeat: int, timeout_s: float, keep: str | None) -> dict:
    row = {"group": v.group, "variant": v.key, "impl": v.impl, "workload": v.workload,
           "world_size": v.world_size, "batch_size": v.batch_size, "epochs": v.epochs,
           "repeat": repeat, "loadavg_1m": round(os.getloadavg()[0], 2), "note": ""}
    workdir = tempfile.mkdtemp(prefix="ddp_exp-bench-")
    try:
        run = timed_process(v.argv(workdir), v.tree, timeout_s, pss_poll_s=v.world_pss)
        row.update(rc=run.rc, wall_s=run.wall_s, ranks_seen=len(run.rank_rss_mib),
                   other_cpu_cores=run.other_cpu, world_pss_mib=run.world_pss_mib,
                   peak_rss_mib_per_rank=max(run.rank_rss_mib) if run.rank_rss_mib else None)
        if run.rc == common.EXIT_SKIPPED and v.impl == "lightning":
            row.update(status="skipped", note="skipped: install the bench extra")
            return row
        if run.rc != 0:
            tail = (run.stderr.strip().splitlines() or run.stdout.strip().splitlines() or [""])
            row.update(status="timeout" if run.timed_out else "failed", note=tail[-1][:300])
            return row
        row["status"] = "ok"
        try:
            _read_result(v, workdir, row)
        except (OSError, ValueError) as exc:
            row.update(status="failed", note=f"no result: {exc}"[:300])
            return row
        if row["ranks_seen"] != v.world_size:
            row["note"] = (f"RSS sampled from {row['ranks_seen']} rank process(es), "
                           f"not {v.world_size}")
        return row
    finally:
        if keep:
            dest = os.path.join(keep, v.key.replace("/", "_") + f"_r{repeat}")
            shutil.copytree(workdir, dest, dirs_exist_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)


def _rate_with_warmup(m: dict) -> float | None:
    """ddp_exp's rate over every step, as the hand-written scripts time theirs: metrics.json's
    rates leave the first step out (``perf/warmup_s``; docs/metrics-and-tensorboard.md), so its
    global batch (in tokens for token data) and seconds are put back."""
    rate = m.get("train/tokens_per_sec", m.get("train/samples_per_sec"))
    warm_s, train_s = m.get("perf/warmup_s"), m.get("time/train_s")
    if rate is None or not warm_s or not train_s:
        return rate
    per_sample = (m["train/num_tokens"] / m["train/num_samples"]
                  if "train/num_tokens" in m and m.get("train/num_samples") else 1)
    return (rate * train_s + m["global_batch_size"] * per_sample) / (train_s + warm_s)


def _read_result(v: Variant, workdir: str, row: dict) -> None:
    """ddp_exp's metrics.json or a script's result file into ``row``."""
    if v.impl == "ddp_exp":
        with open(os.path.join(workdir, "job", "metrics.json")) as fh:
            m = json.load(fh)
        # Token data: a token is the sample the lm group compares (metrics.json's
        # train/samples_per_sec counts windows there).
        row.update(samples_per_sec=_rate_with_warmup(m),
                   train_s=m.get("time/train_s"), wall_s_inside=m.get("time/total_s"),
                   threads_per_rank=m.get("threads_per_rank"),
                   train_loss=m.get("train/epoch_loss"), val_loss=m.get("val/loss"),
                   val_accuracy=m.get("val/accuracy"),
                   model_flops_per_sec=m.get("perf/model_flops_per_sec"),
                   state_mib_per_rank=m.get("perf/state_mb_per_rank"),
                   peak_rss_mib_self_reported=m.get("perf/max_rss_mb"),
                   steady_rss_mib_self_reported=m.get("perf/rss_mb"))
    else:
        with open(os.path.join(workdir, "result.json")) as fh:
            r = json.load(fh)
        row.update(samples_per_sec=r.get("samples_per_sec"), train_s=r.get("train_s"),
                   wall_s_inside=r.get("wall_s"), threads_per_rank=r.get("threads_per_rank"),
                   peak_rss_mib_self_reported=r.get("peak_rss_mib_per_rank"),
                   train_loss=r.get("train_loss"), val_loss=r.get("val_loss"),
                   val_accuracy=r.get("val_accuracy"),
                   model_flops_per_sec=r.get("model_flops_per_sec"))


def run_groups(groups: dict[str, list[Variant]], repeats: int, timeout_s: float,
               keep: str | None, log=print, repeats_of: dict[str, int] | None = None
               ) -> tuple[list[dict], dict]:
    """Every group's variants interleaved, ``repeats`` times (``repeats_of``: a group's own
    count instead); returns the rows and the load averages per group."""
    rows: list[dict] = []
    info: dict = {"load": {}}
    for name, variants in groups.items():
        reps = (repeats_of or {}).get(name, repeats)
        info["load"][name] = [round(x, 2) for x in os.getloadavg()]
        log(f"== {name}: {len(variants)} variants x {reps} repeat(s), interleaved "
            f"(load average {info['load'][name][0]:.2f})")
        for rep in range(reps):
            for v in variants:
                if v.skipped:
                    continue
                row = measure(v, rep, timeout_s, keep)
                rows.append(row)
                if row["status"] == "skipped":
                    for other in (o for g in groups.values() for o in g if o.impl == v.impl):
                        other.skipped = row["note"]
                log(_progress_line(row))
        info["load"][name].append(round(os.getloadavg()[0], 2))
    return rows, info


def _progress_line(row: dict) -> str:
    parts = [f"  [{row['repeat']}] {row['variant']:<34} {row['status']:<8}"]
    if row.get("samples_per_sec") is not None:
        parts.append(f"{row['samples_per_sec']:>10,.0f} samples/s")
    if row.get("wall_s") is not None:
        parts.append(f"wall {row['wall_s']:6.2f} s")
    if row.get("peak_rss_mib_per_rank") is not None:
        parts.append(f"rss/rank {row['peak_rss_mib_per_rank']:6.0f} MiB")
    if row.get("other_cpu_cores") is not None:
        parts.append(f"others {row['other_cpu_cores']:.2f} cores")
    if row.get("note"):
        parts.append(f"({row['note']})")
    return "  ".join(parts)




def warm_up(timeout_s: float) -> None:
    """One untimed process that imports what the runs import, so the first measured run does
    not pay for a cold page cache."""
    code = ("import torch, torch.distributed, torch.nn.parallel, torch._dynamo, hydra, omegaconf,"
            " torch.utils.tensorboard, ddp_exp.cli.main\n"
            "try:\n    import lightning\nexcept ImportError:\n    pass\n")
    timed_process([PY, "-c", code], False, timeout_s)


def check_arrays(variants: list[Variant]) -> list[str]:
    """Raise AssertionError unless the arrays the hand-written scripts load
    (``workloads.load``) are ddp_exp's for every in-memory workload (digits, compute) of
    ``variants``; returns the workloads checked. A group with other data checks it itself
    (``Group.check``)."""
    done = []
    for wl, num_train in sorted({(v.workload, v.num_train) for v in variants
                                 if v.workload in ("digits", "compute")}, key=str):
        workloads.check_against_ddp_exp(wl, num_train)
        done.append(wl + (f" (num_train {num_train})" if num_train else ""))
    return done
