"""submitit's private names (submitit 1.5.x): its table of the local jobs it started and its
parser of SLURM's compressed node lists.

* :func:`local_job_processes` is kept (issue 27 item 3) because it prevents orphaned processes
  and a wrong result: after a Ctrl-C of a ``launcher=slurm_local`` sweep the entry point waits
  for the jobs it started, so none outlives the command and the sweep's summary reads their
  final ``status.json`` (not a job still running).
* :func:`parse_node_list` is kept because it prevents a refusal that is wrong: a ``srun`` task
  on a node without ``scontrol`` on its PATH (a container) still expands ``gpu[07-08]``.

On a submitit other than 1.5.x each gives what submitit's public API gives (no table, no
parser) and logs one line once (:mod:`ddp_exp.compat.versions`).
"""

from __future__ import annotations

import sys
from typing import Any

from ddp_exp.compat.versions import written_for

STOCK_TABLE = ("a Ctrl-C of a launcher=slurm_local sweep does not wait for its local jobs "
               "(they may outlive the command; the summary may read them unfinished)")
STOCK_PARSER = ("a bracketed SLURM_JOB_NODELIST needs scontrol on PATH to be expanded")


def local_job_processes() -> list[Any]:
    """The processes (``subprocess.Popen``) of the local jobs submitit's local executor
    started in this process (``submitit.local.local._PROCESSES``); empty where that module was
    never imported, or on a submitit other than 1.5.x."""
    local = sys.modules.get("submitit.local.local")
    if local is None or not written_for("submitit", "submitit.local.local._PROCESSES",
                                        STOCK_TABLE):
        return []
    return list(getattr(local, "_PROCESSES", {}).values())


def parse_node_list(nodelist: str) -> list[str] | None:
    """``gpu[07-08,10],cpu3`` -> ``["gpu07", "gpu08", "gpu10", "cpu3"]`` with submitit's
    parser (``submitit.slurm.slurm._parse_node_list``); None where submitit is not installed
    or is not 1.5.x."""
    try:
        from submitit.slurm.slurm import _parse_node_list
    except ImportError:
        return None
    if not written_for("submitit", "submitit.slurm.slurm._parse_node_list", STOCK_PARSER):
        return None
    return list(_parse_node_list(nodelist))
