"""The ``prepare_text`` group (issue 39): ``ddp-exp prepare --tokenizer bpe --vocab-size 8192`` on
a generated 200 MB corpus (``benchmarks/probes/prepare_text.py``: Chinese and English documents,
deterministic), once per ``make bench``: a run takes minutes and its peak RSS is a bound, not a
ratio.

Rows (``benchmarks/results/prepare_text.csv``):

* ``prepare``: ``wall_s`` the prepare process's seconds (training the tokenizer, encoding,
  writing), ``peak_rss_mib_per_rank`` its peak RSS (``ru_maxrss`` of the child, MiB),
  ``samples_per_sec`` the prepared tokens over those seconds; target: peak RSS < 1 GB
  (953.7 MiB);
* ``encode_batch``: ``samples_per_sec`` the trained tokenizer's ``encode_batch`` (every core)
  on the corpus's first 8 MB, tokens/s.

``--quick``: a 10 MB corpus (not a measurement).

May use: ``benchmarks.harness``, ``benchmarks.groups.step_checkpoint`` (the probe runner).
"""

from __future__ import annotations

from benchmarks.groups.step_checkpoint import probe_result
from benchmarks.harness.group import Group, probe_row
from benchmarks.harness.stats import Target

GROUP = "prepare_text"
PROBE = "benchmarks.probes.prepare_text"
MB, QUICK_MB = 200, 10
GB_IN_MIB = 1e9 / 2**20


def measure(quick: bool, repeats: int, timeout_s: float) -> list[dict]:
    """One run of the probe, as two rows. Raises ProbeFailed where it gave no result."""
    r = probe_result(PROBE, ["--mb", str(QUICK_MB if quick else MB)], timeout_s)
    print(f"  {r['corpus_mb']} MB: prepare {r['prepare_s']} s, peak RSS {r['peak_rss_mb']} MiB, "
          f"{r['tokens']:,} tokens; encode_batch {r['encode_tokens_per_s']:,} tokens/s",
          flush=True)
    note = f"{r['corpus_mb']} MB corpus, {r['tokens']} tokens, {r['cores']} cores"
    return [probe_row(GROUP, "prepare", 0, workload="text", wall_s=r["prepare_s"],
                      peak_rss_mib_per_rank=r["peak_rss_mb"],
                      samples_per_sec=r["tokens"] / r["prepare_s"], note=note),
            probe_row(GROUP, "encode_batch", 0, workload="text",
                      samples_per_sec=r["encode_tokens_per_s"], note=note)]


def targets() -> list[Target]:
    return [Target("prepare_text.peak_rss", f"ddp-exp prepare, {MB} MB corpus, BPE 8192: peak "
                   "RSS, MiB", f"{GROUP}/ws1/prepare/probe", None, "peak_rss_mib_per_rank",
                   "<", round(GB_IN_MIB, 1))]


PREPARE_TEXT = Group(GROUP, f"Text preparation: ddp-exp prepare on a {MB} MB corpus, its peak "
                     "RSS and tokens/s, and the tokenizer's encode_batch tokens/s", lambda q: [],
                     targets, probe=measure, opt_in=True)
