"""The ``first_line`` group (issue 41 item 2, issue 42 item 6): the seconds from ``python -m
ddp_exp ...`` to its first line of output, for ``--help``, ``--cfg job``, every preset and the
extreme values a range check lets through, each cut at one step
(``benchmarks/probes/first_line.py``, one run of it per repeat: every command once, interleaved).
The ``startup`` group times whole 1-epoch jobs, not the first line.

Rows (``benchmarks/results/first_line.csv``): per command and repeat, ``first_line_s`` and
``wall_s`` (the whole command), ``rc`` its exit status (0: ran, 2: refused in one line; any other
fails the row); and ``slowest``, the largest ``first_line_s`` of each repeat, which the target
reads: < 3 s.

May use: ``benchmarks.harness``, ``benchmarks.groups.step_checkpoint`` (the probe runner).
"""

from __future__ import annotations

from benchmarks.groups.step_checkpoint import probe_result
from benchmarks.harness.group import Group, ProbeFailed, probe_row
from benchmarks.harness.stats import Target

GROUP = "first_line"
PROBE = "benchmarks.probes.first_line"
BOUND_S = 3.0
# the probe's commands that make bench runs: all but the spawned job (~30 s of rank start-up,
# not a first line: its first line is the forked job's)
COMMANDS = ("help", "cfg-job", "job-fork", "refused-world_size=0", "digits-1-epoch",
            "gpt-block_size=100000", "gpt-n_embd=65536", "digits_cnn_recipe",
            "image_folder_recipe", "debug", "batch_size=1e9", "val_size=1e9", "num_workers=64",
            "hidden_sizes=1e6x2")


def measure(quick: bool, repeats: int, timeout_s: float) -> list[dict]:
    """``repeats`` runs of the probe (1 with ``quick``), as rows. Raises ProbeFailed where a run
    gave no result."""
    rows = []
    for rep in range(1 if quick else repeats):
        r = probe_result(PROBE, ["--repeats", "1", "--only", ",".join(COMMANDS)], timeout_s)
        allowed = (0, 2)
        for run in r["runs"]:
            ok = run["exit"] in (allowed if run["command"] not in ("help", "cfg-job", "job-fork")
                                 else (0,))
            rows.append(probe_row(GROUP, run["command"], rep, status="ok" if ok else "failed",
                                  first_line_s=run["first_line_s"], wall_s=run["whole_s"],
                                  rc=run["exit"], note="" if ok else f"exit {run['exit']}"))
        if not r["runs"]:
            raise ProbeFailed(f"{PROBE}: no command ran")
        slow = max(r["runs"], key=lambda x: x["first_line_s"])
        rows.append(probe_row(GROUP, "slowest", rep, first_line_s=slow["first_line_s"],
                              wall_s=slow["whole_s"], note=slow["command"]))
        print(f"  [{rep}] slowest first line {slow['first_line_s']:.2f} s ({slow['command']}); "
              + ", ".join(f"{x['command']} {x['first_line_s']:.2f}" for x in r["runs"]),
              flush=True)
    return rows


def targets() -> list[Target]:
    return [Target("first_line.slowest", f"seconds from the command to its first line, the "
                   f"slowest of --help, --cfg job and {len(COMMANDS) - 2} jobs (presets, extreme "
                   "values)", f"{GROUP}/ws1/slowest/probe", None, "first_line_s", "<", BOUND_S)]


FIRST_LINE = Group(GROUP, "Time to the first line: --help, --cfg job, every preset and the "
                   "extreme values a range check lets through", lambda quick: [], targets,
                   probe=measure, opt_in=True)
