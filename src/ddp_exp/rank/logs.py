"""A rank's log lines: every line carries its rank; rank 0 logs INFO and above, the others
WARNING and above, to stdout and appended to the job's log file. A background thread's full
disk is left to the rank's own error line.

May use: :mod:`ddp_exp.io.files` (a full disk).
"""

from __future__ import annotations

import logging
import sys
import threading

from ddp_exp.io.files import is_disk_full

LOG_FORMAT = "[%(asctime)s][rank{rank}][%(name)s][%(levelname)s] - %(message)s"


def configure_logging(rank: int, log_file: str | None) -> None:
    """Rank 0 logs INFO and above, other ranks WARNING and above; every line carries its rank.

    Replaces inherited handlers (a forked rank inherits the parent's, which would write every
    line once per rank), writing to stdout and appending to the job's log file.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    formatter = logging.Formatter(LOG_FORMAT.format(rank=rank))
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    if log_file:
        handlers.append(logging.FileHandler(log_file, mode="a"))
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    threading.excepthook = _thread_failed


def _thread_failed(args: threading.ExceptHookArgs) -> None:
    """A background thread's uncaught error (TensorBoard's event writer, the checkpoint
    writer): a full disk is left to the rank's own line, which names the disk when the rank
    next writes (the writer re-raises it there; :func:`ddp_exp.io.files.naming_the_disk`), not
    printed as a second traceback; anything else as Python prints it."""
    if args.exc_value is not None and is_disk_full(args.exc_value):
        return
    threading.__excepthook__(args)
