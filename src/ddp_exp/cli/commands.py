"""The ``ddp-exp`` console script's subcommands: ``ddp-exp prepare ...`` and ``ddp-exp sample
...`` (the first word), beside Hydra's overrides for everything else.

A subcommand's bad input is one line from the entry's error table
(:func:`ddp_exp.cli.errors.error_exit`), exit status 2; a bug keeps its traceback.

May use: :mod:`ddp_exp.cli.errors`, :mod:`ddp_exp.cli.prepare`, :mod:`ddp_exp.cli.sample`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ddp_exp.cli.errors import error_exit
from ddp_exp.config.errors import ConfigError

SUBCOMMANDS = {"prepare": "ddp_exp.cli.prepare", "sample": "ddp_exp.cli.sample"}


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose bad command line is one line (a :class:`ConfigError`:
    ``error: ddp-exp prepare: ...``, exit 2), not argparse's usage block."""

    def error(self, message: str):
        raise ConfigError(f"{self.prog}: {message} ({self.prog} --help lists the options)")


def subcommand(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` (``sys.argv``) names as its first word, or None (Hydra's)."""
    return argv[1] if len(argv) > 1 and argv[1] in SUBCOMMANDS else None


def run(name: str, argv: Sequence[str]) -> int:
    """Run subcommand ``name`` with ``argv`` (the words after it); returns the exit status."""
    module = importlib.import_module(SUBCOMMANDS[name])
    try:
        return module.main(argv)
    except KeyboardInterrupt:
        print("interrupted (SIGINT)", file=sys.stderr, flush=True)
        return 130
    except Exception as exc:
        out = error_exit(exc, argv)
        if out is None:
            raise
        print(out.text, file=sys.stderr, flush=True)
        return out.code
