"""The ``trackers`` group (issue 38): what the trackers beside TensorBoard cost a run: digits at
world_size 2, ``logger=tensorboard`` against ``logger=[tensorboard,csv]``,
``[tensorboard,mlflow]`` (its local file store in the job folder) and ``[tensorboard,wandb]``
(offline, the default), interleaved.

Figures: ``train/samples_per_sec`` (the training loop only: the trackers write on a background
thread of rank 0, so each target is a ratio near 1; bound >= 0.95, ours: the issue sets none)
and the job's wall seconds (which include the tracker's import and its store's creation, paid
once per job; printed as ratios, no bound). A tracker whose package is not installed
(``pip install -e ".[mlflow,wandb]"``) is skipped.

May use: ``benchmarks.workloads``, ``benchmarks.harness``.
"""

from __future__ import annotations

import importlib.util

from benchmarks import workloads
from benchmarks.harness.group import Group
from benchmarks.harness.stats import Target
from benchmarks.harness.variant import Variant

GROUP = "trackers"
TRACKERS = ("csv", "mlflow", "wandb")
BOUND = 0.95


def _missing(tracker: str) -> str | None:
    if tracker in ("none", "csv") or importlib.util.find_spec(tracker) is not None:
        return None
    return f"skipped: {tracker} is not installed (pip install -e \".[{tracker}]\")"


def variants(quick: bool) -> list[Variant]:
    d = workloads.spec("digits")
    out = [Variant(GROUP, "ddp_exp", "digits", 2, d["batch_size"], 1 if quick else d["epochs"],
                   overrides=("logger=tensorboard",), label="tensorboard")]
    for t in TRACKERS:
        out.append(Variant(GROUP, "ddp_exp", "digits", 2, d["batch_size"],
                           1 if quick else d["epochs"], overrides=(f"logger=[tensorboard,{t}]",),
                           label=f"tensorboard+{t}", skipped=_missing(t)))
    return out


def key(label: str) -> str:
    return f"{GROUP}/ws2/{label}/ddp_exp"


def targets() -> list[Target]:
    return [Target(f"trackers.{t}_vs_tensorboard", f"digits, ws=2: ddp_exp logger=[tensorboard,"
                   f"{t}] / tensorboard alone, samples/s", key(f"tensorboard+{t}"),
                   key("tensorboard"), "samples_per_sec", ">=", BOUND) for t in TRACKERS]


TRACKERS_GROUP = Group(
    GROUP, "Trackers: csv, mlflow and wandb beside TensorBoard against TensorBoard alone "
    "(ddp_exp, digits, ws=2)", variants, targets, opt_in=True,
    ratios=tuple((key(f"tensorboard+{t}"), key("tensorboard"), "wall_s",
                  f"job wall s: [tensorboard,{t}] / tensorboard") for t in TRACKERS))
