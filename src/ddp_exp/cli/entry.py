"""The process entry of ``python -m ddp_exp`` and the ``ddp-exp`` script: what only the process
that *is* ddp_exp may do to itself, then the command line (:func:`ddp_exp.cli.main.main`).

Two process-wide changes belong to that process alone, so they are made here, when the entry
runs, and never when a module is imported (a test, a notebook or a user's script importing
:mod:`ddp_exp.cli.main` keeps its console and its Ctrl-C):

- the console can no longer fail the run (:func:`ddp_exp.io.console.protect_console`);
- a Ctrl-C while the command line's imports run (torch's takes seconds) ends the process at
  once with the one line a later Ctrl-C gets, exit status 130, not a traceback from inside an
  import. Once the imports are done, SIGINT is Python's ``KeyboardInterrupt`` again. Where
  SIGINT is ignored at start (``nohup``, a shell's ``&``) it stays ignored.

May import :mod:`ddp_exp.io.console`, and :mod:`ddp_exp.cli.main` once installed as above.
"""

from __future__ import annotations

import os
import signal
import sys

from ddp_exp.io.console import protect_console


def _interrupted_while_importing(signum: int, frame: object) -> None:
    """SIGINT while the entry imports the command line: nothing has been made yet, so end at
    once (``os._exit``: no interpreter teardown inside a half-done import)."""
    print("interrupted (SIGINT)", file=sys.stderr, flush=True)
    os._exit(128 + signal.SIGINT)


def main() -> None:
    """Run ddp_exp as a process (module docstring). Raises ``SystemExit`` with the exit status
    the command line chose (:mod:`ddp_exp.cli.main`)."""
    protect_console()
    guarded = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if guarded:
        signal.signal(signal.SIGINT, _interrupted_while_importing)
    from ddp_exp.cli.main import main as command_line

    if guarded:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    command_line()
