"""A rank ends with the process that started it: no rank outlives its launcher.

A launcher killed outright (SIGKILL: the OOM killer, ``kill -9 <pid>``; any signal whose
default action ends it) cannot stop its ranks. Torch's own parent-death signal for a rank is
SIGINT, which the ranks of a shell's background job ignore (ignored at start stays ignored,
:mod:`ddp_exp.compat.elastic_agent`): they were adopted by init, trained on into the job folder
without its lock (which died with the launcher), and at the end hung for good in torch
elastic's ``_wrap`` (``Event.wait``: the agent that would read their result is gone). So every
rank, first thing, replaces it with SIGKILL and checks that its launcher still lives
(:func:`ddp_exp.data.parent_death.die_with_parent`, which the ranks' DataLoader workers use
too: a killed rank takes its workers with it): a launcher that died before (a spawned rank
imports for seconds first) leaves a rank that ends at once.

The kernel sends the signal when the *thread* that started the child exits, not the process.
The elastic agent starts its ranks from the thread that runs ``elastic_launch`` (the main
thread, or a sweep launcher's worker thread), which waits in the agent until every rank has
ended, with ``fork`` and ``spawn`` alike (``spawn`` forks, then execs Python; the setting is
made after the exec, in the rank). With ``forkserver`` the rank's parent is the fork server,
which outlives the launcher (each rank holds its pipe): the rank watches that the server's
parent is still the launcher. Under torchrun the rank's parent is torchrun's agent (its main
thread starts and waits for the ranks), under srun slurmstepd: the same rule, with the one
check this side can make without knowing who started it: a parent that is init is gone (one
adopted by a subreaper instead is not seen).

May use: :mod:`ddp_exp.data` (``parent_death``).
"""

from __future__ import annotations

import os
import signal

from ddp_exp.data.parent_death import die_with_parent

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
    if launcher is None:  # torchrun, srun: whoever started this rank, unless init adopted it
        launcher = os.getppid()
        if launcher == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    die_with_parent(parent=launcher)


def launcher_from_env() -> int | None:
    """The launcher's PID that :func:`ddp_exp.launch.elastic` handed its ranks (removed from
    the environment, so that what the rank starts does not take it for its own), or None."""
    value = os.environ.pop(LAUNCHER_PID_ENV, None)
    return int(value) if value and value.isdigit() else None

