"""A process that ends with its parent: a rank's DataLoader workers with their rank, a rank with
its launcher (:mod:`ddp_exp.rank.parent`).

:func:`die_with_parent` asks the kernel for SIGKILL when the parent dies (Linux
``prctl(PR_SET_PDEATHSIG)``; the kernel sends it when the parent *thread* that started this
process exits), then closes the race the ``prctl`` leaves: a parent that died before it (this
process was adopted by init or a subreaper) ends this process at once.

A fork server (``forkserver`` start method) between the two is the process's parent, and it
outlives the one that asked for the process: every process it starts holds the pipe whose end
would stop it. There a daemon thread checks every :data:`WATCH_S` that the fork server's parent
is still the expected one: once that died, the server was adopted, and this process ends.

May use: nothing of ddp_exp (the standard library only).
"""

from __future__ import annotations

import os
import signal
import threading
import time

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# How often a process started by a fork server checks that its real parent lives, in seconds.
WATCH_S = 0.5


def die_with_parent(worker_id: int = 0, parent: int | None = None) -> None:
    """DataLoader ``worker_init_fn``, and a rank's first call: this process gets SIGKILL when
    its parent dies. Otherwise a killed rank's workers live on until their next liveness
    check (5 s), holding the rank's exit pipe, so the launcher waits for them; and a killed
    launcher's ranks train on alone (torch's own parent-death signal for its ranks is SIGINT,
    which a shell's background job ignores).

    Args:
        worker_id: the DataLoader's worker index (unused).
        parent: the PID that must be this process's parent, or its parent's parent when a fork
            server started it; one that is gone already ends this process at once (SIGKILL).
            None: no check. Does nothing where ``prctl`` is not available (not Linux).
    """
    del worker_id
    try:
        import ctypes

        if ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL)):
            return
    except (OSError, AttributeError):  # not Linux: keep torch's own liveness check
        return
    if parent is None:
        return
    server = os.getppid()
    if server == parent:
        return
    if parent_of(server) != parent:  # adopted: the parent is gone already
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=_watch, args=(server, parent), daemon=True,
                     name="ddp_exp-parent-watch").start()


def parent_of(pid: int) -> int | None:
    """``pid``'s parent (``/proc/<pid>/stat``), None when it cannot be read (gone, not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        return int(stat[stat.rindex(b")") + 2:].split()[1])  # after "(comm) state"
    except (OSError, ValueError, IndexError):
        return None


def _watch(server: int, parent: int) -> None:
    """Until this process ends: SIGKILL to it once the fork server ``server`` is no longer the
    child of ``parent`` (``parent`` died and the server was adopted)."""
    while parent_of(server) == parent:
        time.sleep(WATCH_S)
    os.kill(os.getpid(), signal.SIGKILL)
