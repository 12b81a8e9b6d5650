"""The ``fsdp`` group (issue 40): ``strategy=fsdp`` against ``strategy=ddp`` at world_size 2 on
the issue's GPT (``model=gpt data=tokens optim=adamw``, 8 layers, width 512, 8 heads, context
128: ~25M parameters, 2 windows per rank), interleaved pairs (ddp first), reported per strategy.

Figures, each run one ``python -m ddp_exp`` (a few optimizer steps, validation capped, no
checkpoint: ``trainer.save_last=false trainer.monitor=null``; a checkpoint gathers the full state
on rank 0, ~300 MiB here, which the first measurement's RSS carried: fsdp / ddp 1.080):

* ``state_mib_per_rank``: ``perf/state_mb_per_rank`` of metrics.json (parameters + gradients +
  AdamW state, MiB, the largest rank); target fsdp / ddp <= 0.55;
* ``peak_rss_mib_self_reported``: ``perf/max_rss_mb`` (each rank's peak RSS, the largest);
  target fsdp / ddp < 1; ``peak_rss_mib_per_rank``: the runner's own reading of the ranks'
  ``VmHWM``, beside it. A peak is a high-water mark: one moment's temporaries (the evaluation
  pass's gathered parameters, a step's buffers) set it for the whole run;
* ``steady_rss_mib_self_reported``: ``perf/rss_mb`` (each rank's RSS at the end of training,
  after the last validation, before ``model.pt``'s gather; the largest): what a rank holds
  between steps; target fsdp / ddp < 1 (ours: the issue names the peak);
* ``samples_per_sec``: ``train/tokens_per_sec`` with the first step put back (the runner's rule,
  ``harness.measure``); target fsdp / ddp >= 0.85.

Why RSS falls less than the state: beside the shards, a rank holds each block's all-gathered
parameters while it runs (all of them at once with ``strategy.reshard_after_forward=false``), the
unsharded gradients of a block until they are reduce-scattered (and of every block during an
accumulating micro-batch), the activations (``strategy.activation_checkpointing=true`` cuts them
to one block's); the seeded full model the launching process builds is shared with the forked
ranks, and the half of it a rank reads counts in its RSS. And glibc's free pages: its dynamic
mmap threshold rises to FSDP's 12 MiB all-gather buffers, the heap keeps every smaller freed
tensor, and a rank's RSS creeps to ~1.1 GiB over ~670 MiB live. ``strategy.malloc_mmap_threshold
=131072`` fixes the threshold and gives them back (peak ~750 MiB), at a page fault per 4 KiB of
every large tensor every step (:mod:`ddp_exp.compat.glibc_malloc`); the group measures the
default (null).

May use: ``benchmarks.harness``.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.harness.group import Group
from benchmarks.harness.report import group_table
from benchmarks.harness.stats import Target, stat
from benchmarks.harness.variant import PY, Variant

GROUP = "fsdp"
ISSUE_GPT = ("model.n_layer=8", "model.n_embd=512", "model.n_head=8", "data.block_size=128")
QUICK_GPT = ("model.n_layer=2", "model.n_embd=64", "model.n_head=2", "data.block_size=64")
BATCH, STEPS, QUICK_STEPS = 2, 10, 3
STRATEGIES = ("ddp", "fsdp")


@dataclass
class StrategyVariant(Variant):
    """One run of the GPT at world_size 2 under ``strategy`` (its label)."""

    model: tuple[str, ...] = ()
    steps: int = 0

    def argv(self, workdir: str) -> list[str]:
        return [PY, "-m", "ddp_exp", "model=gpt", "data=tokens", "optim=adamw",
                f"world_size={self.world_size}", "backend=gloo", f"strategy={self.label}",
                *self.model, f"data.batch_size={self.batch_size}",
                f"trainer.max_steps={self.steps}", "trainer.epochs=1",
                "trainer.limit_val_batches=2", "trainer.sample_every_n_epochs=0",
                "trainer.save_last=false", "trainer.monitor=null", "print_config=false",
                "trainer.progress=off",
                f"hydra.run.dir={workdir}/job"]


def variants(quick: bool) -> list[Variant]:
    return [StrategyVariant(GROUP, "ddp_exp", "gpt", 2, BATCH if not quick else 4, 1, label=s,
                            model=QUICK_GPT if quick else ISSUE_GPT,
                            steps=QUICK_STEPS if quick else STEPS)
            for s in STRATEGIES]


def key(strategy: str) -> str:
    return f"{GROUP}/ws2/{strategy}/ddp_exp"


def targets() -> list[Target]:
    what = "GPT ~25M params, AdamW, ws=2: fsdp / ddp"
    return [Target("fsdp.state_vs_ddp", f"{what}, perf/state_mb_per_rank", key("fsdp"),
                   key("ddp"), "state_mib_per_rank", "<=", 0.55),
            Target("fsdp.rss_vs_ddp", f"{what}, perf/max_rss_mb", key("fsdp"), key("ddp"),
                   "peak_rss_mib_self_reported", "<", 1.0),
            Target("fsdp.steady_rss_vs_ddp", f"{what}, perf/rss_mb", key("fsdp"), key("ddp"),
                   "steady_rss_mib_self_reported", "<", 1.0),
            Target("fsdp.tokens_vs_ddp", f"{what}, tokens/s", key("fsdp"), key("ddp"),
                   "samples_per_sec", ">=", 0.85)]


def table(rows: list[dict], vs: list[Variant]) -> list[str]:
    """The runner's table, then the state, metrics.json's peak and steady RSS per strategy."""
    out = group_table(rows, vs) + ["", "| strategy | perf/state_mb_per_rank (MiB) | "
                                   "perf/max_rss_mb (MiB, peak) | perf/rss_mb (MiB, steady) | "
                                   "tokens/s |", "|---|---|---|---|---|"]
    for v in vs:
        cells = [(s.fmt(",.1f") if (s := stat(rows, v.key, f)) else "-")
                 for f in ("state_mib_per_rank", "peak_rss_mib_self_reported",
                           "steady_rss_mib_self_reported", "samples_per_sec")]
        out.append(f"| {v.label} | " + " | ".join(cells) + " |")
    return out


FSDP = Group(GROUP, "FSDP: strategy=fsdp against ddp, the state, peak RSS and tokens/s per "
             "strategy (GPT ~25M parameters, AdamW, ws=2)", variants, targets, table=table,
             opt_in=True, notes=(
                 "fsdp: `perf/state_mb_per_rank`, `perf/max_rss_mb` (peak: a high-water mark) "
                 "and `perf/rss_mb` (steady: at the end of training) of metrics.json (the "
                 "largest rank); RSS falls less than the state (all-gathered blocks, unsharded "
                 "gradients until reduce-scattered, activations, the launcher's seeded model "
                 "shared with the forked ranks): benchmarks/groups/fsdp.py.",))
