"""The ``logger`` group (issue 38): CSV, MLflow and W&B receive what TensorBoard receives.

The session's shared sweep (three jobs, ``logger=[tensorboard,csv,mlflow,wandb]`` at world_size
2) is read back with each tracker's own reader and held to TensorBoard's event file and
``metrics.json``; a run killed mid-epoch is resumed twice (same world, then another) and its
MLflow run continues; the resume rule and a missing extra are checked in this process.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import (
    QUIET,
    TRACKED_SWEEP,
    assert_no_orphans,
    cli_env,
    refused_before_ranks,
    run_tagged,
    scalars,
    shared_sweep,
    tagged_processes,
    tensorboard_series,
    tests_on_path,
)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """The session's tracked sweep (helpers.TRACKED_SWEEP): three jobs at world_size 2."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    return shared_sweep(tmp_path_factory, *TRACKED_SWEEP)


def mlflow_client(folder: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")


def all_runs(client) -> list:
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def only_run(client):
    """The store's one run (asserting there is exactly one, in any experiment)."""
    runs = all_runs(client)
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return runs[0]


def metrics_of(job: Path) -> dict:
    return json.loads((job / "metrics.json").read_text())


def tb_tags(job_dir: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(job_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [t for t in acc.Tags()["scalars"] if not t.startswith("final/")]


@pytest.mark.slow
def test_mlflow_run_holds_tensorboards_scalars_the_config_and_the_final_metrics(sweep):
    job = sweep / "0"
    client = mlflow_client(sweep)
    (run,) = [r for r in all_runs(client) if r.data.tags["job_dir"] == str(job)]  # one per job
    assert run.info.status == "FINISHED"
    assert json.loads((job / "trackers.json").read_text())["mlflow"]["run_id"] == run.info.run_id
    tags = tb_tags(job)
    assert {"train/loss", "val/loss", "val/accuracy", "train/epoch_loss"} <= set(tags)
    logged = {k for k in run.data.metrics if not k.startswith("final/")}
    assert logged == set(tags)
    for tag in tags:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id,
                                                                              tag))
        expected = scalars(job, tag)
        assert [s for s, _ in history] == [s for s, _ in expected], tag
        assert [v for _, v in history] == pytest.approx([v for _, v in expected], rel=1e-9,
                                                        abs=1e-12), tag
    metrics = metrics_of(job)
    for key in ("val/loss", "val/accuracy", "train/epoch_loss", "global_step", "world_size"):
        assert run.data.metrics[f"final/{key}"] == pytest.approx(metrics[key], rel=1e-9)
    # the parameters: the composed config, flattened (the values the run did not resolve)
    from omegaconf import OmegaConf

    composed = OmegaConf.to_container(OmegaConf.load(job / ".hydra" / "config.yaml"))
    params = run.data.params

    def leaves(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict) and value:
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value
    resolved_by_the_run = {"device", "trainer.monitor_mode", "trainer.test_weights"}
    expected_params = {k: str(v) for k, v in leaves(composed)  # an empty mapping: no leaf
                       if k not in resolved_by_the_run and "${" not in str(v) and v != {}}
    assert {k: params.get(k) for k in expected_params} == expected_params
    assert params["optim.lr"] == "0.01" and params["world_size"] == "2"
    assert params["global_batch_size"] == "64"


@pytest.mark.slow
def test_csv_is_lightnings_layout_with_tensorboards_values(sweep):
    import csv

    job = sweep / "1"
    with open(job / "metrics.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        header, rows = reader.fieldnames, list(reader)
    assert header == sorted(header) and "step" in header  # Lightning: sorted keys, step among
    steps = [int(r["step"]) for r in rows]
    assert steps == sorted(set(steps)), steps  # a row per logged step
    for tag in tb_tags(job):
        got = [(int(r["step"]), float(r[tag])) for r in rows if r[tag]]
        expected = scalars(job, tag)
        assert [s for s, _ in got] == [s for s, _ in expected], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-9), tag
    last = rows[-1]
    for key in ("val/loss", "train/epoch_loss", "val/accuracy"):
        assert float(last[f"final/{key}"]) == metrics_of(job)[key]  # every digit


def wandb_records(path: str):
    """The records of a W&B offline run file (``run-<id>.wandb``): LevelDB's log format, 32 KiB
    blocks of records with a 7-byte header (CRC, length, type: full, first, middle, last),
    after the 7-byte ``:W&B`` file header, each a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


@pytest.mark.slow
def test_wandb_offline_run_holds_the_history_and_the_final_metrics(sweep):
    job = sweep / "2"
    runs = glob.glob(str(job / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, runs
    run_id = json.loads((job / "trackers.json").read_text())["wandb"]["run_id"]
    assert runs[0].endswith(f"run-{run_id}.wandb")
    summary, history = {}, {}
    for record in wandb_records(runs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "summary":
            summary.update({u.key or "/".join(u.nested_key): json.loads(u.value_json)
                            for u in record.summary.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}
            for key, value in items.items():
                if not key.startswith("_"):
                    history.setdefault(key, []).append((record.history.step.num, value))
    for key in ("val/loss", "val/accuracy", "train/epoch_loss", "global_step"):
        assert summary[f"final/{key}"] == metrics_of(job)[key], key  # every digit
    expected = scalars(job, "train/loss")
    assert [s for s, _ in history["train/loss"]] == [s for s, _ in expected]
    assert [v for _, v in history["train/loss"]] == pytest.approx([v for _, v in expected],
                                                                  rel=1e-9)


class FakeSink:
    """A tracker that records what it gets, opened on a run that already holds steps."""

    name = "fake"

    def __init__(self, held: dict[str, int]):
        self.held, self.logged, self.ended = held, [], None

    def open(self, params, purge_step):
        return self.held

    def log(self, step, values):
        self.logged.append((step, dict(values)))

    def flush(self):
        pass

    def finish(self, step, final):
        self.ended = ("finished", step, dict(final))

    def close(self):
        self.ended = ("closed",)


class BrokenSink(FakeSink):
    name = "broken"

    def log(self, step, values):
        raise OSError(28, "No space left on device")


def test_a_resumed_tracker_skips_what_its_run_holds_and_a_broken_one_is_one_warning(caplog):
    from ddp_exp.metrics.trackers import Trackers

    good, broken = FakeSink({"train/loss": 40}), BrokenSink({})
    trackers = Trackers([broken, good], {"a": 1}, purge_step=31)
    trackers.log(40, {"train/loss": 0.5, "val/loss": 0.7})  # train/loss@40 is held already
    trackers.log(50, {"train/loss": 0.4})
    trackers.log(60, {"train/loss": 0.3})
    trackers.finish(60, {"val/loss": 0.25, "backend": "gloo", "stopped_early": False})
    assert good.logged == [(40, {"val/loss": 0.7}), (50, {"train/loss": 0.4}),
                           (60, {"train/loss": 0.3})]
    assert good.ended == ("finished", 60, {"val/loss": 0.25, "stopped_early": 0.0})
    lines = [r.getMessage() for r in caplog.records if "logger.broken" in r.getMessage()]
    assert len(lines) == 1 and "No space left" in lines[0] and "\n" not in lines[0]


class HangingSink(FakeSink):
    """A tracker whose flush waits for ``release`` (a server that does not answer)."""

    name = "hanging"

    def __init__(self):
        super().__init__({})
        import threading

        self.release, self.flushes = threading.Event(), 0

    def flush(self):
        self.flushes += 1
        self.release.wait(30)


def test_sync_waits_for_the_rows_and_a_hung_tracker_holds_one_checkpoint_only(caplog):
    """``Trackers.sync`` (before a checkpoint lands) returns once every row logged before it
    is written; a tracker that does not answer holds one sync for its timeout, one warning,
    and later syncs return at once, queueing nothing, until it catches up."""
    from ddp_exp.metrics.trackers import Trackers

    good = FakeSink({})
    trackers = Trackers([good], {}, purge_step=None)
    trackers.log(5, {"train/loss": 0.5})
    assert trackers.sync(5.0) and good.logged == [(5, {"train/loss": 0.5})]
    trackers.finish(5, {})
    hanging = HangingSink()
    trackers = Trackers([hanging], {}, purge_step=None)
    assert trackers.sync(0.2) is False
    assert trackers.sync(30.0) is False  # at once: the first is still not done
    assert trackers.lagging is not None
    hanging.release.set()
    assert trackers.lagging.wait(10)
    assert trackers.sync(5.0) and hanging.flushes == 2  # the second queued nothing
    lines = [r.getMessage() for r in caplog.records if "logger.hanging" in r.getMessage()]
    assert len(lines) == 1 and "until it catches up" in lines[0], lines
    trackers.finish(5, {})
    assert not trackers.thread.is_alive()

def test_mlflow_sink_reopens_its_run_and_reports_the_steps_it_holds(tmp_path):
    pytest.importorskip("mlflow")
    from ddp_exp.metrics.mlflow_sink import MLflowSink
    from ddp_exp.metrics.trackers import Trackers

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def sink():
        return MLflowSink(str(tmp_path), uri, "exp", "run", {"sweep": "s"})

    opened = sink()
    opened.create_run()  # as the launching process does, before the ranks start
    first = Trackers([opened], {"optim.lr": 0.05}, purge_step=None)
    for step in range(1, 6):
        first.log(step, {"train/loss": 1.0 / step})
    first.close()  # killed: the run stays, KILLED
    again = Trackers([sink()], {"optim.lr": 0.05, "trainer.resume": "auto"}, purge_step=4)
    for step in range(4, 9):  # the resume logs steps 4 and 5 again
        again.log(step, {"train/loss": 1.0 / step})
    again.finish(8, {"val/loss": 0.5})
    client = mlflow_client(tmp_path)
    run = only_run(client)
    assert run.info.status == "FINISHED" and run.data.tags["sweep"] == "s"
    assert run.data.params == {"optim.lr": "0.05"}  # logged once
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(1, 9))
    assert run.data.metrics["final/val/loss"] == 0.5


def test_a_tracker_without_its_library_is_refused_before_any_rank(compose, tmp_path,
                                                                   monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real(name, *a))
    cfg = compose("logger=[tensorboard,mlflow]")
    line = refused_before_ranks(cfg, tmp_path / "run")
    assert line.startswith("logger=mlflow needs the mlflow library")
    assert "pip install 'ddp_exp[mlflow]'" in line


def start_killed(job: Path, cwd: Path, args: list[str], marker: Path) -> None:
    """Run ``python -m ddp_exp <args>`` and SIGKILL its whole process group once ``marker``
    exists (rank 0 held after a mid-epoch checkpoint) and the MLflow run holds the logging
    steps up to that checkpoint (its thread is still writing while rank 0 is held)."""
    tag = uuid.uuid4().hex
    log = cwd / f"killed-{tag}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ddp_exp", *args,
                                 f"hydra.run.dir={job}"], cwd=cwd,
                                env=cli_env(tag, **tests_on_path()), stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while not (marker.exists() and mlflow_holds_checkpoint(job)):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        for pid in tagged_processes(tag):
            os.kill(pid, signal.SIGKILL)
    assert_no_orphans(tag)
    marker.unlink()


def mlflow_holds_checkpoint(job: Path) -> bool:
    """The MLflow run holds train/loss at the step of the newest checkpoint (or later)."""
    from resume_support import mid_epoch

    state = mid_epoch(job / "checkpoints" / "last.pt")
    if state is None or not (job / "trackers.json").exists():
        return False
    run_id = json.loads((job / "trackers.json").read_text())["mlflow"]["run_id"]
    steps = [m.step for m in mlflow_client(job).get_metric_history(run_id, "train/loss")]
    return bool(steps) and max(steps) >= state["global_step"] // 10 * 10


@pytest.mark.slow
def test_a_killed_run_resumed_twice_continues_its_mlflow_run(tmp_path):
    """Killed mid-epoch 2 at world_size 2, resumed at 2 and killed mid-epoch 3, resumed at 1
    (the same global batch): one MLflow run, its id unchanged, train/loss at the steps
    TensorBoard shows, each once."""
    pytest.importorskip("mlflow")
    from resume_support import write_holding_yaml

    job, marker = tmp_path / "run", tmp_path / "held"
    last = str(job / "checkpoints" / "last.pt")
    common = ["logger=[tensorboard,mlflow]", "trainer.epochs=3", "data.global_batch_size=64",
              "trainer.checkpoint_every_n_steps=5", QUIET]
    held = write_holding_yaml(tmp_path / "conf", 33, last, 0, str(marker))  # step 33, epoch 2
    start_killed(job, tmp_path, [*held, *common, "world_size=2"], marker)
    run_id = json.loads((job / "trackers.json").read_text())["mlflow"]["run_id"]
    held = write_holding_yaml(tmp_path / "conf", 25, last, 1, str(marker))  # step 55, epoch 3
    start_killed(job, tmp_path, [*held, *common, "world_size=2", "trainer.resume=auto"],
                 marker)
    write_holding_yaml(tmp_path / "conf")  # a plain MLP
    proc, _ = run_tagged([sys.executable, "-m", "ddp_exp", *held, *common, "world_size=1",
                          "trainer.resume=auto", f"hydra.run.dir={job}"], tmp_path,
                         uuid.uuid4().hex, 240, tests_on_path())
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = mlflow_client(job)
    run = only_run(client)
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    for tag in ("train/loss", "val/loss", "train/epoch_loss"):
        steps = [m.step for m in client.get_metric_history(run_id, tag)]
        assert steps == sorted(set(steps)), (tag, steps)  # strictly increasing
        shown = tensorboard_series(job, tag)
        assert steps == [s for s, _ in shown], tag  # no gap, no duplicate
    values = [m.value for m in client.get_metric_history(run_id, "train/loss")]
    assert values == pytest.approx([v for _, v in tensorboard_series(job, "train/loss")],
                                   rel=1e-6)
    assert [s for s, _ in tensorboard_series(job, "train/loss")] == list(range(10, 73, 10))
    record = json.loads((job / "run.json").read_text())  # each start recorded, the last on top
    assert record["world_size"] == 1 and record["status"] == "completed"
    assert [a["world_size"] for a in record["attempts"]] == [2, 2]
