"""torch 2.13's private ``torch._dynamo``, imported before the ranks are forked.

Each rank's first ``DistributedDataParallel(model)`` imports ``torch._dynamo`` (1-2 s of CPU on
an idle machine, 6 s with the two cores shared five ways, measured in session 34); imported
once in the launcher, the forked ranks inherit it instead of each importing it at the same time.
Kept (issue 27 item 3) as the one borrowed internal that buys time rather than preventing a
fault: seconds of every forked start, not milliseconds. On a torch other than 2.13 it imports
nothing (each rank imports what its DDP needs, as torch does) and the log says so once.
"""

from __future__ import annotations

import importlib

from ddp_exp.compat.versions import written_for

# What torch 2.13's DistributedDataParallel imports at its first construction.
MODULES = ("torch._dynamo",)


def preload_for_forked_ranks() -> None:
    """Import :data:`MODULES` in this process, before its ranks are forked (imports before a
    fork are safe; torch compute is not). Nothing on a torch other than 2.13.x."""
    if not written_for("torch", "the preload of torch._dynamo",
                       "each forked rank imports torch._dynamo itself"):
        return
    for name in MODULES:
        importlib.import_module(name)
