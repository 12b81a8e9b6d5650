"""One way to take a checkpoint (issue 42 item 1): the end of an epoch, the step cadence, the
minutes, ``trainer.max_steps``' stop and a preemption are all taken by
``ddp_exp.train.checkpointing.take`` and landed by ``checkpointing.land`` on the background
writer, and none waits for the ranks' RNG states on the loop's thread."""

from __future__ import annotations

import os

import pytest
import torch


def _one_rank(cfg: dict, job_dir: str, port: int, out) -> None:
    """A world of one in a spawned process: three loops (the step cadence over two epochs;
    the minutes always due with ``max_steps`` stopping the second epoch; a preemption), every
    landing recorded as (kind of run, global step, position, names due, thread). Puts the
    record and the loaded last.pt of each run on ``out``."""
    import threading

    from helpers import one_rank_digits_world

    from ddp_exp.config.view import rank_config
    from ddp_exp.distributed import process_group
    from ddp_exp.distributed.process_group import destroy_process_group
    from ddp_exp.metrics.writer import MetricsWriter
    from ddp_exp.train import checkpointing
    from ddp_exp.train import state as train_state
    from ddp_exp.train.loop import Trainer
    from ddp_exp.train.models import MLP
    from ddp_exp.train.objective import Objective
    from ddp_exp.train.step_checkpoint import Preempted

    world, datasets = one_rank_digits_world(port)
    landed, waits = [], []
    run = ["?"]

    def waited_on_loop_thread(device):
        waits.append(run[0])
        raise AssertionError("the RNG gather waited for on the loop's thread")

    land, wait = checkpointing.land, process_group.RngGather.wait

    def recording_land(loop, taken, due):
        landed.append((run[0], taken.state["global_step"], taken.state["position"],
                       tuple(due)))
        return land(loop, taken, due)

    def recording_wait(self):
        if threading.current_thread() is threading.main_thread():
            waits.append(run[0])
        return wait(self)

    train_state.gather_rng_states = waited_on_loop_thread
    process_group.gather_rng_states = waited_on_loop_thread
    checkpointing.land = recording_land
    process_group.RngGather.wait = recording_wait
    try:
        for name, trainer_keys, preempt_at in (
                ("steps", {"epochs": 2, "checkpoint_every_n_steps": 10,
                           "checkpoint_every_n_epochs": 1}, None),
                ("minutes", {"epochs": 2, "max_steps": 60,
                             "checkpoint_every_n_minutes": 1e-9}, None),
                ("preempt", {"epochs": 2}, 7)):
            run[0] = name
            conf = {**cfg, "trainer": {**cfg["trainer"], **trainer_keys}}
            torch.manual_seed(0)
            loop = Trainer(rank_config(conf), world, datasets, MLP((1, 8, 8), 10, [32]),
                           Objective(10), torch.device("cpu"),
                           MetricsWriter(os.path.join(job_dir, name), {}, enabled=False))
            if preempt_at is not None:
                loop.cadence.preempt_requested = (lambda t=loop, at=preempt_at:
                                                  t.global_step >= at)
            try:
                loop.fit()
            except Preempted:
                pass
        # A preemption whose checkpoint cannot land (a full disk) is no preemption: the
        # requeued job would find no checkpoint of where it stopped.
        from ddp_exp.io import checkpoint as files

        def full_disk(path, data):
            raise OSError(28, "No space left on device")

        files._write_bytes, written = full_disk, files._write_bytes
        run[0] = "preempt, disk full"
        torch.manual_seed(0)
        loop = Trainer(rank_config({**cfg, "trainer": {**cfg["trainer"], "epochs": 2}}), world,
                       datasets, MLP((1, 8, 8), 10, [32]), Objective(10), torch.device("cpu"),
                       MetricsWriter(os.path.join(job_dir, "full"), {}, enabled=False))
        loop.cadence.preempt_requested = lambda: loop.global_step >= 7
        try:
            loop.fit()
            raised = None
        except BaseException as exc:  # noqa: BLE001  (which one is the claim)
            raised = (type(exc).__name__, type(exc.__cause__).__name__)
        files._write_bytes = written
        landed.append(("preempt, disk full", raised))
        last = {name: {k: v for k, v in torch.load(
            os.path.join(job_dir, name, "checkpoints", "last.pt"), weights_only=True).items()
            if k in ("global_step", "position", "epoch")} for name in ("steps", "minutes",
                                                                        "preempt")}
        out.put((landed, waits, last))
    finally:
        destroy_process_group()


@pytest.mark.slow  # starts a world of one
def test_every_checkpoint_is_taken_and_landed_by_one_path(tmp_path, compose):
    """Digits at batch 32 (47 steps an epoch), a check every 5 steps. The step cadence of 10
    lands step checkpoints at 10, 20, 30, 40 and 50 .. 90 (never at an epoch's last step) and
    each epoch's checkpoint under last.pt and its epoch file; the minutes, always due,
    checkpoint at checks inside the epochs and at the first epoch's end, and max_steps=60
    stops the second epoch with a step checkpoint at 60 (no monitor: no best.pt); a preemption
    told at step 7 stops at the check of step 15 with a step checkpoint there. Every one goes
    through the same land, and no RNG gather is waited for on the loop's thread. A preemption
    whose checkpoint cannot land (a full disk) ends in the disk's error, not as preempted."""
    from helpers import in_spawned_rank
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(compose("world_size=1", "trainer.log_every_n_steps=5",
                                         "trainer.progress=off", "trainer.perf_metrics=false",
                                         "trainer.preempt_signal=null", "trainer.monitor=null"),
                                 resolve=True, enum_to_str=True)
    landed, waits, last = in_spawned_rank(_one_rank, cfg, str(tmp_path))
    landed, full = landed[:-1], landed[-1:]
    assert waits == []
    inside = (False, True, False)  # Due: last.pt only
    epoch_end = (True, True, False)  # epoch file and last.pt (no monitor: no best.pt)
    steps = [(s, (s - 47 * (s > 47)) * 32, inside) for s in range(10, 100, 10)]
    want = sorted(steps + [(47, 0, epoch_end), (94, 0, epoch_end)])
    assert [(s, p, d) for r, s, p, d in landed if r == "steps"] == want
    minutes = [(s, p, d) for r, s, p, d in landed if r == "minutes"]
    assert minutes[0] == (10, 10 * 32, inside)  # the check started at 5 carries the flag
    assert (47, 0, (False, True, False)) in minutes  # the epoch's own, due by the clock
    assert all(d == inside and p == (s - 47 * (s > 47)) * 32
               for s, p, d in minutes if s != 47), minutes
    assert minutes[-1] == (60, 13 * 32, inside)  # max_steps stopped epoch 2: a step checkpoint
    assert [(s, p) for r, s, p, _ in landed if r == "preempt"] == [(15, 15 * 32)]
    assert full == [("preempt, disk full", ("OSError", "Preempted"))]  # the write's error
    assert last == {"steps": {"global_step": 94, "position": 0, "epoch": 1},
                    "minutes": {"global_step": 60, "position": 13 * 32, "epoch": 0},
                    "preempt": {"global_step": 15, "position": 15 * 32, "epoch": -1}}


def _deferred_snapshots(cfg: dict, job_dir: str, port: int, out) -> None:
    """A world of one in a spawned process: the digits MLP (no buffers) and the same MLP with
    a BatchNorm (buffers a forward writes), three epochs each with an epoch file per epoch.
    The writer's snapshot of the weights is slowed by 0.3 s (a loop not waiting for it
    would take hundreds of steps meanwhile). Puts, per model, the snapshots taken on the
    writer's thread (the keys they held), the epochs seen, where the epoch files differ from
    the loop's weights and momentum read at each epoch's end (:func:`_differences`), and
    whether the first two epoch files differ (the epochs trained)."""
    import threading
    import time

    from helpers import one_rank_digits_world
    from torch import nn

    from ddp_exp.config.view import rank_config
    from ddp_exp.distributed.process_group import destroy_process_group
    from ddp_exp.io import checkpoint
    from ddp_exp.metrics.writer import MetricsWriter
    from ddp_exp.train import checkpointing
    from ddp_exp.train.loop import Trainer
    from ddp_exp.train.models import MLP
    from ddp_exp.train.objective import Objective

    world, datasets = one_rank_digits_world(port)
    on_writer, at_end = [], []
    snapshot, epoch_end = checkpoint.snapshot, checkpointing.at_epoch_end

    def slow_snapshot(value):
        if (threading.current_thread() is not threading.main_thread()
                and type(value) is dict and "model" in value):  # not its recursive calls
            on_writer.append(sorted(set(value) & {"model", "optimizer", "monitor"}))
            time.sleep(0.3)
        return snapshot(value)

    def recording_epoch_end(loop, *args, **kwargs):
        at_end.append(({k: v.clone() for k, v in loop.model.state_dict().items()},
                       snapshot(loop.optimizer.state_dict()["state"])))
        return epoch_end(loop, *args, **kwargs)

    checkpoint.snapshot = slow_snapshot
    checkpointing.at_epoch_end = recording_epoch_end
    try:
        result = {}
        for name, extra in (("mlp", None), ("batchnorm", nn.BatchNorm1d(10))):
            on_writer.clear()
            at_end.clear()
            torch.manual_seed(0)
            model = MLP((1, 8, 8), 10, [32])
            if extra is not None:
                model.net.append(extra)
            loop = Trainer(rank_config(cfg), world, datasets, model, Objective(10),
                           torch.device("cpu"),
                           MetricsWriter(os.path.join(job_dir, name), {}, enabled=False))
            loop.fit()
            files = [torch.load(os.path.join(job_dir, name, "checkpoints", f"epoch_{e:04d}.pt"),
                                weights_only=True) for e in range(3)]
            result[name] = {"on_writer": list(on_writer), "epochs": len(at_end),
                            "differ": _differences(at_end, files),
                            "trained": not torch.equal(next(iter(files[0]["model"].values())),
                                                       next(iter(files[1]["model"].values())))}
        out.put(result)  # plain values: a tensor on the queue outlives this process's fds
    finally:
        destroy_process_group()


@pytest.mark.slow  # starts a world of one
def test_the_writer_snapshots_the_weights_before_the_next_step_changes_them(tmp_path, compose):
    """The epoch checkpoint's model and optimizer are snapshotted on the background writer's
    thread while the next epoch starts (issue 42: off the loop's thread), and the loop's next
    optimizer step waits for it: each epoch file holds, bit for bit, the weights and momentum
    the loop had at that epoch's end, although the writer's snapshot took 0.3 s. A model with
    buffers (BatchNorm's running statistics, which a forward writes) is snapshotted on the
    loop's thread, as before."""
    from helpers import in_spawned_rank
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(compose("world_size=1", "trainer.progress=off",
                                         "trainer.epochs=3", "trainer.monitor=null",
                                         "trainer.checkpoint_every_n_epochs=1",
                                         "trainer.keep_checkpoints=5",
                                         "trainer.preempt_signal=null"),
                                 resolve=True, enum_to_str=True)
    result = in_spawned_rank(_deferred_snapshots, cfg, str(tmp_path))
    assert result == {
        "mlp": {"on_writer": [["model", "monitor", "optimizer"]] * 3, "epochs": 3, "differ": [],
                "trained": True},
        "batchnorm": {"on_writer": [], "epochs": 3, "differ": [], "trained": True}}


def _differences(at_end: list, files: list) -> list[str]:
    """Where the epoch files' weights and momentum differ (not bit for bit) from what the loop
    held at each epoch's end (``at_end``: (model state, optimizer state) pairs)."""
    differ = []
    for epoch, ((weights, momentum), saved) in enumerate(zip(at_end, files, strict=True)):
        if list(saved["model"]) != list(weights):
            differ.append(f"epoch {epoch}: model keys")
        differ += [f"epoch {epoch}: {key}" for key, tensor in weights.items()
                   if not torch.equal(saved["model"][key], tensor)]
        state = saved["optimizer"]["state"]
        if sorted(state) != sorted(momentum):
            differ.append(f"epoch {epoch}: optimizer keys")
        differ += [f"epoch {epoch}: optimizer {index}.{key}"
                   for index, buffers in momentum.items() for key, value in buffers.items()
                   if not torch.equal(state[index][key], value)]
    return differ


def _records_at_each_landing(cfg: dict, job_dir: str, port: int, out) -> None:
    """A world of one in a spawned process: digits with step checkpoints and
    ``logger=[tensorboard,csv]``; at each checkpoint's landing (its first file, on the
    writer's thread) the steps metrics.csv holds then. Puts [(global step, steps)] on ``out``."""
    import csv

    from helpers import one_rank_digits_world

    from ddp_exp.config.view import rank_config
    from ddp_exp.distributed.process_group import destroy_process_group
    from ddp_exp.io import checkpoint
    from ddp_exp.metrics.trackers import TrackerPlan, open_trackers
    from ddp_exp.metrics.writer import MetricsWriter
    from ddp_exp.train.loop import Trainer
    from ddp_exp.train.models import MLP
    from ddp_exp.train.objective import Objective

    world, datasets = one_rank_digits_world(port)
    table = os.path.join(job_dir, "metrics.csv")
    seen = []
    land = checkpoint.land

    def recording_land(paths, write_first, copy=checkpoint.copy_file):
        with open(table, newline="") as fh:
            steps = sorted({int(row["step"]) for row in csv.DictReader(fh)})
        landed = torch.load(paths[0], weights_only=True) if os.path.exists(paths[0]) else None
        land(paths, write_first, copy)
        seen.append((torch.load(paths[0], weights_only=True)["global_step"], steps,
                     landed is not None))

    checkpoint.land = recording_land
    try:
        torch.manual_seed(0)
        trackers = open_trackers(TrackerPlan(job_dir, csv="metrics.csv"), {}, True, None)
        writer = MetricsWriter(job_dir, {}, enabled=True, trackers=trackers)
        loop = Trainer(rank_config(cfg), world, datasets, MLP((1, 8, 8), 10, [32]),
                       Objective(10), torch.device("cpu"), writer)
        loop.fit()
        writer.close()
        out.put(seen)
    finally:
        checkpoint.land = land
        destroy_process_group()


@pytest.mark.slow  # starts a world of one
def test_a_checkpoint_lands_after_every_record_before_its_step(tmp_path, compose):
    """metrics.csv holds every logged step up to a checkpoint's when the checkpoint lands: a
    resume keeps the rows before its step and writes the rest again, so a row missing then is
    lost for good (a fresh user's kill -9 after a step checkpoint lost step 190's row: the CSV
    tracker kept the last step's row in memory until the epoch's flush). Log every 5 steps,
    a step checkpoint every 10, 47 steps an epoch: at each landing, steps 5, 10, ... up to the
    checkpoint's are all in the file."""
    from helpers import in_spawned_rank
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(compose(
        "world_size=1", "trainer.epochs=2", "trainer.log_every_n_steps=5",
        "trainer.checkpoint_every_n_steps=10", "trainer.progress=off",
        "trainer.perf_metrics=false", "trainer.preempt_signal=null", "trainer.monitor=null"),
        resolve=True, enum_to_str=True)
    seen = in_spawned_rank(_records_at_each_landing, cfg, str(tmp_path))
    assert [step for step, _, _ in seen][:4] == [10, 20, 30, 40], seen
    for step, steps, _ in seen:
        logged = set(range(5, step + 1, 5)) | ({47} if step >= 47 else set())
        assert logged <= set(steps), (step, sorted(logged - set(steps)))
