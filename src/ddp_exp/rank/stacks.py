"""Where the other ranks were when one rank's collective timed out: their stacks, asked for by
the launcher before it stops them.

A rank that stalls (a Dataset that blocks, a ``time.sleep`` or a deadlock in the user's code, a
rank that runs one collective more than the others) fails nobody itself: its peers time out in
their next collective after ``distributed.timeout_s`` and the first of them is reported,
``rank 0 failed: RuntimeError: ... Timed out waiting 8000ms for recv operation to complete``,
which names the rank that waited, not the one it waited for (round 4). The launcher then stops
the ranks still running, and with them the only record of where the stalled one was.

So every rank started by ddp_exp's launcher registers :mod:`faulthandler` on :data:`SIGNAL`
(:func:`listen`): on that signal the rank's threads' Python stacks are written, from the signal
handler itself (no Python code runs: it works while the rank is blocked in native code), into
an anonymous in-memory file of the rank (``memfd_create``, gone with the process: nothing is
written to disk unless asked). When a rank failed because a collective timed out
(:func:`ddp_exp.compat.messages.collective_timed_out`) and others are still running, the
launcher's agent sends them :data:`SIGNAL` before it stops them and reads their files through
``/proc/<pid>/fd`` (:func:`on_rank_failure`, :func:`take`; called from the agent's poll,
:func:`ddp_exp.compat.elastic_agent.start_ranks_safely`). :func:`keep` writes each to
``<job_dir>/errors/rank<R>.stacks.txt`` and gives the note the failure's line ends with:
``rank 1 was still running, at sleepy.py:9 in forward``.

Under ``torchrun`` (or ``srun``) the launcher is not ours: the rank whose collective timed out
asks this node's other ranks itself, found as its siblings under the agent
(:func:`of_node_peers`); ranks on other nodes are not reached. Linux only (``memfd_create``,
real-time signals, ``/proc``): elsewhere :func:`listen` does nothing and the line is torch's as
before.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import time
from typing import Any

# A real-time signal: none of those a job or a scheduler sends (SIGTERM, SIGINT, SIGHUP,
# SIGQUIT, SIGUSR1/2 all stop or preempt the job: ddp_exp.rank.preemption).
SIGNAL = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else None
MEMFD_NAME = "ddp_exp-stacks"
WAIT_S = 2.0  # the most the launcher waits for a rank's stacks before it stops the ranks
_fd: list[int] = []  # this rank's in-memory file, kept open while the process lives
_taken: dict[int, str] = {}  # in the launcher: local rank -> its stacks, as last taken
# faulthandler's frame line: '  File "/path/x.py", line 9 in forward'
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")


def listen() -> None:
    """In a rank: write every thread's Python stack to this process's in-memory file when
    :data:`SIGNAL` comes (:func:`faulthandler.register`; no Python runs in the handler). Once
    per process; nothing where the platform has no ``memfd_create`` or real-time signals."""
    if _fd or SIGNAL is None or not hasattr(os, "memfd_create"):
        return
    try:
        fd = os.memfd_create(MEMFD_NAME)  # close-on-exec; forked DataLoader workers share it
        faulthandler.register(SIGNAL, file=fd, all_threads=True)
    except (OSError, RuntimeError, ValueError):
        return
    _fd.append(fd)


def _memfd_path(pid: int) -> str | None:
    """``/proc/<pid>/fd/<n>`` of rank ``pid``'s in-memory stack file, None if it has none."""
    folder = f"/proc/{pid}/fd"
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    for name in names:
        try:
            if os.readlink(os.path.join(folder, name)).startswith(f"/memfd:{MEMFD_NAME}"):
                return os.path.join(folder, name)
        except OSError:
            continue
    return None


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _read(path: str, start: int) -> str:
    """What the file at ``path`` holds from byte ``start`` on (a new open of it: its own
    offset)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(start)
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def take(pids: dict[int, int], wait_s: float = WAIT_S) -> dict[int, str]:
    """In the launcher: ask the ranks ``pids`` (local rank -> PID, still running) for their
    stacks (:data:`SIGNAL`) and read what each writes after it (an earlier request's text
    stays in the file), waiting up to ``wait_s`` seconds in all for each rank's to be written
    whole (its length unchanged over 50 ms). A rank with no such file (it does not listen:
    :func:`listen`) is left out; one that wrote nothing in time (stopped, or gone) gets "".
    The result is also kept for :func:`keep`.

    Returns:
        local rank -> the text faulthandler wrote (every thread, innermost frame first).
    """
    paths = {rank: _memfd_path(pid) for rank, pid in pids.items()}
    paths = {rank: path for rank, path in paths.items() if path is not None}
    start = {rank: _size(path) for rank, path in paths.items()}  # an earlier request's text
    for rank in paths:
        try:
            os.kill(pids[rank], SIGNAL)
        except (OSError, TypeError):
            paths[rank] = ""
    deadline, seen = time.monotonic() + wait_s, dict.fromkeys(paths, "")
    waiting = {rank for rank, path in paths.items() if path}
    while waiting and time.monotonic() < deadline:
        time.sleep(0.05)
        for rank in list(waiting):
            text = _read(paths[rank], start[rank])
            if text and text == seen[rank]:  # written and not growing: whole
                waiting.discard(rank)
            seen[rank] = text
    _taken.clear()
    _taken.update(seen)
    return dict(_taken)


def where(text: str, package_dirs: tuple[str, ...] = ()) -> str | None:
    """Where the rank whose stacks are ``text`` (faulthandler's) was: the innermost frame of
    its main thread (the thread whose outermost frame is the rank's entry, else the first
    listed) outside ``package_dirs`` (torch's and the standard library's folders) and outside
    ddp_exp, as ``file.py:LINE in FUNCTION``; else its innermost frame outside
    ``package_dirs``; None when ``text`` lists no frame."""
    threads: list[list[tuple[str, str, str]]] = []
    for line in text.splitlines():
        if _THREAD.match(line):
            threads.append([])
        elif (frame := _FRAME.match(line)) and threads:
            threads[-1].append(frame.groups())
    threads = [frames for frames in threads if frames]
    if not threads:
        return None
    main = next((frames for frames in threads
                 if any(fn == "run_rank" for _, _, fn in frames)), threads[0])
    outside = [f for f in main if not f[0].startswith(package_dirs)]
    own = [f for f in outside if f"{os.sep}ddp_exp{os.sep}" not in f[0]]
    file, line, fn = (own or outside or main)[0]
    return f"{os.path.basename(file)}:{line} in {fn}"


def _library_dirs() -> tuple[str, ...]:
    """The folders whose frames say nothing of where a rank was: torch's, the standard
    library's."""
    import sysconfig

    import torch

    return (os.path.dirname(torch.__file__) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep)


def keep(job_dir: str, first_rank: int | None) -> str:
    """Write the stacks :func:`take` took last to ``<job_dir>/errors/rank<R>.stacks.txt`` (``R``
    the global rank: ``first_rank`` + local rank; ``local_rank<N>.stacks.txt`` where
    ``first_rank`` is None: a node of a multi-node world with dynamic ranks) and forget them.
    Returns the note the failure's line ends with (``rank 1 was still running, at
    sleepy.py:9 in forward (its threads' stacks: <path>)``), "" when none were taken."""
    from ddp_exp.io.files import atomic_write

    taken = dict(_taken)
    _taken.clear()
    notes = []
    for local_rank, text in sorted(taken.items()):
        # This node's ranks are first_rank, first_rank + 1, ...; unknown: their local ranks.
        name = f"rank {first_rank + local_rank}" if first_rank is not None else (
            f"local rank {local_rank}")
        if not text:
            notes.append(f"{name} was still running and gave no stacks within {WAIT_S:g} s")
            continue
        path = os.path.join(job_dir, "errors", f"{name.replace(' ', '')}.stacks.txt")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_write(path, lambda fh, text=text: fh.write(text.encode()))
        except OSError:
            path = "not kept: the job folder could not be written"
        at = where(text, _library_dirs())
        notes.append(f"{name} was still running{f', at {at}' if at else ''}"
                     f" (its threads' stacks: {path})")
    return "; ".join(notes)


def on_rank_failure(error_file: str, running: dict[int, int]) -> None:
    """The launcher's agent saw a rank fail (its error file ``error_file``, written by
    ``@record``; absent for a rank killed by a signal) while the ranks ``running`` (local rank
    -> PID) still run, before it stops them: where that failure is a collective's timeout
    (:func:`ddp_exp.compat.messages.collective_timed_out`), :func:`take` their stacks; else
    forget any taken before (a restarted world's)."""
    import json

    from ddp_exp.compat.messages import collective_timed_out

    _taken.clear()
    try:
        with open(error_file, encoding="utf-8") as fh:
            message: Any = json.load(fh)
    except (OSError, ValueError):
        return
    while isinstance(message, dict):  # {"message": {"message": "RuntimeError: ...", ...}}
        message = message.get("message")
    if isinstance(message, str) and collective_timed_out(message):
        take(running)


def node_peers() -> dict[int, int]:
    """Under ``torchrun`` (or any launcher that starts each rank as a child process of its
    own): this node's other ranks, global rank -> PID, found as the processes whose parent is
    this one's (the agent) and whose environment names a ``RANK`` (``/proc``); a rank's own
    DataLoader workers are its children, not the agent's. Empty where ``/proc`` cannot be
    read."""
    me, agent = os.getpid(), os.getppid()
    found = {}
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return {}
    for pid in pids:
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
                parent = int(fh.read().rsplit(")", 1)[1].split()[1])  # after "(comm)"
            if parent != agent:
                continue
            with open(f"/proc/{pid}/environ", "rb") as fh:
                names = fh.read().split(b"\0")
            rank = next((int(v[5:]) for v in names if v.startswith(b"RANK=")), None)
        except (OSError, ValueError, IndexError):
            continue
        if rank is not None:
            found[rank] = pid
    return found


def of_node_peers(job_dir: str, message: str) -> str:
    """In a rank that ``torchrun`` (or ``srun``) started and that fails with ``message``: where
    that failure is a collective's timeout, the note of where this node's other ranks still
    running are (:func:`node_peers`, :func:`take`, :func:`keep`; their stacks are kept in
    ``<job_dir>/errors/``), else "". The launcher's own agent asks for them under ddp_exp's
    launcher (:func:`on_rank_failure`)."""
    from ddp_exp.compat.messages import collective_timed_out

    if not collective_timed_out(message):
        return ""
    peers = node_peers()
    if not peers:
        return ""
    take(peers)
    return keep(job_dir, first_rank=0)  # the keys are global ranks already


def forget() -> None:
    """Drop stacks taken and not kept (a launch's start: a restarted world's earlier failure)."""
    _taken.clear()
