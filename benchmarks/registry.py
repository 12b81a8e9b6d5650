"""Every group of ``make bench``, by the name ``--only`` takes.

To add a group: write one module in ``benchmarks/groups/`` that defines a
``benchmarks.harness.group.Group`` (its variants, targets and hooks: see that class; a
measurement that is not interleaved runs is a group with no variants and a ``probe``, whose rows
land in the results file like the runs'), then add it to the
import and to :data:`GROUPS` below, in the order the groups should run. Its results land in
``benchmarks/results/<name>.csv`` and its targets in docs/benchmarks.md's table.

May use: ``benchmarks.groups``, ``benchmarks.harness``.
"""

from __future__ import annotations

from benchmarks.groups import (
    digits,
    epoch_checkpoint,
    first_line,
    fsdp,
    image_folder,
    lm,
    memory,
    perf,
    prepare_text,
    scaling,
    sharded_checkpoint,
    startup,
    step_checkpoint,
    step_overhead,
    threads,
    trackers,
    warmup,
)
from benchmarks.harness.group import Group

GROUPS: dict[str, Group] = {g.name: g for g in (
    digits.DIGITS,
    digits.COMPUTE,
    startup.STARTUP,
    threads.THREADS,
    perf.PERF,
    step_checkpoint.STEP_CHECKPOINT,
    image_folder.IMAGE_FOLDER,
    lm.LM,
    # opt-in (run only when --only names them: each takes minutes to tens of minutes)
    scaling.SCALING,
    memory.MEMORY,
    step_overhead.STEP_OVERHEAD,
    epoch_checkpoint.EPOCH_CHECKPOINT,
    fsdp.FSDP,
    sharded_checkpoint.SHARDED_CHECKPOINT,
    prepare_text.PREPARE_TEXT,
    first_line.FIRST_LINE,
    trackers.TRACKERS_GROUP,
    warmup.WARMUP,
)}

ALIASES = {"c17": "threads"}  # the group's name before it was named by what it measures
