"""The ``memory`` group (issue 13 point 3): what the data costs in memory at each world size.
ddp_exp only, on the ``synthetic`` workload at world size 1, 2 and 4, the data at 1x and 100x
(the same samples trained: 1 epoch of the large data and as many of the small), whose world PSS
(the sum of ``Pss`` over the launcher and its ranks) shows the copies of the data per world size
(one copy per node, shared by fork, is the rule) and what an extra rank costs with small and
with large data. Opt-in (~3 minutes per repeat): ``make bench ARGS="--only memory"``.

May use: ``benchmarks.harness``, ``scaling`` (the workload's sizes).
"""

from __future__ import annotations

from benchmarks.groups.scaling import BASE, MIN_DATA_MIB, data_mib, sizes
from benchmarks.harness.group import Group
from benchmarks.harness.stats import stat
from benchmarks.harness.variant import Variant

MEMORY_WORLD_SIZES = (1, 2, 4)
MEMORY_SCALE, QUICK_MEMORY_SCALE = 100, 4
MEMORY_PSS_POLL_S = 0.2  # seconds between reads of the world's PSS (nothing here is timed)


def memory_variants(quick: bool) -> list[Variant]:
    """The ``memory`` group: each of :data:`MEMORY_WORLD_SIZES` on the data at 1x and at
    :data:`MEMORY_SCALE` x (``quick``: 4x), the default model; 1 epoch of the large data and as
    many epochs of the small, so that both train the same samples and live as long; the PSS is
    read every :data:`MEMORY_PSS_POLL_S` (nothing here is timed)."""
    n, h = BASE["num_samples"], BASE["hidden"][0]
    scale = QUICK_MEMORY_SCALE if quick else MEMORY_SCALE
    return [Variant("memory", "ddp_exp", "synthetic", ws, BASE["batch_size"], epochs,
                    overrides=(f"data.num_samples={num}", f"model.hidden_sizes=[{h}]"),
                    label=f"n{num}-h{h}", world_pss=MEMORY_PSS_POLL_S)
            for ws in MEMORY_WORLD_SIZES for num, epochs in ((n, scale), (scale * n, 1))]


def memory_table(rows: list[dict], vs: list[Variant]) -> list[str]:
    """The ``memory`` group's markdown: per world size, the world's PSS with the data at 1x and
    at the large scale, what the added data cost, in copies of it; then what one more rank
    costs with each."""
    def pss(v: Variant | None) -> float | None:
        s = v and stat(rows, v.key, "world_pss_mib")
        return s.median if s else None

    sizes_seen = sorted({sizes(v)[0] for v in vs})
    small, large = sizes_seen[0], sizes_seen[-1]
    more = data_mib(large) - data_mib(small)
    out = ["ddp_exp only, `data=synthetic` (32 features, regression), the default MLP, 1 epoch "
           "of the large data and as many of the small (the same samples trained), default "
           "trainer keys off. `world PSS`: the sum of `Pss` over the launcher and its "
           "ranks (each page shared by fork counted once), largest over polls every "
           f"{MEMORY_PSS_POLL_S} s.", "",
           f"| ws | world PSS MiB, {small:,} samples ({data_mib(small):.1f} MiB) | world PSS MiB, "
           f"{large:,} samples ({data_mib(large):.1f} MiB) | grew MiB | copies of the added "
           "data | other cores busy | runs |", "|---|---|---|---|---|---|---|"]
    by_ws: dict[int, dict[int, Variant]] = {}
    for v in vs:
        by_ws.setdefault(v.world_size, {})[sizes(v)[0]] = v
    for ws in sorted(by_ws):
        a, b = pss(by_ws[ws].get(small)), pss(by_ws[ws].get(large))
        cells = [str(ws)] + [stat(rows, by_ws[ws][k].key, "world_pss_mib").fmt(".0f")
                             if pss(by_ws[ws].get(k)) is not None else "failed"
                             for k in (small, large)]
        grew = b - a if a is not None and b is not None else None
        cells += [f"{grew:+.0f}" if grew is not None else "-",
                  f"{grew / more:.2f}" if grew is not None and more >= MIN_DATA_MIB else "-"]
        busy = [stat(rows, v.key, "other_cpu_cores") for v in by_ws[ws].values()]
        cells.append(", ".join(s.fmt(".2f") for s in busy if s))
        runs = [r for v in by_ws[ws].values() for r in rows if r["variant"] == v.key]
        cells.append(f"{sum(r['status'] == 'ok' for r in runs)}/{len(runs)}")
        out.append("| " + " | ".join(cells) + " |")
    first, last = min(by_ws), max(by_ws)
    for k in (small, large):
        a, b = pss(by_ws[first].get(k)), pss(by_ws[last].get(k))
        if a is not None and b is not None and last > first:
            out.append(f"- one more rank, {k:,} samples: {(b - a) / (last - first):+.0f} MiB "
                       f"(ws={first} to ws={last})")
    out.append("- The rule: the data is one copy per node (the launcher's arrays, which forked "
               "ranks share), so the copies column stays near 1 at every world size and an extra "
               "rank costs the same with small and large data. Each rank adds its own gather of "
               "a few batches (`GATHER_BYTES`, 4 MiB) and its epoch order (8 bytes per sample of "
               "its shard).")
    return out


MEMORY = Group("memory", "Memory: the data's copies by world size (issue 13 point 3)",
               memory_variants, table=memory_table, opt_in=True)
