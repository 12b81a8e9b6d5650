"""``make bench``: ddp_exp side by side with hand-written DDP and Lightning (issue 5).

    python benchmarks/run.py                 # the suite: 5 interleaved repeats per variant
    python benchmarks/run.py --repeats 7
    python benchmarks/run.py --quick         # smoke test: 1 repeat, tiny epochs (not a measurement)
    python benchmarks/run.py --only digits,startup
    python benchmarks/run.py --only digits --impls defaults/ddp_exp,tight --repeats 10

Groups (each one interleaved: for every repeat, every variant of the group once, A B C A B C ...):

* ``digits``: MLP 64-128-10, 32 per rank, 20 epochs, world_size 1 and 2;
* ``compute``: synthetic 16,384 x 512, MLP 512-2048-2048-10, 256 per rank, 2 epochs, ws 1 and 2;
  Both also run (issue 13) ``ddp_exp`` with the default trainer keys (label ``defaults``:
  checkpoint, progress lines, config dump and the perf timer on) and the tight hand-written loop
  ``benchmarks/ddp_tight.py`` (the epoch's shard gathered once, one all-reduce per epoch);
* ``startup``: the 1-epoch digits ddp_exp job at world_size 2 against bare 2-rank launches that
  import torch and initialise gloo (``benchmarks/startup.py``), and the hand-written scripts'
  own 1-epoch jobs (hand-tuned, tight) with ddp_exp's default keys beside them;
* ``c17``: thread oversubscription (shared/cases C17): ddp_exp on digits, ``world_size=1`` with
  batch 64, ``world_size=2`` with 32, ``world_size=4`` with 16 (the same global batch);
* ``perf``: the cost of the ``perf/*`` dashboards (issue 14): ddp_exp on digits at world_size 2
  with ``trainer.perf_metrics=true`` and ``false``;
* ``image_folder`` (issue 11): the digits as PNG files in a temporary folder made here,
  ``data=image_folder model=cnn`` with 2 DataLoader workers per rank against the hand-written
  Pillow + DataLoader + DDP script on the same files (``benchmarks/ddp_image_folder.py``), 32
  per rank, 5 epochs, world_size 2.

Each run is one process started from here with ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS``
removed from its environment. Figures: training samples/s of the loop only (ddp_exp:
``metrics.json``; the scripts: their own result line), end-to-end wall seconds of the whole
process (timed here, from before the process is started until it has exited), and peak resident
memory per rank (``VmHWM`` of every rank process, read from ``/proc`` every 50 ms while it runs;
the maximum over ranks). Writes ``benchmarks/results.csv`` (one row per run) and
``BENCHMARKS.md`` (medians with min and max, the ratios of targets (a)-(e), I11 and C17,
PASS/MISS).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
import common  # noqa: E402
import workloads  # noqa: E402

PY = sys.executable
POLL_S = 0.05
DROPPED_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
HELPERS = ("resource_tracker", "semaphore_tracker", "forkserver")  # not ranks

IMPL_LABELS = {
    "ddp_exp": "ddp_exp",
    "tuned": "hand-tuned script",
    "tight": "tight script (epoch shard, 1 reduce/epoch)",
    "tutorial": "tutorial script (default threads)",
    "tutorial-1t": "tutorial script (1 thread/rank)",
    "handwritten": "hand-written script (Pillow + DataLoader)",
    "lightning": "Lightning Trainer",
    "bare-mp-fork": "bare launch, mp fork",
    "bare-elastic": "bare launch, elastic launcher (fork)",
    "bare-mp-spawn": "bare launch, mp spawn",
}
CSV_FIELDS = ["group", "variant", "impl", "workload", "world_size", "batch_size", "epochs",
              "repeat", "rc", "status", "samples_per_sec", "train_s", "wall_s",
              "wall_s_inside", "peak_rss_mib_per_rank", "peak_rss_mib_self_reported",
              "ranks_seen", "threads_per_rank", "train_loss", "val_loss", "val_accuracy",
              "loadavg_1m", "other_cpu_cores", "note"]


# ----------------------------------------------------------------------------- variants
@dataclass
class Variant:
    group: str
    impl: str
    workload: str
    world_size: int
    batch_size: int
    epochs: int
    num_train: int | None = None
    tree: bool = False  # True: the root process is itself a rank (Lightning's launcher)
    skipped: str | None = None
    overrides: tuple[str, ...] = ()  # ddp_exp: extra overrides (group perf)
    label: str | None = None  # in the key and the tables, for variants of one impl
    data_path: str | None = None  # the image folder (workload image_folder), made by main()
    user_defaults: bool = False  # ddp_exp: default trainer keys (checkpoint, progress, perf)

    @property
    def key(self) -> str:
        extra = f"/b{self.batch_size}" if self.group == "c17" else ""
        extra += f"/{self.label}" if self.label else ""
        return f"{self.group}/ws{self.world_size}{extra}/{self.impl}"

    def argv(self, workdir: str) -> list[str]:
        if self.impl == "ddp_exp":
            return [PY, "-m", "ddp_exp", *workloads.ddp_exp_overrides(
                self.workload, self.world_size, self.batch_size, self.epochs, self.num_train,
                self.data_path, self.user_defaults), *self.overrides,
                f"hydra.run.dir={workdir}/job"]
        if self.impl == "handwritten":
            return [PY, os.path.join(BENCH, "ddp_image_folder.py"), "--data-path",
                    str(self.data_path), "--world-size", str(self.world_size), "--batch-size",
                    str(self.batch_size), "--epochs", str(self.epochs), "--out",
                    f"{workdir}/result.json"]
        if self.impl.startswith("bare-"):
            return [PY, os.path.join(BENCH, "startup.py"), "--launch",
                    self.impl.removeprefix("bare-"), "--world-size", str(self.world_size),
                    "--out", f"{workdir}/result.json"]
        script = {"tuned": "ddp_tuned.py", "tight": "ddp_tight.py", "tutorial": "ddp_tutorial.py",
                  "tutorial-1t": "ddp_tutorial.py", "lightning": "lightning_digits.py"}[self.impl]
        argv = [PY, os.path.join(BENCH, script), "--workload", self.workload,
                "--world-size", str(self.world_size), "--batch-size", str(self.batch_size),
                "--epochs", str(self.epochs), "--out", f"{workdir}/result.json"]
        if self.num_train is not None:
            argv += ["--num-train", str(self.num_train)]
        if self.impl == "tutorial-1t":
            argv += ["--threads-per-rank", "1"]
        return argv


def build_variants(quick: bool) -> dict[str, list[Variant]]:
    """The groups of issue 5 (``quick``: 1 epoch, 2,048 compute samples)."""
    groups: dict[str, list[Variant]] = {}
    for wl in ("digits", "compute"):
        w = workloads.spec(wl)
        epochs = 1 if quick else w["epochs"]
        num_train = 2048 if quick and wl == "compute" else None
        vs = []
        for ws in (1, 2):
            impls = ["ddp_exp", "tuned", "tutorial"] + (["tutorial-1t"] if ws > 1 else []) + [
                "lightning"]
            vs += [Variant(wl, impl, wl, ws, w["batch_size"], epochs, num_train,
                           tree=impl == "lightning") for impl in impls]
            # Issue 13: what a user runs (checkpoint, progress, perf timer on) against the
            # tightest hand-written loop.
            vs += [Variant(wl, "ddp_exp", wl, ws, w["batch_size"], epochs, num_train,
                           label="defaults", user_defaults=True),
                   Variant(wl, "tight", wl, ws, w["batch_size"], epochs, num_train)]
        groups[wl] = vs
    d = workloads.spec("digits")
    groups["startup"] = [Variant("startup", "ddp_exp", "digits", 2, d["batch_size"], 1)] + [
        Variant("startup", impl, "digits", 2, d["batch_size"], 1)
        for impl in ("bare-mp-fork", "bare-elastic", "bare-mp-spawn", "tuned")] + [
        Variant("startup", "ddp_exp", "digits", 2, d["batch_size"], 1, label="defaults",
                user_defaults=True),
        Variant("startup", "tight", "digits", 2, d["batch_size"], 1)]
    b = d["batch_size"]
    c17_epochs = 1 if quick else d["epochs"]
    groups["c17"] = [Variant("c17", "ddp_exp", "digits", ws, bs, c17_epochs)
                     for ws, bs in ((1, 2 * b), (2, b), (4, b // 2))]
    groups["perf"] = [Variant("perf", "ddp_exp", "digits", 2, b, c17_epochs,
                              overrides=(f"trainer.perf_metrics={on}",), label=f"perf-{on}")
                      for on in ("true", "false")]
    # world_size 2 only: at 1, the rank's 2 intra-op threads (cores // world_size) and its 2
    # decoding workers share 2 cores, and both implementations crawl (70-150 samples/s against
    # ~1,300 at world_size 2, 1-2 minutes a run): noise, not a comparison of the data paths.
    im = workloads.spec("image_folder")
    groups["image_folder"] = [
        Variant("image_folder", impl, "image_folder", 2, im["batch_size"],
                1 if quick else im["epochs"]) for impl in ("ddp_exp", "handwritten")]
    return groups


# ------------------------------------------------------------------- one timed process
def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                out += [int(c) for c in fh.read().split()]
        except OSError:
            pass
    return out


def _vm_hwm_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class RssSampler(threading.Thread):
    """Every ``POLL_S``: ``root`` and its children (the ranks: every launcher here forks or
    starts them from the process the runner started) and each one's ``VmHWM`` (the kernel's
    peak-RSS mark, so a sample misses only growth in a process's last ``POLL_S``). The ranks'
    own children (DataLoader workers, compile workers) are not ranks and are not read."""

    def __init__(self, root: int):
        super().__init__(daemon=True)
        self.root, self.stop = root, threading.Event()
        self.peak: dict[int, int] = {}
        self.cmd: dict[int, str] = {}

    def sample(self) -> None:
        for pid in [self.root, *_children(self.root)]:
            hwm = _vm_hwm_kib(pid)
            if hwm is not None:
                self.peak[pid] = max(self.peak.get(pid, 0), hwm)
                if pid not in self.cmd:
                    self.cmd[pid] = _cmdline(pid)

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(POLL_S)

    def rank_peaks_mib(self, root_is_rank: bool) -> list[float]:
        ranks = [pid for pid in self.peak if (pid != self.root or root_is_rank)
                 and not any(h in self.cmd.get(pid, "") for h in HELPERS)]
        return [self.peak[pid] / 1024.0 for pid in ranks]


@dataclass
class Run:
    rc: int
    wall_s: float
    rank_rss_mib: list[float]
    stdout: str
    stderr: str
    timed_out: bool = False
    other_cpu: float | None = None  # cores busy with other work meanwhile (noise indicator)


def _busy_cpu_s() -> float:
    """CPU-seconds the whole machine has been busy since boot (``/proc/stat``)."""
    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = f
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def timed_process(argv: list[str], root_is_rank: bool, timeout_s: float,
                  cwd: str = ROOT) -> Run:
    """Start ``argv`` (its own session), time it to its exit, sample its ranks' peak RSS, and
    estimate how many cores other processes kept busy meanwhile (all busy CPU time minus the
    run's own, from ``wait4``, over the wall time)."""
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        busy0 = _busy_cpu_s()
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        sampler = RssSampler(proc.pid)
        sampler.start()
        done: dict = {}

        def reap() -> None:  # wait4: the exit status and the CPU time of the whole run
            _, status, usage = os.wait4(proc.pid, 0)
            done.update(t=time.perf_counter(), status=status, usage=usage)

        waiter = threading.Thread(target=reap, daemon=True)
        waiter.start()
        waiter.join(timeout_s)
        timed_out = waiter.is_alive()
        if timed_out:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this run started, nothing else
            waiter.join()
        wall = done["t"] - t0
        busy = _busy_cpu_s() - busy0
        rc = os.waitstatus_to_exitcode(done["status"])
        proc.returncode = rc  # reaped above
        own = done["usage"].ru_utime + done["usage"].ru_stime
        sampler.stop.set()
        sampler.join()
        _reap_session(proc.pid)
        out.seek(0)
        err.seek(0)
        return Run(rc, wall, sampler.rank_peaks_mib(root_is_rank), out.read(), err.read(),
                   timed_out, max(0.0, (busy - own) / wall) if wall > 0 else None)


def _reap_session(sid: int) -> None:
    """A rank left behind by a failed run would skew every later one: end the run's own
    session (the process group this run created), if anything is left in it."""
    try:
        os.killpg(sid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------ one measured run
def measure(v: Variant, repeat: int, timeout_s: float, keep: str | None) -> dict:
    row = {"group": v.group, "variant": v.key, "impl": v.impl, "workload": v.workload,
           "world_size": v.world_size, "batch_size": v.batch_size, "epochs": v.epochs,
           "repeat": repeat, "loadavg_1m": round(os.getloadavg()[0], 2), "note": ""}
    workdir = tempfile.mkdtemp(prefix="ddp_exp-bench-")
    try:
        run = timed_process(v.argv(workdir), v.tree, timeout_s)
        row.update(rc=run.rc, wall_s=run.wall_s, ranks_seen=len(run.rank_rss_mib),
                   other_cpu_cores=run.other_cpu,
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


def _read_result(v: Variant, workdir: str, row: dict) -> None:
    """ddp_exp's metrics.json or a script's result file into ``row``."""
    if v.impl == "ddp_exp":
        with open(os.path.join(workdir, "job", "metrics.json")) as fh:
            m = json.load(fh)
        row.update(samples_per_sec=m.get("train/samples_per_sec"),
                   train_s=m.get("time/train_s"), wall_s_inside=m.get("time/total_s"),
                   threads_per_rank=m.get("threads_per_rank"),
                   train_loss=m.get("train/loss"), val_loss=m.get("val/loss"),
                   val_accuracy=m.get("val/accuracy"))
    else:
        with open(os.path.join(workdir, "result.json")) as fh:
            r = json.load(fh)
        row.update(samples_per_sec=r.get("samples_per_sec"), train_s=r.get("train_s"),
                   wall_s_inside=r.get("wall_s"), threads_per_rank=r.get("threads_per_rank"),
                   peak_rss_mib_self_reported=r.get("peak_rss_mib_per_rank"),
                   train_loss=r.get("train_loss"), val_loss=r.get("val_loss"),
                   val_accuracy=r.get("val_accuracy"))


def run_groups(groups: dict[str, list[Variant]], repeats: int, timeout_s: float,
               keep: str | None, log=print) -> tuple[list[dict], dict]:
    rows: list[dict] = []
    info: dict = {"load": {}}
    for name, variants in groups.items():
        info["load"][name] = [round(x, 2) for x in os.getloadavg()]
        log(f"== {name}: {len(variants)} variants x {repeats} repeat(s), interleaved "
            f"(load average {info['load'][name][0]:.2f})")
        for rep in range(repeats):
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


# --------------------------------------------------------------------------------- summary
@dataclass
class Stat:
    median: float
    lo: float
    hi: float
    n: int

    def fmt(self, spec: str) -> str:
        return (f"{self.median:{spec}} ({self.lo:{spec}}-{self.hi:{spec}})" if self.n > 1
                else f"{self.median:{spec}}")


def stat(rows: list[dict], key: str, field_: str) -> Stat | None:
    vals = [r[field_] for r in rows
            if r["variant"] == key and r["status"] == "ok" and r.get(field_) is not None]
    if not vals:
        return None
    return Stat(statistics.median(vals), min(vals), max(vals), len(vals))


@dataclass
class Target:
    name: str
    what: str
    num: str
    den: str
    field: str
    op: str  # ">=" or "<="
    bound: float
    ratio: float | None = None
    extra: dict = field(default_factory=dict)

    def evaluate(self, rows: list[dict]) -> None:
        a, b = stat(rows, self.num, self.field), stat(rows, self.den, self.field)
        self.ratio = a.median / b.median if a and b and b.median else None

    @property
    def verdict(self) -> str:
        if self.ratio is None:
            return "n/a"
        ok = self.ratio >= self.bound if self.op == ">=" else self.ratio <= self.bound
        if ok:
            return "PASS"
        miss = (self.bound - self.ratio) / self.bound if self.op == ">=" else (
            self.ratio - self.bound) / self.bound
        return f"MISS by {miss:.1%}"


def build_targets(groups: dict[str, list[Variant]]) -> list[Target]:
    sps, wall, rss = "samples_per_sec", "wall_s", "peak_rss_mib_per_rank"
    t: list[Target] = []
    for wl in ("digits", "compute"):
        for ws in (1, 2):
            t.append(Target("(a)", f"{wl}, ws={ws}: ddp_exp / hand-tuned, samples/s",
                            f"{wl}/ws{ws}/ddp_exp", f"{wl}/ws{ws}/tuned", sps, ">=", 0.97))
    for wl in ("digits", "compute"):
        for ws in (1, 2):
            t.append(Target("I13", f"{wl}, ws={ws}: ddp_exp (default keys) / tight script, "
                            "samples/s", f"{wl}/ws{ws}/defaults/ddp_exp", f"{wl}/ws{ws}/tight",
                            sps, ">=", 0.97))
    t.append(Target("(b)", "digits, ws=2: ddp_exp / Lightning, samples/s",
                    "digits/ws2/ddp_exp", "digits/ws2/lightning", sps, ">=", 2.0))
    t.append(Target("(b)", "digits, ws=2: ddp_exp / Lightning, wall s",
                    "digits/ws2/ddp_exp", "digits/ws2/lightning", wall, "<=", 0.5))
    t.append(Target("(c)", "compute: ddp_exp ws=2 / ws=1, samples/s",
                    "compute/ws2/ddp_exp", "compute/ws1/ddp_exp", sps, ">=", 0.95))
    t.append(Target("(d)", "1-epoch digits job wall / bare 2-rank launch (mp fork)",
                    "startup/ws2/ddp_exp", "startup/ws2/bare-mp-fork", wall, "<=", 1.3))
    t.append(Target("I13", "1-epoch digits job, ws=2, default keys: ddp_exp / hand-tuned "
                    "script, wall s", "startup/ws2/defaults/ddp_exp", "startup/ws2/tuned", wall,
                    "<=", 1.1))
    for wl in ("digits", "compute"):
        for ws in (1, 2):
            t.append(Target("(e)", f"{wl}, ws={ws}: ddp_exp / hand-tuned, peak RSS per rank",
                            f"{wl}/ws{ws}/ddp_exp", f"{wl}/ws{ws}/tuned", rss, "<=", 1.2))
    b = workloads.spec("digits")["batch_size"]
    t.append(Target("C17", f"digits: ddp_exp ws=2 (b={b}) / ws=1 (b={2 * b}), samples/s",
                    f"c17/ws2/b{b}/ddp_exp", f"c17/ws1/b{2 * b}/ddp_exp", sps, ">=", 0.5))
    t.append(Target("perf", "digits, ws=2: ddp_exp perf_metrics on / off, samples/s",
                    "perf/ws2/perf-true/ddp_exp", "perf/ws2/perf-false/ddp_exp", sps, ">=", 0.98))
    t.append(Target("I11", "image folder, ws=2: ddp_exp / hand-written script, samples/s",
                    "image_folder/ws2/ddp_exp", "image_folder/ws2/handwritten", sps, ">=", 0.95))
    present = {v.key for vs in groups.values() for v in vs}
    return [x for x in t if x.num in present and x.den in present]


def threads_check(rows: list[dict]) -> list[str]:
    """C17's other half: ``threads_per_rank == max(1, cores // world_size)`` on every ddp_exp
    run (the runner unsets OMP_NUM_THREADS)."""
    cores = common.cores()
    lines = []
    for r in rows:
        if r["impl"] == "ddp_exp" and r["status"] == "ok" and r["repeat"] == 0:
            want = max(1, cores // r["world_size"])
            got = r.get("threads_per_rank")
            lines.append(f"{r['variant']}: threads_per_rank {got}, expected {want}: "
                         f"{'PASS' if got == want else 'MISS'}")
    return lines


# ------------------------------------------------------------------------------- reports
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
    md += ["## Targets (issues 5, 11, 13 and C17)", "",
           "Ratios of medians. `MISS by x%`: the ratio is x% short of (or over) the bound.", "",
           "| target | what | ratio | bound | result |", "|---|---|---|---|---|"]
    for t in targets:
        ratio = f"{t.ratio:.3f}" if t.ratio is not None else "n/a"
        md.append(f"| {t.name} | {t.what} | {ratio} | {t.op} {t.bound:g} | {t.verdict} |")
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
    extra = _extra_ratios(rows, groups)
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
    for name, variants in groups.items():
        md += ["", f"## {titles.get(name, name)}", ""] + group_table(rows, variants)
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
    misses = [t for t in targets if t.verdict.startswith("MISS")]
    analysis = os.path.join(BENCH, "analysis.md")
    if misses or os.path.exists(analysis):
        md += ["", "## Misses: why, and where the time goes", ""]
        md += [f"- {t.name} {t.what}: {t.ratio:.3f}, bound {t.op} {t.bound:g}: {t.verdict}"
               for t in misses]
        if os.path.exists(analysis):
            with open(analysis) as fh:
                md += ["", fh.read().rstrip()]
    with open(path, "w") as fh:
        fh.write("\n".join(md) + "\n")


def same_training(rows: list[dict], groups: dict[str, list[Variant]]) -> list[str]:
    out = []
    for wl in ("digits", "compute", "image_folder"):
        if wl not in groups:
            continue
        for ws in (1, 2):
            vals = {r["variant"].split("/", 2)[2]: r["val_loss"] for r in rows
                    if r["group"] == wl and r["world_size"] == ws and r["status"] == "ok"
                    and r["repeat"] == 0 and r.get("val_loss") is not None
                    and r["impl"] in ("ddp_exp", "tuned", "tight", "tutorial", "tutorial-1t",
                                      "handwritten")}
            if len(vals) > 1:
                spread = max(vals.values()) - min(vals.values())
                out.append(f"{wl}, ws={ws}: " + ", ".join(f"{k} {v:.6f}" for k, v in vals.items())
                           + f" (spread {spread:.1e}: {'same' if spread < 1e-4 else 'DIFFERENT'})")
    return out


def _median_other(rows: list[dict]) -> float:
    vals = [r["other_cpu_cores"] for r in rows if r.get("other_cpu_cores") is not None]
    return statistics.median(vals) if vals else float("nan")


def _extra_ratios(rows: list[dict], groups: dict[str, list[Variant]]) -> list[str]:
    out = []
    present = {v.key for vs in groups.values() for v in vs}
    pairs = [("digits/ws2/tutorial-1t", "digits/ws2/tutorial", "samples_per_sec",
              "digits ws=2, tutorial: 1 thread/rank vs default threads, samples/s"),
             ("compute/ws2/tutorial-1t", "compute/ws2/tutorial", "samples_per_sec",
              "compute ws=2, tutorial: 1 thread/rank vs default threads, samples/s"),
             ("digits/ws2/ddp_exp", "digits/ws2/tuned", "wall_s",
              "digits ws=2: ddp_exp / hand-tuned, wall s"),
             ("startup/ws2/ddp_exp", "startup/ws2/bare-elastic", "wall_s",
              "1-epoch job wall / bare elastic launch"),
             ("startup/ws2/ddp_exp", "startup/ws2/tuned", "wall_s",
              "1-epoch job wall: ddp_exp / hand-tuned script (which also builds DDP and trains)"),
             ("startup/ws2/bare-mp-spawn", "startup/ws2/bare-mp-fork", "wall_s",
              "bare launch: spawn / fork, wall s"),
             ("c17/ws4/b16/ddp_exp", "c17/ws1/b64/ddp_exp", "samples_per_sec",
              "C17: ddp_exp ws=4 (b=16) / ws=1 (b=64), samples/s")]
    for num, den, f, what in pairs:
        if num in present and den in present:
            a, b = stat(rows, num, f), stat(rows, den, f)
            if a and b and b.median:
                out.append(f"{what}: {a.median / b.median:.3f}")
    return out


# ----------------------------------------------------------------------------------- main
def warm_up(timeout_s: float) -> None:
    """One untimed process that imports what the runs import, so the first measured run does
    not pay for a cold page cache."""
    code = ("import torch, torch.distributed, torch.nn.parallel, torch._dynamo, hydra, omegaconf,"
            " torch.utils.tensorboard, ddp_exp.__main__\n"
            "try:\n    import lightning\nexcept ImportError:\n    pass\n")
    timed_process([PY, "-c", code], False, timeout_s)


def check_data(groups: dict[str, list[Variant]]) -> str:
    done = []
    for wl, num_train, path in sorted({(v.workload, v.num_train, v.data_path)
                                       for vs in groups.values() for v in vs}, key=str):
        workloads.check_against_ddp_exp(wl, num_train, path)
        done.append(wl + (f" (num_train {num_train})" if num_train else ""))
    return ("benchmark data identical to ddp_exp.data's for " + ", ".join(done)
            + (" (image folder: files, split, decoded pixels and initial CNN weights)"
               if "image_folder" in done else "") + ".")


def image_folder(groups: dict[str, list[Variant]]) -> str | None:
    """Write the digits as PNG files into a new temporary folder if a variant reads them, and
    point those variants at it; returns the folder (the caller deletes it) or None."""
    readers = [v for vs in groups.values() for v in vs if v.workload == "image_folder"]
    if not readers:
        return None
    root = workloads.write_digits_pngs(tempfile.mkdtemp(prefix="ddp_exp-bench-images-"))
    for v in readers:
        v.data_path = root
    return root


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="interleaved runs per variant")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 1 repeat, 1 epoch, small compute set")
    p.add_argument("--only", default=None,
                   help="comma-separated groups: digits,compute,startup,c17,perf,image_folder")
    p.add_argument("--impls", default=None,
                   help="comma-separated variants to keep in the chosen groups, by key suffix: "
                        "e.g. 'defaults/ddp_exp,tight' (default: all)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--csv", default=os.path.join(BENCH, "results.csv"))
    p.add_argument("--markdown", default=os.path.join(ROOT, "BENCHMARKS.md"))
    p.add_argument("--keep-outputs", default=None,
                   help="copy every run's output folder here (default: deleted)")
    args = p.parse_args(argv)
    if args.quick and "--repeats" not in (argv if argv is not None else sys.argv):
        args.repeats = 1
    groups = build_variants(args.quick)
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - set(groups)
        if unknown:
            p.error(f"unknown group(s) {sorted(unknown)}; choose from {sorted(groups)}")
        groups = {g: groups[g] for g in wanted}
    if args.impls:
        keep = args.impls.split(",")
        groups = {g: [v for v in vs if any(v.key.endswith("/" + k) for k in keep)]
                  for g, vs in groups.items()}
        groups = {g: vs for g, vs in groups.items() if vs}
    load = os.getloadavg()[0]
    if load > 1.0:
        print(f"warning: load average {load:.2f} on {common.cores()} cores: other work is "
              "running, the figures will be noisy", flush=True)
    images = image_folder(groups)
    try:
        info = {"data_check": check_data(groups)}
        print(info["data_check"], flush=True)
        warm_up(args.timeout)
        t0 = time.time()
        rows, more = run_groups(groups, args.repeats, args.timeout, args.keep_outputs,
                                log=lambda s: print(s, flush=True))
    finally:
        if images:
            shutil.rmtree(images, ignore_errors=True)
    info.update(more)
    targets = build_targets(groups)
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
    failed = [r for r in rows if r["status"] in ("failed", "timeout")]
    if failed:
        print(f"{len(failed)} run(s) failed: see the note column of {args.csv}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
