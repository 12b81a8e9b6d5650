"""The ``digits`` and ``compute`` groups (issues 5 and 13): ddp_exp against hand-written DDP
(the hand-tuned, tight and tutorial scripts of ``benchmarks/baselines/``) and Lightning's
Trainer, on the same data, model, optimizer, sampler, per-rank batch and epochs.

* ``digits``: MLP 64-128-10, 32 per rank, 20 epochs, world_size 1 and 2;
* ``compute``: synthetic 16,384 x 512, MLP 512-2048-2048-10, 256 per rank, 2 epochs, ws 1
  and 2.

Both also run ddp_exp with the default trainer keys (label ``defaults``: checkpoint, progress
lines, config dump and the perf timer on) against the tight hand-written loop
(``baselines/ddp_tight.py``: the epoch's shard gathered once, one all-reduce per epoch): what a
user runs against the tightest loop (issue 13; issue 42 asks >= 0.97 of it on digits at ws=2).

May use: ``benchmarks.workloads``, ``benchmarks.harness``.
"""

from __future__ import annotations

from benchmarks import workloads
from benchmarks.harness.group import Group
from benchmarks.harness.stats import Target
from benchmarks.harness.variant import Variant

WORLD_SIZES = (1, 2)
QUICK_COMPUTE_SAMPLES = 2048


def variants(workload: str, quick: bool) -> list[Variant]:
    """Per world size: ddp_exp, the hand-tuned and tutorial scripts (at ws 2 also with one
    thread per rank), Lightning, then ddp_exp with its default keys and the tight script
    (``quick``: 1 epoch, 2,048 compute samples)."""
    w = workloads.spec(workload)
    epochs = 1 if quick else w["epochs"]
    num_train = QUICK_COMPUTE_SAMPLES if quick and workload == "compute" else None
    vs = []
    for ws in WORLD_SIZES:
        impls = ["ddp_exp", "tuned", "tutorial"] + (["tutorial-1t"] if ws > 1 else []) + [
            "lightning"]
        vs += [Variant(workload, impl, workload, ws, w["batch_size"], epochs, num_train,
                       tree=impl == "lightning") for impl in impls]
        vs += [Variant(workload, "ddp_exp", workload, ws, w["batch_size"], epochs, num_train,
                       label="defaults", user_defaults=True),
               Variant(workload, "tight", workload, ws, w["batch_size"], epochs, num_train)]
    return vs


def targets(wl: str) -> list[Target]:
    """Against the hand-tuned script (samples/s >= 0.97, peak RSS per rank <= 1.2), the default
    keys against the tight script (>= 0.97); digits: against Lightning (samples/s >= 2, wall
    <= 0.5); compute: ws=2 / ws=1 samples/s >= 0.95."""
    sps, wall, rss = "samples_per_sec", "wall_s", "peak_rss_mib_per_rank"
    t = []
    for ws in WORLD_SIZES:
        t.append(Target(f"{wl}.ws{ws}.vs_tuned", f"{wl}, ws={ws}: ddp_exp / hand-tuned script, "
                        "samples/s", f"{wl}/ws{ws}/ddp_exp", f"{wl}/ws{ws}/tuned", sps, ">=",
                        0.97))
        t.append(Target(f"{wl}.ws{ws}.vs_tight", f"{wl}, ws={ws}: ddp_exp (default keys) / "
                        "tight script, samples/s", f"{wl}/ws{ws}/defaults/ddp_exp",
                        f"{wl}/ws{ws}/tight", sps, ">=", 0.97))
    if wl == "digits":
        t.append(Target("digits.ws2.vs_lightning", "digits, ws=2: ddp_exp / Lightning, "
                        "samples/s", "digits/ws2/ddp_exp", "digits/ws2/lightning", sps, ">=",
                        2.0))
        t.append(Target("digits.ws2.vs_lightning_wall", "digits, ws=2: ddp_exp / Lightning, "
                        "wall s", "digits/ws2/ddp_exp", "digits/ws2/lightning", wall, "<=", 0.5))
    else:
        t.append(Target("compute.ws2_vs_ws1", "compute: ddp_exp ws=2 / ws=1, samples/s",
                        "compute/ws2/ddp_exp", "compute/ws1/ddp_exp", sps, ">=", 0.95))
    for ws in WORLD_SIZES:
        t.append(Target(f"{wl}.ws{ws}.rss_vs_tuned", f"{wl}, ws={ws}: ddp_exp / hand-tuned "
                        "script, peak RSS per rank", f"{wl}/ws{ws}/ddp_exp", f"{wl}/ws{ws}/tuned",
                        rss, "<=", 1.2))
    return t


def _ratios(wl: str) -> tuple[tuple[str, str, str, str], ...]:
    out = ((f"{wl}/ws2/tutorial-1t", f"{wl}/ws2/tutorial", "samples_per_sec",
            f"{wl} ws=2, tutorial: 1 thread/rank vs default threads, samples/s"),)
    if wl == "digits":
        out += (("digits/ws2/ddp_exp", "digits/ws2/tuned", "wall_s",
                 "digits ws=2: ddp_exp / hand-tuned, wall s"),)
    return out


DIGITS = Group("digits", "Digits (MLP 64-128-10, 32 per rank): ddp_exp against hand-written DDP "
               "and Lightning", lambda quick: variants("digits", quick),
               lambda: targets("digits"), ratios=_ratios("digits"))
COMPUTE = Group("compute", "Compute-bound (synthetic 16,384 x 512, MLP 512-2048-2048-10, 256 per "
                "rank): ddp_exp against hand-written DDP and Lightning",
                lambda quick: variants("compute", quick), lambda: targets("compute"),
                ratios=_ratios("compute"))
