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
``rank 1 was still running, at sleepy.py:9 in forward``. A rank's DataLoader workers (forked:
they share its handler and file) are asked after it, so that a Dataset that stalls is named
(``..., its DataLoader worker at data.py:16 in __getitem__``); a rank stopped by ``kill -STOP``
is said to be stopped; ranks no longer in their training (failing too) are left out.

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
STOPPED = "\0stopped"  # take()'s text for a rank that was stopped (SIGSTOP, Ctrl-Z)
_fd: list[int] = []  # this rank's in-memory file, kept open while the process lives
_taken: dict[int, str] = {}  # in the launcher: local rank -> its stacks, as last taken
# faulthandler's frame line: '  File "/path/x.py", line 9 in forward'
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_THREAD = re.compile(r"^((Current thread|Thread) 0x[0-9a-f]+|Stack) \(most recent call first\)")


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
    :func:`listen`) is left out; one that wrote nothing in time (gone) gets ""; a stopped one
    (``kill -STOP``) gets :data:`STOPPED` and is continued (``SIGCONT``), so that the stop of
    the world that follows ends it at once (torch's SIGTERM waited 30 s for it, then killed
    it). The result is also kept for :func:`keep`.

    Returns:
        local rank -> the text faulthandler wrote (every thread, innermost frame first).
    """
    paths = {rank: _memfd_path(pid) for rank, pid in pids.items()}
    paths = {rank: path for rank, path in paths.items() if path is not None}
    start = {rank: _size(path) for rank, path in paths.items()}  # an earlier request's text
    stopped = {rank for rank in paths if _stopped(pids[rank])}
    for rank in paths:
        try:
            if rank in stopped:  # it cannot answer; continued, the stop that follows ends it
                os.kill(pids[rank], signal.SIGCONT)  # at once (SIGTERM waited 30 s for it)
                paths[rank] = ""
            else:
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
    for rank, text in seen.items():  # its children's (DataLoader workers): after the rank's
        if text:
            seen[rank] = text + _children_stacks(pids[rank], paths[rank], deadline)
    seen.update(dict.fromkeys(stopped, STOPPED))
    _taken.clear()
    _taken.update(seen)
    return dict(_taken)


CHILD = "--- child process {pid} (a DataLoader worker), its stacks:"


def _children_stacks(pid: int, path: str, deadline: float) -> str:
    """The stacks of rank ``pid``'s child processes that share its file ``path`` (forked
    DataLoader workers inherit the handler and the file), asked one at a time until
    ``deadline`` (``time.monotonic()``), each under a :data:`CHILD` line."""
    out = ""
    for child in _children(pid):
        if _memfd_path(child) is None or _stopped(child) or time.monotonic() >= deadline:
            continue
        start = _size(path)
        try:
            os.kill(child, SIGNAL)
        except OSError:
            continue
        text = ""
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = _read(path, start)
            if now and now == text:
                break
            text = now
        if text:
            out += "\n" + CHILD.format(pid=child) + "\n" + text
    return out


def _children(pid: int) -> list[int]:
    """The PIDs whose parent is ``pid`` (``/proc``), in order."""
    try:
        pids = sorted(int(name) for name in os.listdir("/proc") if name.isdigit())
    except OSError:
        return []
    return [child for child in pids if (_stat(child) or ("", -1))[1] == pid]


def _stat(pid: int) -> tuple[str, int] | None:
    """Process ``pid``'s state letter and parent PID (``/proc/<pid>/stat``, the fields after
    its ``(comm)``, which may hold spaces); None when it cannot be read (gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            state, parent = fh.read().rsplit(")", 1)[1].split()[:2]
        return state, int(parent)
    except (OSError, ValueError):
        return None


def where(text: str, package_dirs: tuple[str, ...] = ()) -> str | None:
    """Where the rank whose stacks are ``text`` (faulthandler's) was: in the thread that runs
    its training (the one with the rank's entry in it: :data:`ENTRIES`; else the first listed),
    the innermost frame of the user's code (outside ``package_dirs``, the installed libraries'
    and the standard library's folders, outside ddp_exp, not ``<string>``), as
    ``file.py:LINE in FUNCTION``; else its innermost frame of ddp_exp's, followed by the
    library frame it waits in (``loaders.py:181 in __iter__ (inside dataloader.py:1284 in
    _try_get_data)``: a DataLoader worker that stalls); None when ``text`` lists no frame."""
    parts = text.split("\n" + CHILD.split("{")[0])  # the rank's, then each worker's
    main = _training_thread(parts[0])
    if not main:
        return None
    user = _users(main, package_dirs)
    if user:
        return _frame(user[0])
    own = [f for f in main if _ours(f)]
    if not own:
        return _frame(main[0])
    inside = next((f for f in main if "site-packages" in f[0] or "dist-packages" in f[0]),
                  main[0])
    said = _frame(own[0]) + (f" (inside {_frame(inside)})" if inside is not own[0] else "")
    for child in parts[1:]:  # a DataLoader worker in the user's Dataset: where it is
        frames = _training_thread(child)
        user = _users(frames, package_dirs)
        if user:
            return f"{said}, its DataLoader worker at {_frame(user[0])}"
    return said


def _ours(frame: tuple[str, str, str]) -> bool:
    return f"{os.sep}ddp_exp{os.sep}" in frame[0]


def _users(frames: list[tuple[str, str, str]], package_dirs: tuple[str, ...]
           ) -> list[tuple[str, str, str]]:
    """The frames of the user's code: outside ``package_dirs`` and ddp_exp, not ``<...>``."""
    return [f for f in frames
            if not f[0].startswith(package_dirs) and not f[0].startswith("<") and not _ours(f)]


# The functions of a rank's training thread, outermost to innermost: ddp_exp's launcher's rank,
# torchrun's, the training both run.
ENTRIES = ("run_rank", "run_under_torchrun", "train_rank")
TRAINING = "train_rank"


def _training_thread(text: str) -> list[tuple[str, str, str]]:
    """The frames (file, line, function; innermost first) of the thread in faulthandler's
    ``text`` that runs the rank (one with a function of :data:`ENTRIES`), else of the first
    thread listed; [] when ``text`` lists no frame."""
    threads: list[list[tuple[str, str, str]]] = []
    for line in text.splitlines():
        if _THREAD.match(line):
            threads.append([])
        elif (frame := _FRAME.match(line)) and threads:
            threads[-1].append(frame.groups())
    threads = [frames for frames in threads if frames]
    if not threads:
        return []
    return next((frames for frames in threads if any(fn in ENTRIES for _, _, fn in frames)),
                threads[0])


def still_training(text: str) -> bool:
    """Whether the rank whose stacks are ``text`` was still in its training (:data:`TRAINING`
    on its thread's stack); False for one already failing or ending (its training has raised:
    a peer that timed out too, or one whose collective broke and waits to exit)."""
    return any(fn == TRAINING for _, _, fn in _training_thread(text))


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (``T``: SIGSTOP, Ctrl-Z; :func:`_stat`)."""
    return (_stat(pid) or ("", -1))[0] == "T"


def _frame(frame: tuple[str, str, str]) -> str:
    file, line, fn = frame
    return f"{os.path.basename(file)}:{line} in {fn}"


def _library_dirs() -> tuple[str, ...]:
    """The folders whose frames say nothing of where a rank was: the standard library's and
    every installed package's (site-packages: torch, Hydra, ...)."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    dirs = {paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"],
            *site.getsitepackages()}
    return tuple(sorted(os.path.join(d, "") for d in dirs if d))


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
        if text and text != STOPPED and not still_training(text):
            continue  # failing too, or ending: not where the world was held
        # This node's ranks are first_rank, first_rank + 1, ...; unknown: their local ranks.
        name = f"rank {first_rank + local_rank}" if first_rank is not None else (
            f"local rank {local_rank}")
        if text == STOPPED:
            notes.append(f"{name} was stopped (SIGSTOP, Ctrl-Z): it gave no stacks")
            continue
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
    me, found = os.getpid(), {}
    for pid in _children(os.getppid()):
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                names = fh.read().split(b"\0")
            rank = next((int(v[5:]) for v in names if v.startswith(b"RANK=")), None)
        except (OSError, ValueError):
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
