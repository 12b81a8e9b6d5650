"""A user model that injects faults, plugged in through the public entry (no product change).

``FaultyMLP`` is :class:`ddp_exp.train.models.MLP` (same layers, built in the same order, so the
same
seeded initial weights and the same ``state_dict`` keys) whose ``forward``, in training mode,
counts its calls. At call number ``fault_step`` (1-based: the optimizer step of a fresh process
with ``accumulate_grad_batches=1``) on rank ``fault_rank`` (read from ``os.environ["RANK"]``) it
does one of:

* ``fault: raise``: ``raise RuntimeError("injected failure at step k")``;
* ``fault: nan``: returns outputs full of NaN (the loss becomes NaN);
* ``fault: kill``: ``os.kill(os.getpid(), signal.SIGKILL)``;
* ``fault: exit``: ``sys.exit(0)``; ``fault: os_exit``: ``os._exit(0)`` (a rank that leaves
  with exit code 0 part-way);
* ``fault: stall``: ``time.sleep(600)`` (a rank that stalls: its peers' next collective times
  out, and the launcher stops it);
* ``fault: none``: nothing (a plain MLP).

With ``once_file`` set, the fault fires only if that file does not exist yet, and creates it
when firing, so an elastically restarted world does not fail again.

With ``after_checkpoint`` (a ``last.pt`` path) the fault first waits until that checkpoint
records epoch ``after_epoch`` or later (rank 0 writes it in a background thread, which a loaded
machine may not have finished a few steps into the next epoch): a test that kills "after epoch
k's checkpoint" then kills there, whatever the load.

Use it with a config dir holding ``model/faulty.yaml`` (see :func:`write_model_yaml`), then
``python -m ddp_exp --config-dir <dir> model=faulty`` with this folder on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import yaml

from ddp_exp.train.models import MLP

FAULTS = ("none", "raise", "nan", "kill", "exit", "os_exit", "stall")


class FaultyMLP(MLP):
    def __init__(self, input_shape: Sequence[int], num_outputs: int,
                 hidden_sizes: Sequence[int] = (128,), dropout: float = 0.0,
                 fault: str = "none", fault_step: int = 0, fault_rank: int = 1,
                 once_file: str | None = None, after_checkpoint: str | None = None,
                 after_epoch: int = 0):
        super().__init__(input_shape, num_outputs, hidden_sizes=hidden_sizes, dropout=dropout)
        if fault not in FAULTS:
            raise ValueError(f"fault={fault!r}: one of {FAULTS}")
        self.fault = fault
        self.fault_step = int(fault_step)
        self.fault_rank = int(fault_rank)
        self.once_file = once_file
        self.after_checkpoint = after_checkpoint
        self.after_epoch = int(after_epoch)
        self.calls = 0  # a plain attribute: not in the state_dict

    def _fires(self) -> bool:
        if self.fault == "none" or self.calls != self.fault_step:
            return False
        if int(os.environ.get("RANK", "-1")) != self.fault_rank:
            return False
        if self.once_file:
            try:  # create exclusively: fires once even across restarts
                fd = os.open(self.once_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return False
            os.write(fd, f"{self.fault} rank {self.fault_rank} step {self.calls}\n".encode())
            os.close(fd)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if not self.training:
            return out
        self.calls += 1
        if self._fires():
            if self.after_checkpoint:
                wait_for_checkpoint(self.after_checkpoint, self.after_epoch)
            if self.fault == "raise":
                raise RuntimeError(f"injected failure at step {self.calls}")
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault == "exit":
                sys.exit(0)
            if self.fault == "os_exit":
                os._exit(0)
            if self.fault == "stall":
                time.sleep(600)
            if self.fault == "nan":
                return out * float("nan")
        return out


def wait_for_checkpoint(path: str, epoch: int, timeout_s: float = 120.0) -> None:
    """Poll ``path`` (every 10 ms) until it holds a checkpoint of ``epoch`` or later; a
    checkpoint that never comes fails the rank after ``timeout_s`` seconds (the test then
    fails on the wrong epoch, not on a hang)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if torch.load(path, weights_only=True)["epoch"] >= epoch:
                return
        except (OSError, RuntimeError, KeyError):  # not there yet (renamed into place whole)
            pass
        time.sleep(0.01)
    raise RuntimeError(f"{path} never held epoch {epoch} within {timeout_s:.0f} s")


def write_model_yaml(config_dir: Path, name: str = "faulty", fault: str = "none",
                     fault_step: int = 0, fault_rank: int = 1, once_file: str | None = None,
                     hidden_sizes: Sequence[int] = (128,), dropout: float = 0.0,
                     after_checkpoint: str | None = None, after_epoch: int = 0) -> Path:
    """Write ``<config_dir>/model/<name>.yaml`` for :class:`FaultyMLP`; returns ``config_dir``.

    ``hidden_sizes`` and ``dropout`` default to conf/model/mlp.yaml's values, so the faulty
    model starts from the same seeded weights as ``model=mlp``."""
    node = {"_target_": "faulty.FaultyMLP", "hidden_sizes": list(hidden_sizes),
            "dropout": dropout, "fault": fault, "fault_step": fault_step,
            "fault_rank": fault_rank, "once_file": once_file,
            "after_checkpoint": after_checkpoint, "after_epoch": after_epoch}
    folder = Path(config_dir) / "model"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(node, sort_keys=False))
    return Path(config_dir)


class EnvProbeMLP(MLP):
    """:class:`ddp_exp.train.models.MLP` that, at its first training forward in each rank, writes
    the
    rank's distributed environment and ``torch.get_num_threads()`` (``threads``) to
    ``<probe_dir>/rank<RANK>.json``."""

    KEYS = ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "WORLD_SIZE")

    def __init__(self, input_shape: Sequence[int], num_outputs: int, probe_dir: str,
                 hidden_sizes: Sequence[int] = (128,)):
        super().__init__(input_shape, num_outputs, hidden_sizes=hidden_sizes)
        self.probe_dir = probe_dir
        self.written = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and not self.written:
            import json

            env = {k: os.environ.get(k) for k in self.KEYS}
            env["threads"] = torch.get_num_threads()  # this rank's intra-op threads
            path = Path(self.probe_dir) / f"rank{os.environ['RANK']}.json"
            path.write_text(json.dumps(env))
            self.written = True
        return super().forward(x)


def slow_digits(**_options):
    """``data._target_`` that takes ``DDP_EXP_TEST_LOAD_S`` seconds to load the digits: a window
    in which the launcher is busy before any rank exists."""
    import time

    from ddp_exp.data import load_digits

    time.sleep(float(os.environ.get("DDP_EXP_TEST_LOAD_S", "0")))
    return load_digits()


class SlowRankMLP(MLP):
    """:class:`ddp_exp.train.models.MLP` (same layers, same seeded weights) whose training forward
    sleeps ``sleep_s`` seconds on rank ``slow_rank`` only: a straggler, for the ``perf/*``
    dashboards."""

    def __init__(self, input_shape: Sequence[int], num_outputs: int,
                 hidden_sizes: Sequence[int] = (128,), dropout: float = 0.0,
                 sleep_s: float = 0.05, slow_rank: int = 1):
        super().__init__(input_shape, num_outputs, hidden_sizes=hidden_sizes, dropout=dropout)
        self.sleep_s = float(sleep_s)
        self.slow_rank = int(slow_rank)  # the model is built before the ranks: RANK read later

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and int(os.environ.get("RANK", "-1")) == self.slow_rank:
            import time

            time.sleep(self.sleep_s)
        return super().forward(x)


class ShapedOutput(torch.nn.Module):
    """A user model whose output has the wrong shape or type, for the launcher's output check:
    ``kind`` ``width`` returns ``[batch, width]`` whatever the data needs, ``flat`` returns
    ``[batch]`` (the last dimension squeezed), ``dict`` returns ``{"logits": [batch,
    num_outputs]}`` and ``tuple`` returns ``([batch, num_outputs], [batch, num_outputs])``."""

    def __init__(self, input_shape: Sequence[int], num_outputs: int, kind: str = "width",
                 width: int = 3):
        super().__init__()
        import math

        self.kind = kind
        out = width if kind == "width" else num_outputs
        self.net = torch.nn.Sequential(torch.nn.Flatten(),
                                       torch.nn.Linear(math.prod(input_shape), out))

    def forward(self, x: torch.Tensor):
        out = self.net(x)
        if self.kind == "flat":
            return out[:, 0]
        if self.kind == "dict":
            return {"logits": out}
        if self.kind == "tuple":
            return out, out
        return out


class RaisingDigits(torch.utils.data.Dataset):
    """scikit-learn's digits as a map-style Dataset (``(float32 [1, 8, 8], label)``) whose
    ``__getitem__`` raises ``ValueError("bad item <i>")`` when read inside a rank (``RANK`` in
    the environment), so that the launcher's probe reads its items and a rank fails on its
    first batch: a bug in a user's Dataset."""

    classes = [str(d) for d in range(10)]

    def __init__(self):
        from ddp_exp.data import load_digits

        arrays = load_digits()
        self.features, self.targets = arrays.features, arrays.targets

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, i: int):
        if "RANK" in os.environ:
            raise ValueError(f"bad item {i}")
        return torch.from_numpy(self.features[i]), int(self.targets[i])


class BrokenParameters(MLP):
    """:class:`ddp_exp.train.models.MLP` whose ``parameters()`` raises ``RuntimeError("parameters
    are broken")``: the launcher's build fails with an exception that is no refusal of the
    input, where it builds the optimizer."""

    def __init__(self, input_shape: Sequence[int], num_outputs: int):
        super().__init__(input_shape, num_outputs)

    def parameters(self, recurse: bool = True):
        raise RuntimeError("parameters are broken")
