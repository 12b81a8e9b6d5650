"""The subcommands' argument parser: a bad command line is one line, like any user error.

May use: :mod:`ddp_exp.config` (``ConfigError``).
"""

from __future__ import annotations

import argparse

from ddp_exp.config.errors import ConfigError


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose bad command line is one line (a :class:`ConfigError`:
    ``error: ddp-exp prepare: ...``, exit 2), not argparse's usage block."""

    def error(self, message: str):
        raise ConfigError(f"{self.prog}: {message} ({self.prog} --help lists the options)")
