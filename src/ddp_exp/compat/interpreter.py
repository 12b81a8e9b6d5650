"""CPython's private ``atexit._run_exitfuncs``: what a normal exit runs, without the
interpreter's teardown after it.

Kept (issue 27 item 3) because it prevents a visible crash: in a process that was a rank
(torchrun, srun), the teardown destroyed gloo's C++ objects after the interpreter had begun to
die, and a finished run ended with "terminate called without an active exception" (SIGABRT).
It also saves 0.6-1.0 s of every command (the teardown frees torch's and Hydra's modules one by
one). On another interpreter (not CPython 3.10-3.13) the process exits as Python does, and the
log says so once (:mod:`ddp_exp.compat.versions`).
"""

from __future__ import annotations

import atexit
from collections.abc import Callable

from ddp_exp.compat.versions import written_for

STOCK_EXIT = "the process ends through the interpreter's own exit and teardown"


def exit_handlers() -> Callable[[], None] | None:
    """The function that runs every ``atexit`` handler now, last registered first, each once
    (``atexit._run_exitfuncs``): call it, flush the streams, then ``os._exit``. None on an
    interpreter it was not written for: end the process as Python does instead."""
    if not written_for("python", "atexit._run_exitfuncs", STOCK_EXIT):
        return None
    return atexit._run_exitfuncs
