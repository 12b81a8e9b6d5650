"""``make bench``: ddp_exp side by side with hand-written DDP and Lightning (issue 5).

    python benchmarks/run.py                 # the suite: 5 interleaved repeats per variant
    python benchmarks/run.py --repeats 7
    python benchmarks/run.py --quick         # smoke test: 1 repeat, tiny epochs (not a measurement)
    python benchmarks/run.py --only digits,startup
    python benchmarks/run.py --only digits --impls defaults/ddp_exp,tight --repeats 10
    python benchmarks/run.py --only scaling --markdown benchmarks/scaling.md \
        --csv benchmarks/scaling.csv          # opt-in: not in the default set

Groups (each one interleaved: for every repeat, every variant of the group once, A B C A B C ...):

* ``digits``: MLP 64-128-10, 32 per rank, 20 epochs, world_size 1 and 2;
* ``compute``: synthetic 16,384 x 512, MLP 512-2048-2048-10, 256 per rank, 2 epochs, ws 1 and 2;
  Both also run (issue 13) ``ddp_exp`` with the default trainer keys (label ``defaults``:
  checkpoint, progress lines, config dump and the perf timer on) and the tight hand-written loop
  ``benchmarks/ddp_tight.py`` (the epoch's shard gathered once, one all-reduce per epoch);
* ``startup``: the 1-epoch digits ddp_exp job at world_size 2 against bare 2-rank launches that
  import torch and initialise gloo (``benchmarks/startup.py``), and the hand-written scripts'
  own 1-epoch jobs (hand-tuned, tight) with ddp_exp's default keys beside them;
* ``c17``: thread oversubscription (case C17): ddp_exp on digits, ``world_size=1`` with
  batch 64, ``world_size=2`` with 32, ``world_size=4`` with 16 (the same global batch);
* ``perf``: the cost of the ``perf/*`` dashboards (issue 14): ddp_exp on digits at world_size 2
  with ``trainer.perf_metrics=true`` and ``false``;
* ``step_checkpoint`` (issue 30): ddp_exp on digits at world_size 2 with
  ``trainer.checkpoint_every_n_steps=50`` against none (target: >= 0.97 of its samples/s);
* ``image_folder`` (issue 11): the digits as PNG files in a temporary folder made here,
  ``data=image_folder model=cnn`` with 2 DataLoader workers per rank against the hand-written
  Pillow + DataLoader + DDP script on the same files (``benchmarks/ddp_image_folder.py``), 32
  per rank, 5 epochs, world_size 2;
* ``scaling`` (issue 13 point 3, ``benchmarks/scaling.py``; only with ``--only``): ddp_exp on
  ``data=synthetic`` at world_size 1, 2 and 4, at 10x and 100x ``data.num_samples``, and with
  the MLP at 4x and 16x the parameters at world_size 1 and 2, with the world's PSS beside the
  data's size. Not in the default set: its 5 repeats take ~20 minutes on a quiet machine,
  most of it the 100x rows (10 epochs of 409,088 samples), which would make ``make bench``
  (~30 minutes) about 1.6 times as long.
* ``lm`` (issue 29, ``benchmarks/lm_group.py``): ``experiment=gpt_tokens`` (``model=gpt`` on the
  built-in corpus as a uint16 ``.bin``) against the nanoGPT-style loop
  ``benchmarks/nanogpt_loop.py`` (same model class, shapes, batch, optimizer, threads), tokens/s
  and model FLOP/s, world_size 1 and 2, at least 10 interleaved pairs (``--quick``:
  ``--repeats``): ``python benchmarks/run.py --only lm``;
* ``memory`` (``benchmarks/scaling.py``; only with ``--only``): world_size 1, 2 and 4 on the
  synthetic data at 1x (100 epochs) and 100x (1 epoch): the data's copies per world size (~3
  minutes per repeat).

Each run is one process started from here with ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS``
removed from its environment. Figures: training samples/s of the loop only (ddp_exp:
``metrics.json``; the scripts: their own result line), end-to-end wall seconds of the whole
process (timed here, from before the process is started until it has exited), and peak resident
memory per rank (``VmHWM`` of every rank process, read from ``/proc`` every 50 ms while it runs;
the maximum over ranks). Writes ``benchmarks/results.csv`` (one row per run) and
``docs/benchmarks.md`` (medians with min and max, the ratios of targets (a)-(e), I11 and C17,
PASS/MISS).

This module is the command line. May use: ``common``, ``variants`` (the groups and each run's
command), ``measure`` (one run -> one row; the groups interleaved), ``targets`` (medians,
ratios, PASS/MISS), ``scaling`` (that group's runs) and ``report`` (CSV and markdown);
``timed`` (one timed process) lies below ``measure``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import lm_group  # noqa: E402
import scaling  # noqa: E402
from measure import check_data, image_folder, run_groups, warm_up  # noqa: E402
from report import write_csv, write_markdown  # noqa: E402
from targets import build_targets, stat, threads_check  # noqa: E402
from variants import IMPL_LABELS, build_variants  # noqa: E402

OPT_IN = ("scaling", "memory")  # groups run only when --only names them


def compare_startup(repeats: int) -> int:
    """``startup.py --compare``: the 1-epoch job against the bare mp-fork launch only."""
    groups = {"startup": build_variants(quick=False)["startup"][:2]}
    rows, _ = run_groups(groups, repeats, 600.0, None)
    t = build_targets(groups)[0]
    t.evaluate(rows)
    for v in groups["startup"]:
        s = stat(rows, v.key, "wall_s")
        print(f"{IMPL_LABELS[v.impl]:<40} wall {s.fmt('.2f') if s else 'failed'} s")
    print(f"ratio {t.ratio:.3f} (target <= 1.3): {t.verdict}" if t.ratio else "ratio n/a")
    return 0


def step_checkpoint_in_world(quick: bool, timeout: float) -> list[str]:
    """Issue 30's cost measured inside one world (``benchmarks/step_checkpoint_cost.py``: the
    pairs of whole runs cannot resolve 3% on a machine whose speed drifts by +-20% between
    runs): the share of the blocks' time the checkpoints took (the loop's wait in them plus the
    writer thread's CPU), as the throughput kept against the bound 0.97, and the blocks'
    ratio. Lines for the report; one line saying why where the script failed."""
    import json
    import subprocess

    script = os.path.join(common.BENCH, "step_checkpoint_cost.py")
    argv = [sys.executable, script, "--rounds", "4" if quick else "40",
            "--epochs-per-block", "2" if quick else "4"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout).stdout
        r = json.loads(out.rsplit("BENCH_RESULT ", 1)[1])
    except (subprocess.TimeoutExpired, IndexError, ValueError) as exc:
        return [f"in one world: n/a ({type(exc).__name__})"]
    kept = 1.0 - r["direct_cost"]
    n = max(1, r["step_checkpoints"])
    cpu = (r["take_cpu_s"] + r["writer_cpu_s"]) / r["seconds"]["every-50"]
    return [f"in one world ({n} step checkpoints, blocks of {r['epochs_per_block']} epochs "
            f"alternated {r['rounds']} times): throughput kept {kept:.3f} (bound >= 0.97: "
            f"{'PASS' if kept >= 0.97 else 'MISS'}); per checkpoint the loop waits "
            f"{1000 * r['take_s'] / n:.2f} ms (its CPU {1000 * r['take_cpu_s'] / n:.2f} ms) and "
            f"the writer thread uses {1000 * r['writer_cpu_s'] / n:.2f} ms of CPU; CPU share "
            f"{100 * cpu:.2f}%; the blocks' ratio (with / without) {r['ratio']:.3f}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="interleaved runs per variant")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 1 repeat, 1 epoch, small compute set")
    p.add_argument("--only", default=None,
                   help="comma-separated groups: digits,compute,startup,c17,perf,step_checkpoint,"
                        "image_folder,lm (the default set); scaling and memory only when named")
    p.add_argument("--impls", default=None,
                   help="comma-separated variants to keep in the chosen groups, by key suffix: "
                        "e.g. 'defaults/ddp_exp,tight' (default: all)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--csv", default=os.path.join(common.BENCH, "results.csv"))
    p.add_argument("--markdown", default=os.path.join(common.ROOT, "docs", "benchmarks.md"))
    p.add_argument("--keep-outputs", default=None,
                   help="copy every run's output folder here (default: deleted)")
    args = p.parse_args(argv)
    if args.quick and "--repeats" not in (argv if argv is not None else sys.argv):
        args.repeats = 1
    groups = build_variants(args.quick)
    groups["scaling"] = scaling.variants(args.quick)
    groups["memory"] = scaling.memory_variants(args.quick)
    groups["lm"] = lm_group.variants(args.quick)
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - set(groups)
        if unknown:
            p.error(f"unknown group(s) {sorted(unknown)}; choose from {sorted(groups)}")
        groups = {g: groups[g] for g in wanted}
    else:
        groups = {g: vs for g, vs in groups.items() if g not in OPT_IN}
    if args.impls:
        keep = args.impls.split(",")
        groups = {g: [v for v in vs if any(v.key.endswith("/" + k) for k in keep)]
                  for g, vs in groups.items()}
        groups = {g: vs for g, vs in groups.items() if vs}
    load = os.getloadavg()[0]
    if load > 1.0:
        print(f"warning: load average {load:.2f} on {common.cores()} cores: other work is "
              "running, the figures will be noisy", flush=True)
    images, corpus = image_folder(groups), lm_group.prepare(groups)
    try:
        info = {"data_check": check_data(groups)}
        print(info["data_check"], flush=True)
        warm_up(args.timeout)
        t0 = time.time()
        pairs = args.repeats if args.quick else max(args.repeats, lm_group.PAIRS)
        rows, more = run_groups(groups, args.repeats, args.timeout, args.keep_outputs,
                                log=lambda s: print(s, flush=True),
                                repeats_of={lm_group.GROUP: pairs})
    finally:
        for folder in (images, corpus):
            if folder:
                shutil.rmtree(folder, ignore_errors=True)
    info.update(more)
    if "step_checkpoint" in groups:
        info["in_world"] = step_checkpoint_in_world(args.quick, args.timeout)
    targets = build_targets(groups) + lm_group.targets(groups)
    for t in targets:
        t.evaluate(rows)
    write_csv(rows, args.csv)
    write_markdown(args.markdown, rows, groups, targets, info, args)
    print(f"\n{len(rows)} runs in {time.time() - t0:.0f} s; wrote {args.csv} and "
          f"{args.markdown}")
    for t in targets:
        ratio = f"{t.ratio:.3f}" if t.ratio is not None else "n/a"
        print(f"  {t.name:<4} {t.what:<62} {ratio:>7} ({t.op} {t.bound:g}) {t.verdict}")
    for line in threads_check(rows):
        print(f"  C17  {line}")
    if lm_group.GROUP in groups:
        for ws in lm_group.WORLD_SIZES:
            print(f"  I29  {lm_group.ratio_line(rows, ws)}")
    for line in info.get("in_world", []):
        print(f"  I30  {line}")
    failed = [r for r in rows if r["status"] in ("failed", "timeout")]
    if failed:
        print(f"{len(failed)} run(s) failed: see the note column of {args.csv}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
