"""Metric sums, hparams flattening, atomic files and threads per rank, in one process."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed as dist

from ddp_exp.distributed import process_group as distributed
from ddp_exp.io.files import atomic_write
from ddp_exp.metrics.writer import Accumulator, finite_or_none, flatten_hparams, write_json_atomic


# ---------------------------------------------------------------------------- Accumulator
def test_accumulator_adds_tensors_and_numbers_without_a_process_group():
    assert not dist.is_initialized()
    acc = Accumulator(("loss_sum", "correct", "num_samples"), torch.device("cpu"))
    losses = [torch.tensor(0.25), torch.tensor(1.5, dtype=torch.float32), torch.tensor(2.0)]
    sizes = [4, 4, 3]
    for loss, size in zip(losses, sizes, strict=True):
        acc.add("loss_sum", loss, weight=size)          # tensor on the device
        acc.add("num_samples", size)                     # number on the host
    acc.add("correct", torch.tensor(7))                  # integer tensor
    acc.add("correct", 2.0)                              # and a number into the same sum

    totals = acc.reduce()

    assert set(totals) == {"loss_sum", "correct", "num_samples"}
    assert all(isinstance(v, float) for v in totals.values())
    assert totals["loss_sum"] == pytest.approx(0.25 * 4 + 1.5 * 4 + 2.0 * 3, rel=1e-12)
    assert totals["num_samples"] == 11.0
    assert totals["correct"] == 9.0


def test_accumulator_reduce_resets_the_sums():
    acc = Accumulator(("a", "b"), torch.device("cpu"))
    acc.add("a", torch.tensor(3.0))
    acc.add("b", 5)
    assert acc.reduce() == {"a": 3.0, "b": 5.0}
    assert acc.reduce() == {"a": 0.0, "b": 0.0}
    acc.add("a", 1)
    assert acc.reduce() == {"a": 1.0, "b": 0.0}


def test_accumulator_sums_in_float64():
    # 1e8 + 1 is not representable in float32; the sums must not lose the 1.
    acc = Accumulator(("s",), torch.device("cpu"))
    acc.add("s", torch.tensor(1e8, dtype=torch.float32))
    acc.add("s", torch.tensor(1.0, dtype=torch.float32))
    acc.add("s", 0.5)
    assert acc.reduce()["s"] == 100_000_001.5


# ------------------------------------------------------------------------- flatten_hparams
def test_flatten_hparams_dotted_keys_and_types():
    cfg = {
        "world_size": 2,
        "seed": 0,
        "print_config": True,
        "data": {"batch_size": 32, "shuffle": False, "path": "a.csv", "extra": None},
        "model": {"hidden_sizes": [128, 64], "dropout": 0.5},
        "trainer": {"max_steps": None, "nested": {"deep": 1.25}},
    }
    flat = flatten_hparams(cfg)
    assert flat == {
        "world_size": 2,
        "seed": 0,
        "print_config": "True",
        "data.batch_size": 32,
        "data.shuffle": "False",
        "data.path": "a.csv",
        "data.extra": "None",
        "model.hidden_sizes": "[128, 64]",
        "model.dropout": 0.5,
        "trainer.max_steps": "None",
        "trainer.nested.deep": 1.25,
    }
    # The HParams plugin takes numbers and strings; bools must not pass as ints.
    for key, value in flat.items():
        assert type(value) in (int, float, str), (key, value)


# ---------------------------------------------------------------------- JSON and atomic files
def test_write_json_atomic_writes_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "metrics.json"
    payload = {"val/loss": 0.5, "val/accuracy": None, "epoch": 3}
    write_json_atomic(str(path), payload)
    assert json.loads(path.read_text()) == payload
    assert os.listdir(tmp_path) == ["metrics.json"]

    write_json_atomic(str(path), {"epoch": 4})  # replaces the old content
    assert json.loads(path.read_text()) == {"epoch": 4}
    assert os.listdir(tmp_path) == ["metrics.json"]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_write_json_atomic_rejects_non_finite(tmp_path, bad):
    path = tmp_path / "metrics.json"
    path.write_text('{"old": 1}\n')
    with pytest.raises(ValueError):
        write_json_atomic(str(path), {"val/loss": bad})
    assert json.loads(path.read_text()) == {"old": 1}
    assert os.listdir(tmp_path) == ["metrics.json"]


def test_finite_or_none():
    assert finite_or_none(math.nan) is None
    assert finite_or_none(math.inf) is None
    assert finite_or_none(-math.inf) is None
    assert finite_or_none(None) is None
    assert finite_or_none(0.0) == 0.0
    assert finite_or_none(-2.5) == -2.5


def test_finite_or_none_makes_nan_writable(tmp_path):
    path = tmp_path / "m.json"
    write_json_atomic(str(path), {"val/loss": finite_or_none(math.nan)})
    assert json.loads(path.read_text()) == {"val/loss": None}


def test_atomic_write_keeps_old_file_when_write_raises(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"old content")

    def failing(fh):
        fh.write(b"half of the new")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        atomic_write(str(path), failing)
    assert path.read_bytes() == b"old content"
    assert os.listdir(tmp_path) == ["model.pt"]


def test_atomic_write_failure_on_a_new_path_creates_nothing(tmp_path):
    def failing(fh):
        fh.write(b"partial")
        raise KeyboardInterrupt  # BaseException too: Ctrl-C mid-write

    with pytest.raises(KeyboardInterrupt):
        atomic_write(str(tmp_path / "new.bin"), failing)
    assert os.listdir(tmp_path) == []


def test_atomic_write_replaces_on_success(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")
    atomic_write(str(path), lambda fh: fh.write(b"new content"))
    assert path.read_bytes() == b"new content"
    assert os.listdir(tmp_path) == ["f.bin"]


# --------------------------------------------------------------------------- threads per rank
def _cores(monkeypatch, n: int) -> None:
    """Pretend this process may use ``n`` cores, however the product counts them."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: n)
    if hasattr(os, "process_cpu_count"):
        monkeypatch.setattr(os, "process_cpu_count", lambda: n)


@pytest.mark.parametrize(("cores", "local_world_size", "threads"), [
    (1, 1, 1), (1, 4, 1),  # one core: one thread, however many ranks
    (2, 1, 2), (2, 2, 1), (2, 3, 1),  # more ranks than cores: still one each
    (8, 1, 8), (8, 2, 4), (8, 3, 2), (8, 4, 2),  # 8 // 3: the remainder stays idle
    (16, 4, 4), (16, 32, 1),
])
def test_threads_per_rank_default_splits_cores(monkeypatch, cores, local_world_size, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _cores(monkeypatch, cores)
    assert distributed.threads_per_rank(local_world_size) == threads


@pytest.mark.parametrize("local_world_size", [1, 2, 4])
@pytest.mark.parametrize("user", ["1", "2", "3", "7"])
def test_threads_per_rank_honours_omp_num_threads(monkeypatch, local_world_size, user):
    monkeypatch.setenv("OMP_NUM_THREADS", user)
    _cores(monkeypatch, 8)
    assert distributed.threads_per_rank(local_world_size) == int(user)


@pytest.mark.parametrize(("cores", "local_world_size", "num_workers", "threads"), [
    (2, 1, 1, 1),  # a rank and its worker share the 2 cores
    (8, 1, 1, 4), (8, 1, 3, 2), (8, 2, 1, 2), (8, 2, 3, 1),
    (16, 1, 2, 5), (16, 2, 3, 2),
    (2, 2, 3, 1),  # never fewer than one
])
def test_dataloader_workers_take_cores_too(monkeypatch, cores, local_world_size, num_workers,
                                           threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _cores(monkeypatch, cores)
    assert distributed.threads_per_rank(local_world_size, num_workers) == threads


def test_threads_per_rank_on_this_machine(monkeypatch):
    """The cores counted are those this process may run on (its affinity)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert distributed.threads_per_rank(1) == cores  # one rank: every core
    assert distributed.threads_per_rank(cores) == 1
    assert distributed.threads_per_rank(2 * cores) == 1


# -------------------------------------------------------------------- the event stream
def test_flush_puts_every_queued_scalar_in_the_event_file_at_once(tmp_path):
    """After an epoch (MetricsWriter.flush) the event file holds every scalar queued so far:
    TensorBoard's writer thread has nothing left to do during the next epoch's loop."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ddp_exp.metrics.writer import MetricsWriter

    writer = MetricsWriter(str(tmp_path), {"lr": 0.1}, enabled=True)
    for step in (10, 20, 30):
        writer.queue_scalars(step, {"train/loss": 1.0 / step, "train/grad_norm": None})
    writer.scalars(30, {"train/epoch_loss": 0.5})
    writer.flush()
    assert writer.queued == []
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents*"))
    acc = EventAccumulator(str(files[0]), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (10, pytest.approx(0.1)), (20, pytest.approx(0.05)), (30, pytest.approx(1 / 30))]
    assert [e.step for e in acc.Scalars("train/epoch_loss")] == [30]
    assert "train/grad_norm" not in acc.Tags()["scalars"]
    writer.close()
