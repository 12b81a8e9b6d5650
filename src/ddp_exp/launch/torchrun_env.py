"""Whether this process is a rank that torchrun (or any elastic agent) started, and what the
entry point does about it before Hydra parses the command line: drop a shell's leftover rank
variables, refuse a multirun, put ``-m`` first, keep non-zero ranks from creating folders.
The environment and ``argv`` alone, no torch: the entry imports this for ``--help`` and
``--cfg job`` too (issue 42 item 6). What such a rank then runs is
:mod:`ddp_exp.launch.torchrun`'s.

May use: nothing of ddp_exp.
"""

from __future__ import annotations

import os

MULTIRUN_UNDER_TORCHRUN = ("multirun (-m) cannot run under torchrun: start the sweep with "
                           "python -m ddp_exp -m ..., which launches one world per job")

# What torchrun's agent sets for each rank; ``TORCHELASTIC_RUN_ID`` says an agent started it.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
TORCHRUN_VARIABLES = (*RANK_VARIABLES, "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


def under_torchrun() -> bool:
    """True when this process is a rank started by torchrun (or any elastic agent): its rank
    variables and ``TORCHELASTIC_RUN_ID`` are set, torch's own test
    (``torch.distributed.is_torchelastic_launched``). ``RANK``/``WORLD_SIZE`` alone are often
    left in a shell by an earlier experiment (:func:`ignore_leftover_torchrun_variables`)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and all(k in os.environ for k in RANK_VARIABLES)


def is_rank0() -> bool:
    """True in the process that reports for the world: rank 0 under torchrun (every rank
    composes the same config and meets the same errors), the only process otherwise."""
    return os.environ.get("RANK", "0") == "0"


def ignore_leftover_torchrun_variables() -> list[str]:
    """Remove from this process's environment the variables of a torchrun rank
    (:data:`TORCHRUN_VARIABLES`) when no agent started it (no ``TORCHELASTIC_RUN_ID``), so that
    the command launches its own world instead of waiting ``distributed.timeout_s`` for the
    peers of a world that no longer exists (R12: Lightning-AI/pytorch-lightning #16313, #5651);
    its ranks get their own from the elastic agent. Returns the names removed, for a line that
    says so; empty under torchrun or when none is set."""
    if under_torchrun() or not any(k in os.environ for k in RANK_VARIABLES):
        return []
    found = [k for k in TORCHRUN_VARIABLES if k in os.environ]
    for key in found:
        del os.environ[key]
    return found


def asks_for_multirun(argv: list[str]) -> bool:
    """True when the command line asks Hydra for a multirun (``-m``, ``--multirun``,
    ``hydra.mode=MULTIRUN``); a preset that sets ``hydra.mode`` is seen only once composed."""
    return any(arg in ("-m", "--multirun") or arg.replace(" ", "").upper() == "HYDRA.MODE=MULTIRUN"
               for arg in argv)


def multirun_flag_first(argv: list[str]) -> list[str]:
    """``argv`` with a ``-m`` / ``--multirun`` that follows an override moved before the
    overrides, where Hydra's parser takes it (``python -m ddp_exp data.batch_size=16,32 -m``
    was an 8-line argparse usage ending in "unrecognized arguments"). ``argv[0]`` stays."""
    flags = [a for a in argv[1:] if a in ("-m", "--multirun")]
    if not flags:
        return argv
    return argv[:1] + flags[:1] + [a for a in argv[1:] if a not in ("-m", "--multirun")]


def torchrun_overrides(argv: list[str]) -> list[str]:
    """Overrides appended to ``argv`` on non-zero torchrun ranks before Hydra parses it, so that
    they create nothing: no run folder (the current one), no ``.hydra/``, no job log."""
    if not under_torchrun() or os.environ["RANK"] == "0":
        return []
    return ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none",
            "hydra/hydra_logging=none"]
