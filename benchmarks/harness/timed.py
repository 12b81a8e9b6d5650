"""One timed process: start it in its own session, poll its process tree in ``/proc`` while it
runs (each rank's ``VmHWM``; on request the world's ``Pss``), reap it with ``wait4`` (exit
status, its CPU time) and end whatever it left behind; the cores other processes kept busy
meanwhile come from ``/proc/stat``.

May use: the standard library and ``benchmarks.common`` (the repository's root). Used by
``measure``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

from benchmarks import common

ROOT = common.ROOT
POLL_S = 0.05
# smaps_rollup walks the process's page tables: ~10 ms for a 300 MiB rank on this machine,
# so the world's PSS is read 20x less often than VmHWM, and only where a variant asks for it.
DROPPED_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
HELPERS = ("resource_tracker", "semaphore_tracker", "forkserver")  # not ranks


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


def _proc_kib(path: str, key: str) -> int | None:
    """The value (kB) of the line starting with ``key`` in a ``/proc`` file; None when the
    process is gone or has no such line."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _vm_hwm_kib(pid: int) -> int | None:
    return _proc_kib(f"/proc/{pid}/status", "VmHWM:")


def _pss_kib(pid: int) -> int | None:
    """The process's proportional set size (``Pss`` of ``/proc/<pid>/smaps_rollup``, KiB): its
    private pages plus each shared page divided by the number of processes mapping it."""
    return _proc_kib(f"/proc/{pid}/smaps_rollup", "Pss:")


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
    own children (DataLoader workers, compile workers) are not ranks and are not read.

    ``pss_poll_s`` > 0: also, every ``pss_poll_s`` seconds, the sum of ``Pss`` over ``root``
    and its children (multiprocessing's helpers excluded): the world's memory with each page
    shared by fork counted once; ``world_pss_kib`` is the largest sum seen (None: never read)."""

    def __init__(self, root: int, pss_poll_s: float = 0.0):
        super().__init__(daemon=True)
        self.root, self.stop, self.pss_poll_s = root, threading.Event(), pss_poll_s
        self.peak: dict[int, int] = {}
        self.cmd: dict[int, str] = {}
        self.world_pss_kib: int | None = None

    def sample(self) -> None:
        for pid in [self.root, *_children(self.root)]:
            hwm = _vm_hwm_kib(pid)
            if hwm is not None:
                self.peak[pid] = max(self.peak.get(pid, 0), hwm)
                if pid not in self.cmd:
                    self.cmd[pid] = _cmdline(pid)

    def sample_pss(self) -> None:
        pids = [pid for pid in [self.root, *_children(self.root)]
                if not any(h in self.cmd.get(pid, "") for h in HELPERS)]
        values = [v for v in map(_pss_kib, pids) if v is not None]
        if values:
            self.world_pss_kib = max(self.world_pss_kib or 0, sum(values))

    def run(self) -> None:
        next_pss = 0.0
        while not self.stop.is_set():
            self.sample()
            if self.pss_poll_s and time.monotonic() >= next_pss:
                self.sample_pss()
                next_pss = time.monotonic() + self.pss_poll_s
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
    world_pss_mib: float | None = None  # largest sum of Pss over the world (pss_poll_s > 0)


def _busy_cpu_s() -> float:
    """CPU-seconds the whole machine has been busy since boot (``/proc/stat``)."""
    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = f
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def timed_process(argv: list[str], root_is_rank: bool, timeout_s: float,
                  cwd: str = ROOT, pss_poll_s: float = 0.0) -> Run:
    """Start ``argv`` (its own session), time it to its exit, sample its ranks' peak RSS (and
    with ``pss_poll_s`` > 0 the world's PSS: :class:`RssSampler`), and estimate how many cores other
    processes kept busy meanwhile (all busy CPU time minus the run's own, from ``wait4``, over
    the wall time; the sampler's own reads count as other work)."""
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        busy0 = _busy_cpu_s()
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        sampler = RssSampler(proc.pid, pss_poll_s)
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
        pss_mib = sampler.world_pss_kib / 1024.0 if sampler.world_pss_kib is not None else None
        return Run(rc, wall, sampler.rank_peaks_mib(root_is_rank), out.read(), err.read(),
                   timed_out, max(0.0, (busy - own) / wall) if wall > 0 else None, pss_mib)


def _reap_session(sid: int) -> None:
    """A rank left behind by a failed run would skew every later one: end the run's own
    session (the process group this run created), if anything is left in it."""
    try:
        os.killpg(sid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
