"""The elastic agent's start of its ranks: every rank forked before any connects, and a signal
that comes during the forks held until the ranks exist; and its wait for them: a rank that
ended with exit code 0 without its result is a failure. Patches torch 2.13's
``LocalElasticAgent._start_workers``, ``MultiprocessContext._start`` and
``MultiprocessContext._poll`` (private), only on torch 2.13.x (:mod:`ddp_exp.compat.versions`);
on any other torch the agent starts and waits for its ranks as torch's own does, and the log
says so once.

torch's ``_poll`` counts a rank as finished once its result is on its queue, and a process that
exited with code 0 as no failure: a rank that called ``os._exit(0)`` (or a native library's
``exit(0)``) part-way left the agent polling for that result for ever (round 4, a hang with
no line). :func:`start_ranks_safely` reports it as the rank's failure at the next poll
(:func:`ddp_exp.rank.failures.world_failure` gives its line).

What the patch buys: it prevents a hang (below) and a lost Ctrl-C (a run that trained on to the
end, :func:`start_ranks_safely`). The agent's wait for its ranks is torch's own loop, a check
every ``launcher.monitor_interval_s`` (0.1 s): a patch that woke it on a rank's result or exit
instead bought milliseconds (a 2-rank launch's end: 54 ms after the ranks returned against
81 ms, and 9 ms less of the launcher's CPU per 4 s of training, measured in session 34) and was
dropped (issue 27 item 3).

With ``launcher.start_method=fork``, :func:`start_ranks_safely` holds each forked rank
(:func:`pass_fork_gate`, first thing in :func:`ddp_exp.rank.worker.run_rank`) until the agent has
forked them all. A rank that connected to the agent's ``TCPStore`` while the agent was still
forking made the store's server thread format the peer's address (glibc ``getnameinfo``, which
takes the resolver's lock); a rank forked at that moment inherited the lock held, with no
thread to release it, and hung for good in its own first ``getnameinfo`` (seen here as a rare
start-up hang of 3- and 4-rank worlds, the stuck rank's native stack in
``__resolv_context_get``). Forking a process that has threads copies only the forking thread:
whatever lock another thread held stays held in the child.

Used by :mod:`ddp_exp.launch.elastic` around ``elastic_launch``.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import Any

from ddp_exp.compat.versions import written_for

# "<read fd>,<write fd>" of the pipe that holds forked ranks until all are forked.
FORK_GATE_ENV = "DDP_EXP_FORK_GATE"
# Where a rank start on another torch is logged (ddp_exp.compat.versions).
STOCK_START = ("the agent starts its ranks as torch does: a signal during the forks is not "
               "held back, forked ranks are not held until all are forked, and a rank that "
               "exits with code 0 part-way is waited for")

# Held back while the agent forks its ranks (start_ranks_safely), until the ranks exist.
START_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# The signals torch's agent handles by default (TORCHELASTIC_SIGNALS_TO_HANDLE), and those of
# them ignored when this process started (read when ddp_exp's entry imports this module, before
# any handler of ours): ``nohup`` ignores SIGHUP, a shell's background job SIGINT and SIGQUIT.
AGENT_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
                      if hasattr(signal, n))
IGNORED_AT_START = frozenset(s for s in AGENT_SIGNALS if signal.getsignal(s) is signal.SIG_IGN)
# The signals that came while the agent forked its ranks (a forked rank inherits the list).
_held: list[int] = []
# The elastic agent of this process whose ranks run now (set at each start of its ranks).
_running: list[Any] = []


def rank_pids() -> list[int]:
    """PIDs of the rank processes the running elastic agent of this process started (its
    process context's ``pids()``, read through the agent's private ``_pcontext``), empty before
    the first start, and always on a torch other than 2.13 (:func:`start_ranks_safely` records
    no agent there); never the ranks' own children (DataLoader workers)."""
    try:
        return [int(pid) for pid in _running[-1]._pcontext.pids().values()]
    except (IndexError, AttributeError):
        return []


def _hold(signum: int, frame: Any) -> None:
    """The agent's handler of :data:`START_SIGNALS` while it forks: note the signal."""
    del frame
    _held.append(signum)


@contextlib.contextmanager
def start_ranks_safely(fork: bool, after_start: Any = None,
                       before_stop: Any = None) -> Iterator[None]:
    """While open, each start of the local ranks by an elastic agent of this process (the
    first, and each restart) holds SIGINT and SIGTERM back while it starts the rank processes,
    and raises the first one that came (torch's handler: ``SignalException``, the agent stops
    the ranks: interrupted) once every rank is started and known to the agent. A signal ignored
    when the command started (:data:`IGNORED_AT_START`: ``nohup``'s SIGHUP) is ignored again
    before the forks, in the agent and so in every rank, where torch's agent had installed its
    handler (pytorch/pytorch #76894). Before, a
    signal that came while the agent forked was raised by torch's handler inside Python's
    after-fork hooks, which print "Exception ignored" and drop it: the run trained on to the
    end, or a rank that had it raised it as a failure. (A thread's signal mask cannot hold it
    back: the kernel hands a process's signal to any thread that does not block it, the
    store's among them.)

    While open, the agent's poll of its ranks also fails a rank whose process ended with exit
    code 0 before it handed back its result (:func:`_ended_without_result`), as it fails one
    that exited with another code: the other ranks are stopped.

    With ``fork`` (``start_method=fork``), also opens a pipe whose ends the ranks inherit
    (named in :data:`FORK_GATE_ENV`) and closes the agent's ends once every rank is forked:
    :func:`pass_fork_gate` waits for that in each rank. A spawned rank inherits no pipe.
    ``after_start``: called with no argument once the ranks of a start are known (:func:`rank_pids`
    lists them): a preemption signal that came during the forks is passed on then.
    ``before_stop``: called once per start of the ranks, as ``before_stop(error_file,
    running)``, when the poll finds a rank failed (exit code other than 0; its ``@record``
    error file's path) and ranks still running (``running``: local rank -> PID), before torch's
    poll stops them (:func:`ddp_exp.rank.stacks.on_rank_failure` asks them for their stacks).

    Kept (issue 27 item 3) because it prevents hangs (the poll above; a forked rank stuck for
    good in ``getnameinfo``, the module's docstring) and a wrong result (a Ctrl-C during the forks
    dropped: the run trained on). On a torch other than 2.13.x it patches nothing (torch's own
    start, ``after_start`` never called) and logs :data:`STOCK_START` once."""
    import threading

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

    if not written_for("torch", "start_ranks_safely (LocalElasticAgent._start_workers)",
                       STOCK_START):
        yield
        return
    start_workers, start_processes = LocalElasticAgent._start_workers, MultiprocessContext._start
    poll = MultiprocessContext._poll

    def _poll(self: Any) -> Any:  # a rank ended with exit code 0 and no result: failed
        if before_stop is not None and self._pc is not None:
            _before_stop(self, before_stop)
        result = poll(self)
        if result is not None or self._pc is None:
            return result
        ended = _ended_without_result(self)
        if ended is None:
            return None
        from torch.distributed.elastic.multiprocessing.api import RunProcsResult
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        failure = ProcessFailure(local_rank=ended, pid=self._pc.processes[ended].pid,
                                 exitcode=0, error_file=self.error_files[ended])
        self.close()  # the other ranks are stopped, as for a rank that failed
        return RunProcsResult(failures={ended: failure}, stdouts=self.stdouts,
                              stderrs=self.stderrs)

    def _start(self: Any) -> Any:  # after torch has set its handlers, around the forks
        if threading.current_thread() is not threading.main_thread():
            return start_processes(self)
        for sig in IGNORED_AT_START:  # torch's handler replaced SIG_IGN (nohup, R11)
            signal.signal(sig, signal.SIG_IGN)
        handlers = {sig: signal.signal(sig, _hold) for sig in START_SIGNALS
                    if sig not in IGNORED_AT_START}
        try:
            return start_processes(self)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _start_workers(self: Any, worker_group: Any) -> Any:
        _held.clear()
        read_fd, write_fd = os.pipe() if fork else (-1, -1)
        if fork:
            os.environ[FORK_GATE_ENV] = f"{read_fd},{write_fd}"
        try:
            started = start_workers(self, worker_group)
        finally:  # every rank is started (or the start failed): their reads end
            if fork:
                os.environ.pop(FORK_GATE_ENV, None)
                os.close(write_fd)
                os.close(read_fd)
        _running[:] = [self]
        if after_start is not None:
            after_start()
        if _held:  # the agent knows its ranks now: its handler stops them
            signal.raise_signal(_held[0])
        return started

    LocalElasticAgent._start_workers = _start_workers
    MultiprocessContext._start = _start
    MultiprocessContext._poll = _poll
    try:
        yield
    finally:
        LocalElasticAgent._start_workers = start_workers
        MultiprocessContext._start = start_processes
        MultiprocessContext._poll = poll
        _running.clear()


def _before_stop(context: Any, before_stop: Any) -> None:
    """``before_stop(error_file, running)`` the first time a poll of ``context`` (torch's
    ``MultiprocessContext``) finds a rank failed while others run: torch's poll
    (``ProcessContext.join``) stops the others as soon as it sees the failure."""
    if getattr(context, "_ddp_exp_failure_seen", False):
        return
    processes = context._pc.processes
    failed = [i for i, process in enumerate(processes) if process.exitcode not in (None, 0)]
    if not failed:
        return
    context._ddp_exp_failure_seen = True
    running = {i: process.pid for i, process in enumerate(processes) if process.exitcode is None}
    if running:
        before_stop(context.error_files[failed[0]], running)


def _ended_without_result(context: Any) -> int | None:
    """The local rank of a process of ``context`` (torch's ``MultiprocessContext``, just
    polled) that ended with exit code 0 and never handed back its function's result, if any.
    A rank that returns puts its result on its queue and then waits, until the agent has read
    every rank's, before it exits (torch's ``_wrap``): one that ended first (``os._exit(0)``, a
    native library's ``exit(0)``) left the agent waiting for that result for ever."""
    for local_rank, process in enumerate(context._pc.processes):
        if process.exitcode == 0 and local_rank not in context._return_values:
            return local_rank
    return None


def pass_fork_gate() -> None:
    """In a rank, first thing: SIGINT and SIGTERM end the rank at once, unless ignored when the
    command started (:data:`IGNORED_AT_START`) (the default action:
    a forked rank inherits the agent's Python handlers, and with them a rank blocked in native
    code ignored SIGTERM until the launcher's grace period ended); one that came while the
    agent forked (held back, :func:`start_ranks_safely`) ends the rank now. Then wait until
    the agent has forked every rank of this start, before the rank's first connection; no
    wait where there is no gate (spawned ranks, torchrun, srun). The wait is a pipe's read,
    which ends when every copy of its write end is closed: this rank's (closed here), the
    agent's (closed after the last fork, or when the agent dies) and those of the ranks forked
    before this one (closed as each passes here or exits)."""
    for sig in START_SIGNALS:
        if sig not in IGNORED_AT_START:
            signal.signal(sig, signal.SIG_DFL)
    if _held:  # came while the agent forked (to it or to this rank): the world is stopping
        signal.raise_signal(_held[0])
    gate = os.environ.pop(FORK_GATE_ENV, None)
    if gate is None:
        return
    read_fd, write_fd = (int(fd) for fd in gate.split(","))
    os.close(write_fd)
    try:
        while os.read(read_fd, 1):  # nothing is ever written: b"" once all writers closed
            pass
    finally:
        os.close(read_fd)
