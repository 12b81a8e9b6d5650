"""torch 2.13's record of its compilation time: ``torch._dynamo.utils.compilation_time_metrics``.

Kept because it prevents a wrong number: ``torch.compile`` compiles inside the first steps (and
again at a new input shape, such as an epoch's shorter last batch), and a rate timed over those
steps counts compilation as training (issue 41 item 3: 6,060 tokens/s for a run that trains at
25,963). Only dynamo knows which steps compiled and for how long; a guess from step times could
not tell a recompile from a slow step. The dict maps a phase to the seconds of each call; two
phases are top level: ``_compile.compile_inner`` (a frame's forward compile, the backward graph
included where AOTAutograd builds it eagerly) and ``backward._backward_impl`` (a backward
compiled lazily at its first call).

On a torch other than 2.13 :func:`compile_seconds` returns 0.0: no step is known to have
compiled, so only the run's first step is left out of throughput, and the log says so once
(:mod:`ddp_exp.compat.versions`).
"""

from __future__ import annotations

from ddp_exp.compat.versions import written_for

TOP_LEVEL_PHASES = ("_compile.compile_inner", "backward._backward_impl")


def compile_seconds() -> float:
    """Seconds this process has spent compiling with ``torch.compile`` so far (dynamo's
    top-level phases, summed); 0.0 before any compilation, or on a torch other than 2.13."""
    if not written_for("torch", "torch._dynamo.utils.compilation_time_metrics",
                       "compilation not measured; only the first step is left out of rates"):
        return 0.0
    import sys

    utils = sys.modules.get("torch._dynamo.utils")  # not imported: nothing compiled yet
    if utils is None:
        return 0.0
    metrics = getattr(utils, "compilation_time_metrics", {})
    return float(sum(sum(metrics.get(phase, ())) for phase in TOP_LEVEL_PHASES))
