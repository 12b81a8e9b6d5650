"""Test-only pieces for issue 30's resume tests (step checkpoints, another world size), plugged
in through the public entry like ``faulty.py``: ``--config-dir <dir> model=holding`` and
``data._target_=resume_support.recording_pair``, with this folder on ``PYTHONPATH``.

* :class:`HoldingMLP`: ``ddp_exp.train.models.MLP`` (same layers, same seeded weights, same
  ``state_dict`` keys) that, on rank 0 at its ``hold_call``-th training forward, waits until a
  ``last.pt`` holds a step checkpoint in the middle of an epoch, touches a marker file and
  sleeps: the test SIGKILLs the whole process group there, with the step checkpoint on disk
  (it is written on a background thread: the model waits for the file, not a time).
* :class:`Recording`: a lazy dataset of computed items that appends each index it serves to
  ``<record_dir>/served-<RANK>.txt`` (the launching process, which has no ``RANK``, records
  nothing): the order in which every rank read its samples.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import yaml
from torch.utils.data import Dataset

from ddp_exp.train.models import MLP

# How long a held rank waits for its checkpoint (helpers.HANG_S: a hang detector, not a speed
# check; this module runs inside ranks and does not import the test helpers).
HOLD_S = 300.0


def mid_epoch(path: str | Path) -> dict | None:
    """The checkpoint at ``path`` when it is a step checkpoint written inside an epoch
    (``position`` > 0), else None (missing, being renamed, or at an epoch's end)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(state.get("shards"), str):  # sharded: the folder's state.pt (issue 40)
            state = torch.load(Path(path).parent / state["shards"] / "state.pt",
                               map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError):
        return None
    return state if state.get("position") else None


class HoldingMLP(MLP):
    """See the module docstring; ``hold_call=0`` never holds (a plain MLP)."""

    def __init__(self, input_shape: Sequence[int], num_outputs: int,
                 hidden_sizes: Sequence[int] = (128,), dropout: float = 0.0,
                 hold_call: int = 0, checkpoint: str | None = None, epoch: int = 0,
                 marker: str | None = None):
        super().__init__(input_shape, num_outputs, hidden_sizes=hidden_sizes, dropout=dropout)
        self.hold_call, self.checkpoint, self.epoch, self.marker = (
            int(hold_call), checkpoint, int(epoch), marker)
        self.calls = 0  # not in the state_dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.training:
            self.calls += 1
            if self.calls == self.hold_call and os.environ.get("RANK") == "0":
                self._hold()
        return out

    def _hold(self) -> None:
        deadline = time.monotonic() + HOLD_S
        while time.monotonic() < deadline:
            state = mid_epoch(self.checkpoint)
            if state is not None and state["epoch"] == self.epoch:
                break
            time.sleep(0.01)
        Path(self.marker).touch()
        time.sleep(120)  # the test kills the process group here


def write_holding_yaml(config_dir: Path, hold_call: int = 0, checkpoint: str | None = None,
                       epoch: int = 0, marker: str | None = None) -> list[str]:
    """Write ``<config_dir>/model/holding.yaml`` (``model=mlp``'s sizes) and return the
    overrides that select it."""
    node = {"_target_": "resume_support.HoldingMLP", "hidden_sizes": [128], "dropout": 0.0,
            "hold_call": hold_call, "checkpoint": checkpoint, "epoch": epoch, "marker": marker}
    folder = Path(config_dir) / "model"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "holding.yaml").write_text(yaml.safe_dump(node, sort_keys=False))
    return ["--config-dir", str(config_dir), "model=holding"]


class Computed(Dataset):
    """``n`` items from their index alone: ``x = randn(16)`` seeded by ``offset + i``, label the
    argmax of a fixed linear teacher over 3 classes."""

    classes = [0, 1, 2]

    def __init__(self, n: int, offset: int = 0):
        self.n, self.offset = n, offset
        self.teacher = torch.randn(16, 3, generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.randn(16, generator=torch.Generator().manual_seed(self.offset + int(i)))
        return x, int((x @ self.teacher).argmax())


class Recording(Computed):
    """:class:`Computed` that records the indices it serves (module docstring)."""

    def __init__(self, n: int, record_dir: str):
        super().__init__(n)
        self.record_dir = record_dir

    def __getitem__(self, i: int):
        rank = os.environ.get("RANK")
        if rank is not None:
            with open(os.path.join(self.record_dir, f"served-{rank}.txt"), "a") as fh:
                fh.write(f"{int(i)}\n")
        return super().__getitem__(i)


def recording_pair(record_dir: str, num_train: int = 256, num_val: int = 64):
    """A ``(train, val)`` pair: :class:`Recording` training items, plain validation items."""
    os.makedirs(record_dir, exist_ok=True)
    return Recording(num_train, record_dir), Computed(num_val, offset=10**6)


def served(record_dir: Path, world_size: int) -> list[list[int]]:
    """Each rank's served indices, in order, from :class:`Recording`'s files."""
    return [[int(line) for line in (record_dir / f"served-{r}.txt").read_text().split()]
            for r in range(world_size)]


def global_order(per_rank: list[list[int]], count: int | None = None) -> list[int]:
    """The world's order of samples: a strided sampler gives rank ``r`` the global positions
    ``r, r + W, r + 2W, ...``, so rank ``r``'s ``j``-th sample is global position ``W j + r``.
    ``count``: keep the first ``count`` global positions (a multiple of ``W``)."""
    w = len(per_rank)
    n = min(len(s) for s in per_rank) if count is None else count // w
    assert all(len(s) >= n for s in per_rank), [len(s) for s in per_rank]
    return [per_rank[j % w][j // w] for j in range(w * n)]
