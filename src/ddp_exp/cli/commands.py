"""``ddp-exp <command> ...``: the console script's subcommands, beside the Hydra entry.

:data:`COMMANDS` maps a first argument to the function that takes the rest of the command line
and returns the exit status. A Hydra command line never starts with one of these words (an
override has ``=``, a flag starts with ``-``), so :func:`dispatch` leaves every Hydra command
as it was. A new command is one row here and a module of its own.

May use: :mod:`ddp_exp.cli.runs` (``runs``, ``rerun``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def _runs(argv: Sequence[str]) -> int:
    from ddp_exp.cli.runs import main

    return main(argv)


def _rerun(argv: Sequence[str]) -> int:
    from ddp_exp.cli.rerun import main

    return main(argv)


# first argument -> (function of the remaining arguments returning the exit status, summary)
COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "runs": (_runs, "a table of runs: status, the keys that differ, final metrics, wall time"),
    "rerun": (_rerun, "rerun a finished job from its run.json; are the weights bit-identical?"),
}


def dispatch(argv: Sequence[str]) -> int | None:
    """Run the subcommand ``argv[0]`` names with the rest of ``argv``; None when ``argv`` is
    no subcommand (a Hydra command line)."""
    if not argv or argv[0] not in COMMANDS:
        return None
    return COMMANDS[argv[0]][0](argv[1:])
