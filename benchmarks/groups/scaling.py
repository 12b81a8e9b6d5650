"""The ``scaling`` group (issue 13 point 3): how ddp_exp's cost grows with the work, and its
table in the report.

ddp_exp only, on the ``synthetic`` workload (``workloads``: ddp_exp's ``data=synthetic`` and
``model=mlp`` defaults, 32 per rank, 10 epochs; SGD at lr 0.002, where the 16x model's loss stays
finite) with the default trainer keys off as in the other ddp_exp variants. Three kinds of rows:

* world size 1, 2 and 4 (4 ranks oversubscribe a 2-core machine);
* the data at 10x and 100x ``data.num_samples`` (world_size 2, the same epochs): train seconds
  per training sample relative to 1x, which is 1.0 when time grows linearly with samples;
* the MLP at 1x, 4x and 16x the parameters (one hidden layer, its width chosen for the count),
  each at world_size 1 and 2: ws2 / ws1 samples/s per size, where the all-reduce starts to
  dominate.

The ``memory`` group (``memory.py``) reads the same world PSS at world size 1, 2 and 4 with the
data at 1x and 100x.

Every run also records the world's proportional set size (``timed.RssSampler``: the sum of
``Pss`` over the launcher and its ranks, largest over the polls), reported beside the data's
size. Not in ``make bench``'s default groups (5 repeats take ~20 minutes on a quiet machine, the
100x rows most of it): ``make bench ARGS="--only scaling"``.

May use: ``benchmarks.common``, ``benchmarks.workloads``, ``benchmarks.harness``. ``memory``
uses its sizes.
"""

from __future__ import annotations

from benchmarks import common, workloads
from benchmarks.harness.group import Group
from benchmarks.harness.stats import stat
from benchmarks.harness.variant import Variant

BASE = workloads.spec("synthetic")
WORLD_SIZES = (1, 2, 4)
DATA_SCALES = (10, 100)
QUICK_DATA_SCALES = (2, 4)  # --quick: a smoke test, not the measurement
MODEL_SCALES = (4, 16)
DATA_WORLD_SIZE = 2
OUTPUTS = 1  # data=synthetic's default is regression: one output
FLOAT32 = 4  # bytes
# Seconds between reads of the world's PSS: once a second where the runs are timed (reading
# smaps_rollup costs CPU; the memory group, where only memory is read, reads it more often).
SCALING_PSS_POLL_S = 1.0
MIN_DATA_MIB = 10  # less added data than this is lost in the world PSS, which moves by tens of MiB


def params(hidden: int) -> int:
    """Parameters of ddp_exp's MLP with one hidden layer of width ``hidden`` on the synthetic
    data: ``(features + 1) * hidden + (hidden + 1) * outputs`` (weights and biases)."""
    return (BASE["num_features"] + 1) * hidden + (hidden + 1) * OUTPUTS


def hidden_for(scale: int) -> int:
    """The hidden width whose parameter count is nearest ``scale`` x the default model's
    (``scale`` 4: 512, 16: 2048 for the default width 128 on 32 features)."""
    target = scale * params(BASE["hidden"][0])
    return round((target - OUTPUTS) / (BASE["num_features"] + 1 + OUTPUTS))


def data_mib(num_samples: int) -> float:
    """The data set in memory: float32 features ``[N, features]`` and targets ``[N, 1]``, MiB."""
    return num_samples * (BASE["num_features"] + OUTPUTS) * FLOAT32 / 2**20


def sizes(v: Variant) -> tuple[int, int]:
    """``(data.num_samples, hidden width)`` of one of this group's variants (its label)."""
    n, h = v.label.removeprefix("n").split("-h")
    return int(n), int(h)


def variants(quick: bool) -> list[Variant]:
    """The group's runs, each once (the 1x rows of the three kinds share theirs), in the order
    they are interleaved; ``quick``: 1 epoch and data at 2x and 4x."""
    epochs = 1 if quick else BASE["epochs"]
    n, h = BASE["num_samples"], BASE["hidden"][0]
    wanted = [(ws, n, h) for ws in WORLD_SIZES]
    wanted += [(DATA_WORLD_SIZE, k * n, h) for k in (QUICK_DATA_SCALES if quick else DATA_SCALES)]
    wanted += [(ws, n, hidden_for(k)) for k in MODEL_SCALES for ws in (1, 2)]
    return [Variant("scaling", "ddp_exp", "synthetic", ws, BASE["batch_size"], epochs,
                    overrides=(f"data.num_samples={num}", f"model.hidden_sizes=[{hidden}]"),
                    label=f"n{num}-h{hidden}", world_pss=SCALING_PSS_POLL_S)
            for ws, num, hidden in dict.fromkeys(wanted)]


def _layout(vs: list[Variant]) -> list[tuple[str, Variant]]:
    """The table's rows ``(kind, variant)`` from the variants present (``--impls`` may drop
    some): world size at the default sizes, data at world_size 2, the model at world_size 1
    and 2 on the default data."""
    n, h = BASE["num_samples"], BASE["hidden"][0]
    rows = [("world size", v) for v in sorted(vs, key=lambda v: v.world_size)
            if sizes(v) == (n, h)]
    rows += [("data", v) for v in sorted(vs, key=lambda v: sizes(v)[0])
             if v.world_size == DATA_WORLD_SIZE and sizes(v)[1] == h]
    rows += [("model", v) for v in sorted(vs, key=lambda v: (sizes(v)[1], v.world_size))
             if sizes(v)[0] == n and v.world_size in (1, 2)]
    return rows


def _train_samples(v: Variant) -> int:
    return (sizes(v)[0] - BASE["val_size"]) * v.epochs


def _ratio(rows: list[dict], kind: str, v: Variant, vs: list[Variant]) -> str:
    """The row kind's ratio, as text (``-`` where it has none or a run failed)."""
    def median(key: str, field: str) -> float | None:
        s = stat(rows, key, field)
        return s.median if s else None

    n, h = sizes(v)
    if kind == "world size":
        base = next((b for b in vs if b.world_size == 1 and sizes(b) == (n, h)), None)
        a, b = median(v.key, "samples_per_sec"), base and median(base.key, "samples_per_sec")
        return f"{a / b:.2f} x ws=1 samples/s" if a and b else "-"
    if kind == "data":
        base = next((b for b in vs if b.world_size == v.world_size
                     and sizes(b) == (BASE["num_samples"], h)), None)
        a, b = median(v.key, "train_s"), base and median(base.key, "train_s")
        if not (a and b):
            return "-"
        per_sample = (a / _train_samples(v)) / (b / _train_samples(base))
        return f"{per_sample:.2f} x 1x train s/sample"
    if v.world_size != 2:
        return "-"
    base = next((b for b in vs if b.world_size == 1 and sizes(b) == (n, h)), None)
    a, b = median(v.key, "samples_per_sec"), base and median(base.key, "samples_per_sec")
    return f"ws2/ws1 samples/s {a / b:.2f}" if a and b else "-"


LIMITS = [
    "**world size**: the cores. World size 1 runs 2 intra-op threads on the 2 cores, 2 runs one "
    "thread per rank, 4 puts 4 single-thread ranks on 2 cores (oversubscribed: every step of "
    "every rank waits for a time slice, and the all-reduce waits for the slowest rank); the "
    "batch is 32 per rank, so the global batch grows with the world.",
    "**data**: memory bandwidth and the cores. Each sample costs the same forward, backward and "
    "optimizer work, and the epoch's shard is gathered 4 MiB at a time (one pass over the "
    "data in memory per epoch), so train seconds per sample stay flat as long as the data fits "
    f"in memory ({data_mib(DATA_SCALES[-1] * BASE['num_samples']):.0f} MiB at {DATA_SCALES[-1]}x).",
    "**model**: one all-reduce per step. At world size 2 each rank computes its 32 samples on "
    "one core and then all-reduces every gradient (4 bytes a parameter) through gloo on the "
    "same cores; world size 1 computes 32 samples with 2 threads and no all-reduce. The "
    "ws2 / ws1 ratio shows where the all-reduce, which grows with the parameters, eats the "
    "samples the second rank adds.",
    "**memory**: forked ranks share the launcher's pages (copy-on-write), so one copy of the "
    "data per node is the rule. `VmHWM` per rank counts every shared page in every rank; the "
    "world's PSS (sum of `Pss` from `/proc/<pid>/smaps_rollup` over the launcher and its ranks, "
    "largest over polls every second) counts each shared page once: it should grow by the data "
    "(times the copies the loader makes) from 1x to 100x, and by a rank's own memory (torch, "
    "gloo, the model) per extra rank.",
]


def table(rows: list[dict], vs: list[Variant]) -> list[str]:
    """The group's markdown: one table (the three kinds of rows), the physical limit of each
    kind and the memory figures, from the runs' ``rows``."""
    epochs = ",".join(str(e) for e in sorted({v.epochs for v in vs}))
    out = ["ddp_exp only, `data=synthetic` (32 features, 512 held out, regression), "
           f"`model=mlp` with one hidden layer, 32 per rank, epochs {epochs}, SGD lr 0.002 "
           "momentum 0.9 (at ddp_exp's default 0.05 the 16x model's loss overflows), default "
           "trainer keys off; "
           f"world size 4 oversubscribes {common.cores()} cores. `world PSS`: see the memory "
           "note.", "",
           "| rows | ws | num_samples | data MiB | MLP hidden (params) | train samples/s | "
           "train s | wall s | peak RSS/rank MiB | world PSS MiB | ratio | other cores busy "
           "| runs |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for kind, v in _layout(vs):
        n, h = sizes(v)
        mine = [r for r in rows if r["variant"] == v.key]
        ok = [r for r in mine if r["status"] == "ok"]
        cells = [kind, str(v.world_size), f"{n:,}", f"{data_mib(n):.1f}",
                 f"{h} ({params(h):,})"]
        if ok:
            for field, spec in (("samples_per_sec", ",.0f"), ("train_s", ".2f"),
                                ("wall_s", ".2f"), ("peak_rss_mib_per_rank", ".0f"),
                                ("world_pss_mib", ".0f")):
                s = stat(rows, v.key, field)
                cells.append(s.fmt(spec) if s else "-")
            cells.append(_ratio(rows, kind, v, vs))
            s = stat(rows, v.key, "other_cpu_cores")
            cells.append(s.fmt(".2f") if s else "-")
        else:
            why = mine[-1]["note"] if mine else "not run"
            cells += [f"failed: {why}", "", "", "", "", "", ""]
        cells.append(f"{len(ok)}/{len(mine)}")
        out.append("| " + " | ".join(cells) + " |")
    out += [""] + [f"- {x}" for x in LIMITS]
    out += [f"- {x}" for x in _memory_lines(rows, vs)]
    return out


def _memory_lines(rows: list[dict], vs: list[Variant]) -> list[str]:
    """The world's PSS against the data (data rows) and per extra rank (world-size rows)."""
    def pss(v: Variant) -> float | None:
        s = stat(rows, v.key, "world_pss_mib")
        return s.median if s else None

    layout = _layout(vs)
    out = []
    data = [v for kind, v in layout if kind == "data" and pss(v) is not None]
    if len(data) > 1:
        base = data[0]
        for v in data[1:]:
            grew, more = pss(v) - pss(base), data_mib(sizes(v)[0]) - data_mib(sizes(base)[0])
            copies = (f"{grew / more:.2f} copies" if more >= MIN_DATA_MIB else
                      f"under {MIN_DATA_MIB} MiB of data: within the PSS's run-to-run spread, "
                      "no copies counted")
            out.append(f"world PSS, ws={v.world_size}, {sizes(v)[0]:,} against "
                       f"{sizes(base)[0]:,} samples: {grew:+.0f} MiB for +{more:.1f} MiB of "
                       f"data ({copies})")
    worlds = [v for kind, v in layout if kind == "world size" and pss(v) is not None]
    if len(worlds) > 1:
        first, last = worlds[0], worlds[-1]
        per_rank = (pss(last) - pss(first)) / (last.world_size - first.world_size)
        out.append("world PSS by world size: "
                   + ", ".join(f"ws={v.world_size} {pss(v):.0f} MiB" for v in worlds)
                   + f" (data {data_mib(BASE['num_samples']):.1f} MiB): +{per_rank:.0f} MiB "
                   "per extra rank")
    return out


SCALING = Group(
    "scaling", "Scaling: how cost grows with the work (issue 13 point 3)", variants, table=table,
    opt_in=True,
    notes=("**world PSS** (groups scaling and memory): every second (memory: every 0.2 s) while "
           "a run is alive the runner sums `Pss` from `/proc/<pid>/smaps_rollup` over the "
           "started process and its children (the launcher and the ranks, multiprocessing's "
           "helpers excluded); the figure is the largest sum. Shared pages count once in the "
           "world, private ones fully (CSV column `world_pss_mib`).",))
