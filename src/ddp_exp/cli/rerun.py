"""``ddp-exp rerun RUN [OVERRIDES ...] [--out DIR]``: run a finished job again from its record
(``RUN/run.json``, :mod:`ddp_exp.job.record`) into a new folder and say whether the final
weights (``model.pt``) are bit-identical.

The job is started as it was: in the recorded command folder (the record's relative paths
resolve there), with the user's config folder and primary config, the job's overrides, and the
torch threads per rank and CPU kernel settings the record holds (``OMP_NUM_THREADS``,
``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``; one set in this shell wins, to rerun with
another). Extra overrides are appended (``world_size=1``). It writes into ``--out`` or
``outputs/reruns/<time>`` under the current folder, as every command does, and names it. Then
every tensor of the two ``model.pt`` is compared bit for bit; and the two records, in the order
of :data:`CAUSES` (what changes floating-point results first), name what differs. A run that
was resumed at another world size (``attempts`` in its record) is expected to differ at float
level: its rerun trains start to end at the last world size, whose sums round otherwise; the
verdict says so, naming the world sizes, instead of blaming a nondeterministic operation.

The exit status is 0 when bit-identical, 1 when not, 2 for a RUN that is no completed job: a
run whose ``status.json`` (or record) says it failed, was interrupted or was preempted is
refused in one line naming that state, without a rerun (it has no final weights to compare);
start it again, or resume it (``trainer.resume=auto``), instead. A rerun whose job refused to
start (a misspelled extra override, an ``--out`` it cannot write) wrote nothing into its folder:
the job's own ``error:`` line is the only one, and its exit status is this command's (2 for a
refused input). A rerun whose job started and then failed (or left no ``model.pt``) adds one
line naming its folder, to see its log and ``status.json``, and exits 1.

May use: :mod:`ddp_exp.job.record`, :mod:`ddp_exp.job.folder` (``STATUS_FILE``),
:mod:`ddp_exp.io.files`.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ddp_exp.cli.one_line_parser import OneLineParser
from ddp_exp.io.files import read_json
from ddp_exp.job.folder import STATUS_FILE
from ddp_exp.job.record import RECORD

# Record entries in the order they are named when the weights differ: the first that differs
# is the likely cause (versions and kernels change the arithmetic, then the world, ...).
CAUSES = ("versions", "git.commit", "git.dirty", "world_size", "threads_per_rank", "cpu",
          "backend", "device", "nnodes", "seed", "data", "overrides", "hostname")
KERNEL_VARS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
# A job's state (status.json, else run.json) that left no final weights, in words.
NOT_COMPLETED = {"failed": "failed", "interrupted": "was interrupted",
                 "preempted": "was preempted", "running": "has not ended (running, or killed)"}


def rerun_command(record: Mapping[str, Any], extra: Sequence[str], out: str) -> list[str]:
    """The command that starts the recorded job again into ``out``."""
    cmd = [sys.executable, "-m", "ddp_exp"]
    if record.get("config_dir"):
        cmd += ["--config-dir", record["config_dir"]]
    if record.get("config_name") not in (None, "config"):
        cmd += ["--config-name", record["config_name"]]
    return [*cmd, *record.get("overrides", []), *extra, f"hydra.run.dir={out}"]


def rerun_env(record: Mapping[str, Any]) -> dict[str, str]:
    """This environment, with the record's threads per rank and CPU kernel settings where
    this shell sets none."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(record.get("threads_per_rank") or 1))
    recorded = ((record.get("cpu") or {}).get("env") or {})
    for key in KERNEL_VARS:
        if recorded.get(key) and key not in env:
            env[key] = recorded[key]
    return env


def world_sizes(record: Mapping[str, Any]) -> list[int]:
    """The world sizes a job trained at, in order: each earlier start's (``attempts``), then
    the last; a size repeated by the next start is listed once (``[2, 1]``: started at 2
    ranks, resumed at 1)."""
    sizes: list[int] = []
    for start in [*record.get("attempts", []), record]:
        size = start.get("world_size")
        if size is not None and (not sizes or sizes[-1] != size):
            sizes.append(size)
    return sizes


def override_changes(record: Mapping[str, Any]) -> list[str]:
    """The overrides an earlier start of the job ran with that its last start did not (and
    the last's that it did not), per start, as ``"start 1: data.batch_size=16 (last:
    data.batch_size=32)"``; ``trainer.resume`` left out (a resume's own key). Empty when every
    start ran the last's overrides."""
    def keys(start: Mapping[str, Any]) -> set[str]:
        return {o for o in start.get("overrides") or []
                if not str(o).lstrip("+~").startswith("trainer.resume=")}

    last, changes = keys(record), []
    for number, start in enumerate(record.get("attempts") or [], start=1):
        if not isinstance(start, Mapping) or start.get("overrides") is None:
            continue
        mine = keys(start)
        if mine != last:
            gone, new = sorted(mine - last), sorted(last - mine)
            changes.append(f"start {number}: {' '.join(gone) or '(none)'} (last: "
                           f"{' '.join(new) or '(none)'})")
    return changes


def not_completed_line(run: str, record: Any, status: Any) -> str | None:
    """The refusal for a RUN whose ``status.json`` (or, without one, ``run.json``) says it did
    not complete: its state and what to do; None for a completed run, or one with no state."""
    state = (status if isinstance(status, dict) else {}).get("status") or (
        record if isinstance(record, dict) else {}).get("status")
    if state not in NOT_COMPLETED:
        return None
    source = STATUS_FILE if isinstance(status, dict) and status.get("status") else RECORD
    return (f"error: {run}: the run {NOT_COMPLETED[state]} ({source} says {state!r}); ddp-exp "
            "rerun compares a completed run's final weights, which it has none of: resume it "
            f"(hydra.run.dir={run} trainer.resume=auto) or start it again")


def compare_weights(a: str, b: str) -> str | None:
    """None when every tensor of the two ``model.pt`` files is equal bit for bit (same keys,
    dtypes and shapes); else what differs first (a key, or the largest difference)."""
    import torch

    wa, wb = (torch.load(p, map_location="cpu", weights_only=True) for p in (a, b))
    if wa.keys() != wb.keys():
        return f"other tensors: {sorted(wa.keys() ^ wb.keys())[:3]}"
    for name in wa:
        x, y = wa[name], wb[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"{name}: {x.dtype} {tuple(x.shape)} -> {y.dtype} {tuple(y.shape)}"
        if not torch.equal(x.view(torch.uint8) if x.is_floating_point() else x,
                           y.view(torch.uint8) if y.is_floating_point() else y):
            worst = (x.double() - y.double()).abs().max().item()
            return f"{name}: largest difference {worst:.3g}"
    return None


def record_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """``key: A -> B`` for each entry of :data:`CAUSES` that differs, in that order."""
    from ddp_exp.cli.runs import flatten

    fa, fb = flatten(dict(a)), flatten(dict(b))
    lines = []
    for cause in CAUSES:
        keys = sorted(k for k in fa.keys() | fb.keys() if k == cause or k.startswith(cause + "."))
        if cause == "overrides":  # a list: compared whole
            keys = ["overrides"]
        for key in keys:
            if fa.get(key) != fb.get(key):
                lines.append(f"{key}: {fa.get(key)!r} -> {fb.get(key)!r}")
    return lines


def rerun_failed(code: int, out: str) -> int:
    """Say that the rerun into ``out`` left no final weights, given its job's exit status
    ``code`` (negative: killed by that signal, :class:`subprocess.Popen`); returns this
    command's exit status. A job that wrote nothing into ``out`` (it refused its input and
    said so in its own line) gets no second line, and its status is passed on; one that
    started (``out`` holds something) gets one line naming ``out``, exit 1."""
    try:
        started = bool(os.listdir(out))
    except OSError:  # never made (or unreadable): the job did not start there
        started = False
    if not started and code > 0:
        return code
    if started:
        print(f"error: the rerun failed (exit status {code}); see {out}", file=sys.stderr)
    else:
        ended = f"killed by signal {-code}" if code < 0 else "exit status 0"
        print(f"error: the rerun ended ({ended}) before it wrote anything into its folder",
              file=sys.stderr)
    return 1


def main(argv: Sequence[str]) -> int:
    """``ddp-exp rerun`` (see the module's docstring); returns the exit status."""
    parser = OneLineParser(prog="ddp-exp rerun", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a finished job folder (holding run.json and model.pt)")
    parser.add_argument("overrides", nargs="*", help="overrides appended to the job's")
    parser.add_argument("--out", help="the new job folder (default: outputs/reruns/<time> in "
                                      "the current folder)")
    args = parser.parse_args(list(argv))
    record = read_json(os.path.join(args.run, RECORD))
    weights = os.path.join(args.run, "model.pt")
    refused = not_completed_line(args.run, record,
                                 read_json(os.path.join(args.run, STATUS_FILE)))
    if refused is not None:
        print(refused, file=sys.stderr)
        return 2
    if not isinstance(record, dict) or not os.path.isfile(weights):
        print(f"error: {args.run}: not a finished job folder with a record (run.json and "
              "model.pt; jobs started before ddp_exp wrote run.json have none)",
              file=sys.stderr)
        return 2
    cwd = record.get("cwd") or os.getcwd()
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")
    out = os.path.abspath(args.out or os.path.join("outputs", "reruns", stamp))
    if os.path.isdir(out) and os.listdir(out):  # a rerun starts a job afresh, never into a run
        print(f"error: --out={out} is not empty: a rerun needs a new folder (or leave --out "
              "out: outputs/reruns/<time>)", file=sys.stderr)
        return 2
    cmd = rerun_command(record, args.overrides, out)
    print(f"rerun: {' '.join(cmd[3:])}", flush=True)
    print(f"rerun: into {out}", flush=True)
    code = subprocess.run(cmd, cwd=cwd, env=rerun_env(record), stdin=subprocess.DEVNULL
                          ).returncode
    if code != 0 or not os.path.isfile(os.path.join(out, "model.pt")):
        return rerun_failed(code, out)
    first = compare_weights(weights, os.path.join(out, "model.pt"))
    differences = record_differences(record, read_json(os.path.join(out, RECORD)) or {})
    if first is None:
        print(f"bit-identical: {out}/model.pt equals {args.run}/model.pt in every bit")
    else:
        print(f"not bit-identical: {out}/model.pt differs from {args.run}/model.pt ({first})")
    sizes = world_sizes(record)
    if first is not None and len(sizes) > 1:
        print(f"expected: the run was resumed at another world size (world_size "
              f"{' then '.join(map(str, sizes))}, run.json's attempts) and the rerun trained "
              f"start to end at world_size={sizes[-1]}: sums over another number of ranks "
              "round otherwise (float-level differences), not a nondeterministic operation")
    changed = override_changes(record) if first is not None else []
    if changed:
        print("expected: the run was resumed with other overrides (run.json's attempts: "
              f"{'; '.join(changed)}) and the rerun trained start to end with the last's")
    if differences:
        print("the records differ: " + "; ".join(differences))
    elif first is not None and len(sizes) <= 1 and not changed:
        print("the records do not differ (versions, commit, world size, threads, CPU kernels, "
              "data): a nondeterministic operation, or a change the record does not see")
    return 0 if first is None else 1
