"""A rank ends with the process that started it: no rank outlives its launcher.

A launcher killed outright (SIGKILL: the OOM killer, ``kill -9 <pid>``; any signal whose
default action ends it) cannot stop its ranks: they were reparented to init (or a subreaper),
trained on into the job folder without the folder's lock (which died with the launcher), and at
the end hung for good in torch elastic's ``_wrap`` (``Event.wait``: the agent that would read
their result is gone). So every rank asks the kernel for SIGKILL when its parent dies (Linux
``prctl(PR_SET_PDEATHSIG)``, :func:`ddp_exp.data.loaders.die_with_parent`, which the ranks'
DataLoader workers use too: a killed rank takes its workers with it), first thing, and then
checks that its parent is still the process it was started by: a launcher that died before the
``prctl`` (a spawned rank imports for seconds first) leaves a rank that ends at once.

The kernel sends the signal when the *thread* that started the child exits, not the process.
The elastic agent starts its ranks from the thread that runs ``elastic_launch`` (the main
thread; a sweep launcher's worker thread), which waits in the agent until every rank has ended,
with ``fork`` and ``spawn`` alike (``spawn`` forks, then execs Python: the setting is made after
the exec, in the rank). With ``forkserver`` the rank's parent is the fork server, which the
launcher started and which exits when the launcher dies (it reads EOF on the launcher's pipe):
the rank dies after it. Under torchrun the rank's parent is torchrun's agent (its main thread
starts and waits for the ranks), under srun slurmstepd: the same rule holds, with the one
check this side can make without knowing its launcher: a parent that is init means it is gone.

May use: :mod:`ddp_exp.data` (``die_with_parent``).
"""

from __future__ import annotations

import os

from ddp_exp.data.loaders import die_with_parent

# The launcher's PID, set for the ranks it starts (ddp_exp.launch.elastic).
LAUNCHER_PID_ENV = "DDP_EXP_LAUNCHER_PID"


def end_with_launcher(launcher: int | None) -> None:
    """In a rank, first thing: this process gets SIGKILL when the process that started it
    dies, and ends at once (SIGKILL) when that has happened already.

    Args:
        launcher: the PID of the launcher that started this rank (:data:`LAUNCHER_PID_ENV`):
            the rank's parent (``fork``, ``spawn``), or its parent's parent (``forkserver``:
            the fork server). None under torchrun or srun: there a parent that is init
            (PID 1) is a dead one. Does nothing where ``prctl`` is not available (not Linux).
    """
    parent = os.getppid()
    if launcher is None:  # torchrun, srun: whoever started this rank, unless init adopted it
        expected = parent if parent != 1 else 0  # 0: no process's parent, so: end now
    elif parent != launcher and _parent_of(parent) == launcher:
        expected = parent  # forkserver: the server dies with the launcher, the rank with it
    else:
        expected = launcher
    die_with_parent(parent=expected)


def launcher_from_env() -> int | None:
    """The launcher's PID that :func:`ddp_exp.launch.elastic` handed its ranks (removed from
    the environment, so that what the rank starts does not take it for its own), or None."""
    value = os.environ.pop(LAUNCHER_PID_ENV, None)
    return int(value) if value and value.isdigit() else None


def _parent_of(pid: int) -> int | None:
    """``pid``'s parent (``/proc/<pid>/stat``), None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        return int(stat[stat.rindex(b")") + 2:].split()[1])  # after "(comm) state"
    except (OSError, ValueError, IndexError):
        return None
