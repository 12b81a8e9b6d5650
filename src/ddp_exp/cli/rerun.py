"""``ddp-exp rerun RUN [OVERRIDES ...] [--out DIR]``: run a finished job again from its record
(``RUN/run.json``, :mod:`ddp_exp.job.record`) into a new folder and say whether the final
weights (``model.pt``) are bit-identical.

The job is started as it was: the same command folder, the user's config folder and primary
config, the job's overrides, and the torch threads per rank and CPU kernel settings the record
holds (``OMP_NUM_THREADS``, ``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``; one set in
this shell wins, to rerun with another). Extra overrides are appended (``world_size=1``). Then
every tensor of the two ``model.pt`` is compared bit for bit; and the two records, in the order
of :data:`CAUSES` (what changes floating-point results first), name what differs. The exit
status is 0 when bit-identical, 1 when not (or the rerun failed), 2 for a RUN that is no
finished job.

May use: :mod:`ddp_exp.job.record`, :mod:`ddp_exp.io.files`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ddp_exp.io.files import read_json
from ddp_exp.job.record import RECORD

# Record entries in the order they are named when the weights differ: the first that differs
# is the likely cause (versions and kernels change the arithmetic, then the world, ...).
CAUSES = ("versions", "git.commit", "git.dirty", "world_size", "threads_per_rank", "cpu",
          "backend", "device", "nnodes", "seed", "data", "overrides", "hostname")
KERNEL_VARS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


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


def main(argv: Sequence[str]) -> int:
    """``ddp-exp rerun`` (see the module's docstring); returns the exit status."""
    parser = argparse.ArgumentParser(prog="ddp-exp rerun", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a finished job folder (holding run.json and model.pt)")
    parser.add_argument("overrides", nargs="*", help="overrides appended to the job's")
    parser.add_argument("--out", help="the new job folder (default: outputs/reruns/<time> in "
                                      "the recorded command folder)")
    args = parser.parse_args(list(argv))
    record = read_json(os.path.join(args.run, RECORD))
    weights = os.path.join(args.run, "model.pt")
    if not isinstance(record, dict) or not os.path.isfile(weights):
        print(f"error: {args.run}: not a finished job folder with a record (run.json and "
              "model.pt; jobs started before ddp_exp wrote run.json have none)",
              file=sys.stderr)
        return 2
    cwd = record.get("cwd") or os.getcwd()
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")
    out = os.path.abspath(args.out or os.path.join(cwd, "outputs", "reruns", stamp))
    cmd = rerun_command(record, args.overrides, out)
    print(f"rerun: {' '.join(cmd[3:])}", flush=True)
    code = subprocess.run(cmd, cwd=cwd, env=rerun_env(record), stdin=subprocess.DEVNULL
                          ).returncode
    if code != 0 or not os.path.isfile(os.path.join(out, "model.pt")):
        print(f"error: the rerun failed (exit status {code}); see {out}", file=sys.stderr)
        return 1
    first = compare_weights(weights, os.path.join(out, "model.pt"))
    differences = record_differences(record, read_json(os.path.join(out, RECORD)) or {})
    if first is None:
        print(f"bit-identical: {out}/model.pt equals {args.run}/model.pt in every bit")
    else:
        print(f"not bit-identical: {out}/model.pt differs from {args.run}/model.pt ({first})")
    if differences:
        print("the records differ: " + "; ".join(differences))
    elif first is not None:
        print("the records do not differ (versions, commit, world size, threads, CPU kernels, "
              "data): a nondeterministic operation, or a change the record does not see")
    return 0 if first is None else 1
