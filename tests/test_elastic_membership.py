"""Issue 30 item 5: under ``torchrun --nnodes=MIN:MAX`` (c10d), a node that leaves makes torch
elastic restart the workers with a smaller ``WORLD_SIZE``; ddp_exp continues from the last step
checkpoint at the new world size with the global batch held (``data.global_batch_size``), says
so in one line and records the restarts and world sizes in ``metrics.json``.

Two torchrun agents on loopback, one rank each; once a step checkpoint in the middle of epoch 2
is on disk, the second agent's whole process group is killed (the agent alone would orphan its
rank). The dataset records what each rank fetched, so the test checks that each sample of each
epoch is trained exactly once across the two worlds.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from helpers import HANG_S, QUIET, cli_env, free_port, tagged_processes
from helpers import tests_on_path as on_path
from torch.utils.data import Dataset

RECORD_ENV = "DDP_EXP_TEST_RECORD"
N_TRAIN, GLOBAL_BATCH, EPOCHS = 512, 64, 2  # both worlds (2 and 1) divide 512 and 64
STEPS_PER_EPOCH = N_TRAIN // GLOBAL_BATCH
CHECKPOINT_EVERY = 3


def _fetched_by_a_loader() -> bool:
    """True when ddp_exp's loader asks for the item (a training batch: ``BatchFetch``, in the
    rank or a DataLoader worker), not a probe of the data before training."""
    frame = sys._getframe(2)
    for _ in range(10):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(os.path.join("data", "loaders.py")):
            return True
        frame = frame.f_back
    return False


class Recording(Dataset):
    """Digits ``[start, stop)`` one item at a time (``(float32 [1, 8, 8], label)``), each
    loader fetch appended to ``$DDP_EXP_TEST_RECORD`` as ``<restart> <world_size> <rank>
    <index>``, ``sleep_s`` per item (a step long enough for the test to act mid-epoch)."""

    classes = [str(d) for d in range(10)]

    def __init__(self, start: int, stop: int | None, record: bool, sleep_s: float = 0.0):
        from ddp_exp.data import load_digits

        arrays = load_digits()
        self.features = arrays.features[start:stop]
        self.targets = arrays.targets[start:stop]
        self.record, self.sleep_s = record, sleep_s

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, i: int):
        if self.record and _fetched_by_a_loader():
            env = os.environ
            with open(env[RECORD_ENV], "a") as fh:
                fh.write(f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')} {env['WORLD_SIZE']} "
                         f"{env['RANK']} {i}\n")
            time.sleep(self.sleep_s)
        return torch.from_numpy(self.features[i]), int(self.targets[i])


def recorded_pair(sleep_s: float = 0.0):
    """``data._target_``: the first 512 digits recorded, the next 256 for validation."""
    return Recording(0, N_TRAIN, True, sleep_s), Recording(N_TRAIN, N_TRAIN + 256, False)


def agent(job: Path, port: int, is_host: bool, tag: str, record: Path, log: Path
          ) -> subprocess.Popen:
    """One torchrun agent (one rank) of an elastic world of 1 to 2 nodes, in its own session."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1",
           "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           f"--rdzv-id=elastic-{port}",
           # last_call_timeout: how long a round waits for more nodes once one is there; 3 s
           # covers the two agents' start-up skew on a loaded machine, so both join round 1.
           f"--rdzv-conf=is_host={str(is_host).lower()},keep_alive_interval=1,"
           "keep_alive_max_attempt=2,last_call_timeout=3",
           "-m", "ddp_exp", "data=dataset", "data._target_=test_elastic_membership.recorded_pair",
           "+data.sleep_s=0.0005", f"data.global_batch_size={GLOBAL_BATCH}",
           f"trainer.epochs={EPOCHS}", f"trainer.checkpoint_every_n_steps={CHECKPOINT_EVERY}",
           QUIET, f"hydra.run.dir={job}"]
    env = cli_env(tag, **on_path(), **{RECORD_ENV: str(record)},
                  TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=job.parent, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def checkpoint_step(path: Path) -> int | None:
    with contextlib.suppress(Exception):  # not there yet
        return int(torch.load(path, weights_only=True, map_location="cpu")["global_step"])
    return None


def kill_node(proc: subprocess.Popen, tag: str) -> None:
    """SIGKILL a node: its agent's process group and its ranks (torch's agent starts each rank
    in a session of its own, so the group alone would leave the rank training)."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in tagged_processes(tag):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow  # starts worlds of processes: make test, not test-fast
def test_a_node_leaves_and_the_other_continues_from_the_last_step_checkpoint(tmp_path):
    tags = [uuid.uuid4().hex, uuid.uuid4().hex]
    job, record = tmp_path / "run", tmp_path / "fetched.txt"
    port = free_port()
    logs = [tmp_path / "agent0.log", tmp_path / "agent1.log"]
    # The guest first: it waits for the host's store, so both join the first round together
    # (a node that joins after it closes makes the world restart once more).
    guest = agent(job, port, False, tags[1], record, logs[1])
    host = agent(job, port, True, tags[0], record, logs[0])
    try:
        deadline = time.monotonic() + HANG_S
        seen = None
        while True:  # a step checkpoint inside epoch 2, steps left to run
            seen = checkpoint_step(job / "checkpoints" / "last.pt")
            if seen is not None and STEPS_PER_EPOCH < seen < 2 * STEPS_PER_EPOCH - 2:
                break
            assert host.poll() is None and guest.poll() is None and time.monotonic() < deadline, \
                f"no mid-epoch checkpoint (last seen {seen}):\n{logs[0].read_text()[-3000:]}"
            time.sleep(0.01)
        kill_node(guest, tags[1])
        guest.wait()
        assert host.wait(timeout=HANG_S) == 0, logs[0].read_text()[-5000:]
    finally:
        kill_node(host, tags[0])
        kill_node(guest, tags[1])
    text = logs[0].read_text()
    changed = [line for line in text.splitlines() if "resuming a world of" in line]
    assert len(changed) == 1 and "a world of 2 rank(s) with 1" in changed[0], text[-5000:]
    resumed = re.findall(r"resumed from \S+: step (\d+), inside epoch 2", text)
    assert len(resumed) == 1, text[-5000:]
    resumed_at = int(resumed[0])  # the last step checkpoint before the kill
    assert resumed_at >= seen and resumed_at % CHECKPOINT_EVERY == 0, resumed_at
    metrics = json.loads((job / "metrics.json").read_text())
    assert metrics["world_size"] == 1 and metrics["restarts"] == 1
    assert metrics["world_sizes"] == [2, 1]
    assert metrics["global_step"] == EPOCHS * STEPS_PER_EPOCH

    # Each sample of each epoch trained once: world 2's fetches up to the checkpoint (32 per
    # rank and step), then world 1's (64 per step).
    fetched: dict[tuple[int, int, int], list[int]] = {}
    for line in record.read_text().splitlines():
        restart, world, rank, index = map(int, line.split())
        fetched.setdefault((restart, world, rank), []).append(index)
    per_rank = GLOBAL_BATCH // 2
    steps: list[list[int]] = [
        fetched[(0, 2, 0)][k * per_rank:(k + 1) * per_rank]
        + fetched[(0, 2, 1)][k * per_rank:(k + 1) * per_rank] for k in range(resumed_at)]
    after = fetched[(1, 1, 0)]
    steps += [after[k:k + GLOBAL_BATCH] for k in range(0, len(after), GLOBAL_BATCH)]
    assert len(steps) == EPOCHS * STEPS_PER_EPOCH
    for epoch in range(EPOCHS):
        samples = sorted(i for step in steps[epoch * STEPS_PER_EPOCH:(epoch + 1) * STEPS_PER_EPOCH]
                         for i in step)
        assert samples == list(range(N_TRAIN)), f"epoch {epoch + 1}"
    with pytest.raises(KeyError):  # no third world
        fetched[(1, 2, 0)]


def test_world_sizes_are_recorded_once_they_change(tmp_path):
    """metrics.json's ``world_sizes``: the sizes in order; a run that never changed size writes
    no history file (a killed first attempt's folder stays one ddp_exp can clear)."""
    from ddp_exp.rank.preemption import WORLDS_FILE, world_sizes

    history = tmp_path / "checkpoints" / WORLDS_FILE
    (tmp_path / "checkpoints").mkdir()
    assert world_sizes(str(tmp_path), 2, None, True) == [2]
    assert world_sizes(str(tmp_path), 2, {"world_size": 2}, True) == [2]
    assert not history.exists()
    assert world_sizes(str(tmp_path), 1, {"world_size": 2}, False) == [2, 1]  # not rank 0
    assert not history.exists()
    assert world_sizes(str(tmp_path), 1, {"world_size": 2}, True) == [2, 1]
    assert json.loads(history.read_text()) == [2, 1]
    assert world_sizes(str(tmp_path), 1, {"world_size": 1}, True) == [2, 1]
    assert world_sizes(str(tmp_path), 4, {"world_size": 1}, True) == [2, 1, 4]
    assert json.loads(history.read_text()) == [2, 1, 4]
