"""``ddp-exp <command> ...``: the console script's subcommands, beside the Hydra entry.

:data:`COMMANDS` maps a first argument to the function that takes the rest of the command line
and returns the exit status. A Hydra command line never starts with one of these words (an
override has ``=``, a flag starts with ``-``), so :func:`dispatch` leaves every Hydra command
as it was. A new command is one row here and a module of its own.

``prepare`` and ``sample`` (issue 39; :mod:`ddp_exp.cli.prepare`, :mod:`ddp_exp.cli.sample`):
their bad input is one line from the entry's error table (:func:`ddp_exp.cli.errors.error_exit`),
exit status 2; a bug keeps its traceback.

May use: :mod:`ddp_exp.cli.runs` (``runs``, ``rerun``), :mod:`ddp_exp.cli.prepare`,
:mod:`ddp_exp.cli.sample`, :mod:`ddp_exp.cli.errors`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence


def _one_line(run: Callable[[Sequence[str]], int], argv: Sequence[str]) -> int:
    """``run(argv)``, its user errors as one line from the entry's table (exit 2)."""
    from ddp_exp.cli.errors import error_exit

    try:
        return run(argv)
    except KeyboardInterrupt:
        print("interrupted (SIGINT)", file=sys.stderr, flush=True)
        return 130
    except Exception as exc:
        out = error_exit(exc, argv)
        if out is None:
            raise
        print(out.text, file=sys.stderr, flush=True)
        return out.code


def _prepare(argv: Sequence[str]) -> int:
    from ddp_exp.cli.prepare import main

    return _one_line(main, argv)


def _sample(argv: Sequence[str]) -> int:
    from ddp_exp.cli.sample import main

    return _one_line(main, argv)


def _runs(argv: Sequence[str]) -> int:
    from ddp_exp.cli.runs import main

    return _one_line(main, argv)


def _rerun(argv: Sequence[str]) -> int:
    from ddp_exp.cli.rerun import main

    return _one_line(main, argv)


# first argument -> (function of the remaining arguments returning the exit status, summary)
COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "runs": (_runs, "a table of runs: status, the keys that differ, final metrics, wall time"),
    "rerun": (_rerun, "rerun a finished job from its run.json; are the weights bit-identical?"),
    "prepare": (_prepare, "text files / JSON lines / CSV / Parquet / a dataset to train.bin, "
                          "val.bin, tokenizer.json, meta.json for data=tokens data.path=DIR"),
    "sample": (_sample, "text from a trained language-model run's weights and tokenizer"),
}


def dispatch(argv: Sequence[str]) -> int | None:
    """Run the subcommand ``argv[0]`` names with the rest of ``argv``; None when ``argv`` is
    no subcommand (a Hydra command line). A first word that is neither a command nor
    something Hydra takes (an override has ``=``, ``~key`` deletes, a flag starts with ``-``):
    one line naming the commands, exit 2 (``ddp-exp prepar DIR`` printed Hydra's three lines
    about a missing ``=``)."""
    if not argv:
        return None
    if argv[0] in COMMANDS:
        return COMMANDS[argv[0]][0](argv[1:])
    if "=" not in argv[0] and not argv[0].startswith(("-", "~", "+")):
        print(f"error: {argv[0]!r} is no command and no override: ddp-exp takes one of "
              f"{', '.join(sorted(COMMANDS))}, or Hydra overrides key=value (python -m ddp_exp "
              "--help)", file=sys.stderr, flush=True)
        return 2
    return None
