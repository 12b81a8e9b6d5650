"""The ``lm`` group (issue 29): ddp_exp's language-model training throughput against a plain
nanoGPT-style loop.

ddp_exp runs ``experiment=gpt_tokens`` with ``data.path`` the built-in corpus written as a
``.bin`` of uint16 tokens (nanoGPT's format; :func:`prepare`), ``model=gpt`` at the workload's
shapes (``workloads.spec("lm")``: 2 layers, width 128, 4 heads, context 128, 16 windows per
rank), one epoch cut at ``trainer.max_steps`` steps, validation capped; the baseline is
``benchmarks/baselines/nanogpt_loop.py`` on the same file: the same model class, optimizer settings,
clipping, per-rank batch, steps and intra-op threads, no framework. World size 1 and 2 (gloo).

Figures: training tokens/s of the loop only (ddp_exp: ``train/tokens_per_sec`` of
``metrics.json`` (its ``train/samples_per_sec`` counts windows); the loop: its result
line), the model FLOP/s of both (tokens/s x ``GPT.flops_per_token()``: ``perf/model_flops_per_sec``
and the loop's ``model_flops_per_sec``), wall seconds, peak RSS per rank. The runs are
interleaved pairs (ddp_exp, loop) per world size, at least :data:`PAIRS` of them (``--quick``:
as many as ``--repeats``); the target is the ratio of the medians (>= 0.95), reported with the
spread of the per-pair ratios (min, max).

    make bench ARGS="--only lm"                      # the measurement: 10 pairs
    make bench ARGS="--only lm --quick --repeats 2"  # a smoke test

May use: ``benchmarks.workloads``, ``benchmarks.harness``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from dataclasses import dataclass

from benchmarks import workloads
from benchmarks.harness.group import Group
from benchmarks.harness.stats import Target, stat
from benchmarks.harness.variant import PY, Variant, script

GROUP = "lm"
PAIRS = 10  # interleaved (ddp_exp, loop) pairs per world size, at least
WORLD_SIZES = (1, 2)
BOUND = 0.95  # ddp_exp / loop, tokens/s (ratio of medians)
QUICK_STEPS, QUICK_VAL_BATCHES = 6, 1
CORPUS_FILE = "pydoc_topics_uint16.bin"
LABELS = {"ddp_exp": "ddp_exp (experiment=gpt_tokens)", "nanogpt": "nanoGPT-style loop"}


@dataclass
class LmVariant(Variant):
    """A run of the group; ``val_start`` (ddp_exp's held-out tail of the file: the first
    validation window, the loop's training windows before it) is set by :func:`prepare`."""

    steps: int = 0
    val_batches: int = 0
    val_start: int = 0

    def argv(self, workdir: str) -> list[str]:
        if self.impl == "ddp_exp":
            return [PY, "-m", "ddp_exp", *ddp_exp_overrides(self), f"hydra.run.dir={workdir}/job"]
        return [*script("nanogpt_loop"), "--data", str(self.data_path), "--val-start",
                str(self.val_start), "--world-size", str(self.world_size), "--steps",
                str(self.steps), "--val-batches", str(self.val_batches),
                "--out", f"{workdir}/result.json"]


def variants(quick: bool) -> list[LmVariant]:
    """Per world size, ddp_exp then the loop (the order they are interleaved in)."""
    w = workloads.spec(GROUP)
    steps = QUICK_STEPS if quick else w["steps"]
    val_batches = QUICK_VAL_BATCHES if quick else w["limit_val_batches"]
    return [LmVariant(GROUP, impl, GROUP, ws, w["batch_size"], 1, steps=steps,
                      val_batches=val_batches)
            for ws in WORLD_SIZES for impl in ("ddp_exp", "nanogpt")]


def ddp_exp_overrides(v: LmVariant) -> list[str]:
    """The ddp_exp job of ``v``: the preset at the workload's settings on the ``.bin``, no
    checkpoint, config dump or progress lines (as the other groups' ddp_exp runs)."""
    w = workloads.spec(GROUP)
    return ["experiment=gpt_tokens", f"world_size={v.world_size}", "backend=gloo",
            f"seed={workloads.SEED}", f"data.path={v.data_path}", "data.dtype=uint16",
            f"data.vocab_size={w['vocab_size']}", f"data.block_size={w['block_size']}",
            f"data.batch_size={v.batch_size}", f"model.n_layer={w['n_layer']}",
            f"model.n_head={w['n_head']}", f"model.n_embd={w['n_embd']}", "model.dropout=0.0",
            f"optim.lr={w['lr']}", f"optim.weight_decay={w['weight_decay']}",
            f"scheduler.warmup_steps={workloads.lm_warmup_steps(v.steps)}",
            f"scheduler.min_lr={w['min_lr']}",
            f"trainer.gradient_clip_val={w['grad_clip']}", "trainer.epochs=1",
            f"trainer.max_steps={v.steps}", f"trainer.limit_val_batches={v.val_batches}",
            f"trainer.log_every_n_steps={workloads.LOG_EVERY_N_STEPS}",
            "trainer.save_last=false", "print_config=false", "trainer.progress=off"]


def write_corpus(folder: str) -> str:
    """The built-in corpus (ddp_exp's ``data=tokens`` with no path: the standard library's
    ``pydoc_data.topics`` as UTF-8 bytes) as a ``.bin`` of uint16 tokens in ``folder``."""
    from ddp_exp.data.tokens import builtin_corpus

    path = os.path.join(folder, CORPUS_FILE)
    builtin_corpus().astype("uint16").tofile(path)
    return path


def val_start_of(path: str) -> int:
    """Where ddp_exp's held-out tail of the file starts (``data.val_size: null``): its first
    validation window; its training windows read only tokens before it."""
    from ddp_exp.data.tokens import load_tokens, split_stream

    w = workloads.spec(GROUP)
    d = split_stream(load_tokens(path, "uint16", w["vocab_size"], w["block_size"]), None, 0,
                     workloads.SEED)
    return int(d.val.first)


def prepare(vs: list[Variant]) -> str | None:
    """Write the corpus file into a new temporary folder and point the group's variants at it;
    returns the folder (the runner deletes it) or None."""
    mine = [v for v in vs if isinstance(v, LmVariant)]
    if not mine:
        return None
    folder = tempfile.mkdtemp(prefix="ddp_exp-bench-lm-")
    path = write_corpus(folder)
    val_start = val_start_of(path)
    for v in mine:
        v.data_path, v.val_start = path, val_start
    return folder


def check_corpus(path: str) -> None:
    """Raise AssertionError unless the loop and ddp_exp read the same data from ``path``: the
    tokens ddp_exp's ``data=tokens`` memory-maps are the built-in corpus's bytes; every training
    window ddp_exp reads (any epoch's shift) ends before ``val_start``, where the loop's end;
    and ddp_exp's capped validation windows are the loop's (``val_start + p x block_size``)."""
    import numpy as np

    from ddp_exp.data.tokens import builtin_corpus, load_tokens, split_stream

    w = workloads.spec(GROUP)
    stream = load_tokens(path, "uint16", w["vocab_size"], w["block_size"])
    assert np.array_equal(np.asarray(stream.tokens), builtin_corpus()), "tokens"
    d = split_stream(stream, None, 0, workloads.SEED)
    val_start = val_start_of(path)
    block = w["block_size"]
    last = max(int(d.train.starts([len(d.train) - 1], e)[0]) for e in range(8))
    assert last + block + 1 <= val_start, "training region"
    n = w["limit_val_batches"] * w["batch_size"]
    assert d.val.starts(range(n)).tolist() == [val_start + p * block for p in range(n)], "val"


def check(vs: list[Variant]) -> list[str]:
    """:func:`check_corpus` on the group's token file."""
    paths = sorted({str(v.data_path) for v in vs})
    for path in paths:
        check_corpus(path)
    return ["lm (the tokens, the training region and the capped validation windows)"] if paths \
        else []


def targets() -> list[Target]:
    """ddp_exp / the loop, tokens/s, per world size (ratio of medians >= 0.95)."""
    return [Target(f"lm.ws{ws}.vs_nanogpt", f"lm, ws={ws}: ddp_exp / nanoGPT-style loop, "
                   "tokens/s", f"{GROUP}/ws{ws}/ddp_exp", f"{GROUP}/ws{ws}/nanogpt",
                   "samples_per_sec", ">=", BOUND) for ws in WORLD_SIZES]


def pair_ratios(rows: list[dict], ws: int) -> list[float]:
    """ddp_exp / loop tokens/s of each repeat at world size ``ws`` where both runs succeeded."""
    by = {(r["impl"], r["repeat"]): r.get("samples_per_sec") for r in rows
          if r["group"] == GROUP and r["world_size"] == ws and r["status"] == "ok"}
    return [by[("ddp_exp", k)] / by[("nanogpt", k)] for impl, k in sorted(by)
            if impl == "ddp_exp" and by.get(("nanogpt", k)) and by[("ddp_exp", k)]]


def ratio_line(rows: list[dict], ws: int) -> str:
    """The group's result at ``ws`` in one line: the ratio of medians, and the per-pair
    ratios' median and (min-max)."""
    a = stat(rows, f"{GROUP}/ws{ws}/ddp_exp", "samples_per_sec")
    b = stat(rows, f"{GROUP}/ws{ws}/nanogpt", "samples_per_sec")
    pairs = pair_ratios(rows, ws)
    if not (a and b and pairs):
        return f"ws={ws}: n/a (a run failed)"
    verdict = "PASS" if a.median / b.median >= BOUND else "MISS"
    return (f"ws={ws}: ratio of medians {a.median / b.median:.3f} (bound >= {BOUND}: {verdict}); "
            f"per-pair ratios median {statistics.median(pairs):.3f} "
            f"(min {min(pairs):.3f}, max {max(pairs):.3f}) over {len(pairs)} pairs")


def table(rows: list[dict], vs: list[Variant]) -> list[str]:
    """The group's markdown: one row per variant (tokens/s, model FLOP/s, wall, RSS, the
    validation loss of the same capped windows), then the ratio per world size."""
    w = workloads.spec(GROUP)
    steps = ",".join(str(s) for s in sorted({getattr(v, "steps", 0) for v in vs}))
    out = [f"`model=gpt` {w['n_layer']} layers, width {w['n_embd']}, {w['n_head']} heads, "
           f"context {w['block_size']}, {w['batch_size']} windows per rank, {steps} steps, "
           "AdamW, clipping 1.0, on the built-in corpus as a uint16 `.bin` (memory-mapped by "
           "both); intra-op threads cores // world_size in both. The loop draws random windows "
           "(nanoGPT's `get_batch`), ddp_exp its shuffled non-overlapping ones.", "",
           "| variant | ws | train tokens/s | model FLOP/s | wall s | peak RSS/rank MiB "
           "| val loss | other cores busy | runs |", "|---|---|---|---|---|---|---|---|---|"]
    for v in vs:
        mine = [r for r in rows if r["variant"] == v.key]
        ok = [r for r in mine if r["status"] == "ok"]
        if not ok:
            why = mine[-1]["note"] if mine else "not run"
            out.append(f"| {LABELS[v.impl]} | {v.world_size} | failed: {why} | | | | | | 0 |")
            continue
        cells = [LABELS[v.impl], str(v.world_size)]
        for field, spec in (("samples_per_sec", ",.0f"), ("model_flops_per_sec", ".3g"),
                            ("wall_s", ".2f"), ("peak_rss_mib_per_rank", ".0f"),
                            ("val_loss", ".4f"), ("other_cpu_cores", ".2f")):
            s = stat(rows, v.key, field)
            cells.append(s.fmt(spec) if s else "-")
        cells.append(f"{len(ok)}/{len(mine)}")
        out.append("| " + " | ".join(cells) + " |")
    out += [""] + [f"- {ratio_line(rows, ws)}" for ws in WORLD_SIZES]
    return out


LM = Group(
    GROUP, "Language model: ddp_exp (experiment=gpt_tokens) against a nanoGPT-style loop",
    variants, targets, table=table, prepare=prepare, check=check, min_repeats=PAIRS,
    notes=("**train tokens/s** (group lm): ddp_exp's `train/tokens_per_sec` of `metrics.json` "
           "(its samples/s: a window's every token is a sample); the nanoGPT-style loop times "
           "rank 0's loop from before its first batch to a barrier after its last step, the "
           "tokens of all ranks. **model FLOP/s**: tokens/s x `GPT.flops_per_token()` (6N + 12 L "
           "d T, PaLM appendix B; ddp_exp's `perf/model_flops_per_sec`). The ratio is of the "
           "medians; the spread is that of the per-pair ratios (each repeat runs ddp_exp then "
           "the loop).",))
