"""Issue 30 item 1: step checkpoints. ``trainer.checkpoint_every_n_steps`` (and ``_minutes``)
write ``checkpoints/last.pt`` inside an epoch, with the position as global samples consumed;
a world SIGKILLed (launcher and ranks) once such a checkpoint is on disk resumes with
``trainer.resume=auto`` to the uninterrupted run's weights and metrics, and TensorBoard shows
each step once. The kill lands where ``resume_support.HoldingMLP`` holds rank 0 after the
checkpoint file exists (checkpoints are written on a background thread: the test waits for the
file, never for a time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from helpers import QUIET, kill_when_held, run_tagged, tensorboard_series
from helpers import tests_on_path as on_path
from resume_support import mid_epoch, write_holding_yaml

# Final values that must not depend on where the run was interrupted.
COMPARED = ("val/loss", "val/accuracy", "train/epoch_loss", "train/num_samples", "epoch",
            "global_step")


def run(job: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    proc, _ = run_tagged([sys.executable, "-m", "ddp_exp", *args, f"hydra.run.dir={job}"], cwd,
                         uuid.uuid4().hex, 240, on_path())
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def assert_same_run(job: Path, reference: Path, tol: float = 1e-6) -> None:
    """metrics.json's training values, model.pt and the TensorBoard curves of the resumed job
    equal the uninterrupted run's; no step appears twice."""
    got = json.loads((job / "metrics.json").read_text())
    want = json.loads((reference / "metrics.json").read_text())
    for key in COMPARED:
        assert got[key] == pytest.approx(want[key], rel=tol, abs=tol), (key, got[key], want[key])
    weights = [torch.load(d / "model.pt", weights_only=True) for d in (job, reference)]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[1]:
        torch.testing.assert_close(weights[0][name], weights[1][name], rtol=0, atol=tol,
                                   msg=name)
    for tag in ("train/loss", "val/loss", "train/epoch_loss"):
        series, ref = tensorboard_series(job, tag), tensorboard_series(reference, tag)
        steps = [s for s, _ in series]
        assert len(steps) == len(set(steps)), (tag, steps)  # no duplicated step
        assert steps == [s for s, _ in ref], (tag, steps)
        assert [v for _, v in series] == pytest.approx([v for _, v in ref], rel=1e-5), tag


def kill_mid_epoch_2_and_resume(tmp_path: Path, common: list[str], every: int, hold_call: int
                                ) -> tuple[Path, dict]:
    """The run of ``common`` with ``trainer.checkpoint_every_n_steps=every`` killed once a
    checkpoint inside epoch 2 is on disk (rank 0 held at its ``hold_call``-th step), then
    resumed with ``trainer.resume=auto``; returns the job folder and the checkpoint it resumed
    from."""
    job, marker = tmp_path / "run", tmp_path / "held"
    last = job / "checkpoints" / "last.pt"
    held = write_holding_yaml(tmp_path / "conf", hold_call, str(last), 0, str(marker))
    kill_when_held(job, tmp_path, [*held, *common, f"trainer.checkpoint_every_n_steps={every}"],
                   marker)
    state = mid_epoch(last)
    assert state is not None and state["epoch"] == 0, "no step checkpoint inside epoch 2"
    assert not (job / "metrics.json").exists()
    write_holding_yaml(tmp_path / "conf")  # no hold: a plain MLP
    proc = run(job, tmp_path, *held, *common, f"trainer.checkpoint_every_n_steps={every}",
               "trainer.resume=auto")
    assert "resumed from" in proc.stdout + proc.stderr
    return job, state


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_digits_killed_inside_epoch_2_resumes_exactly(default_run_2_epochs, tmp_path):
    """digits, world_size=2, a step checkpoint every 5 steps (24 steps per epoch): SIGKILL of
    the whole world at step 33, after a checkpoint of epoch 2 (step 25 or 30) is on disk;
    resume=auto ends with the uninterrupted run's weights and metrics (1e-6), and TensorBoard
    shows every step once."""
    common = ["world_size=2", "trainer.epochs=2", QUIET]
    job, state = kill_mid_epoch_2_and_resume(tmp_path, common, every=5, hold_call=33)
    assert state["global_step"] in (25, 30)
    assert state["position"] == (state["global_step"] - 24) * 64  # global samples consumed
    assert_same_run(job, default_run_2_epochs.job_dir)


@pytest.fixture(scope="module")
def digits_png(tmp_path_factory) -> Path:
    from lazy_data import write_digits_folder

    return write_digits_folder(tmp_path_factory.mktemp("digits") / "png", limit=400)


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_image_folder_with_workers_and_augmentation_killed_inside_an_epoch_resumes_exactly(
        digits_png, tmp_path):
    """The same with data=image_folder, two DataLoader workers per rank and data.augment=true
    (each sample's draws keyed by seed, epoch and the sample: a resumed epoch draws what the
    uninterrupted one drew): 320 training images, 5 steps per epoch, a checkpoint every 2."""
    common = ["world_size=2", "trainer.epochs=2", QUIET, "data=image_folder",
              f"data.path={digits_png}", "data.channels=1", "data.val_size=80",
              "data.num_workers=2", "data.augment=true"]
    reference = tmp_path / "reference"
    ref_conf = write_holding_yaml(tmp_path / "ref_conf")
    run(reference, tmp_path, *ref_conf, *common)
    job, state = kill_mid_epoch_2_and_resume(tmp_path, common, every=2, hold_call=9)
    assert state["global_step"] in (6, 8)
    assert_same_run(job, reference)


def test_step_checkpoint_keys_are_checked_before_any_rank(compose, tmp_path):
    """A cadence of 0 or less is one line naming the key and what is valid."""
    from helpers import refused_before_ranks

    for override, key in (("trainer.checkpoint_every_n_steps=0",
    "trainer.checkpoint_every_n_steps"),
                          ("trainer.checkpoint_every_n_minutes=-1",
                           "trainer.checkpoint_every_n_minutes")):
        message = refused_before_ranks(compose(override), tmp_path / key)
        assert message.startswith(key) and "null" in message, message


def test_a_sampler_starts_at_the_position_without_replaying_the_epoch():
    """The rank's shard from a position is the slice of the epoch's shard (O(1) in the
    position): for DistributedSampler (padded and not) and the token windows' lazy shard."""
    from torch.utils.data import DistributedSampler

    from ddp_exp.data.sampling import shard_order
    from ddp_exp.data.tokens import window_sampler

    for n, world in ((100, 4), (101, 4), (7, 3)):
        for rank in range(world):
            sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, seed=3)
            sampler.set_epoch(2)
            whole = list(sampler)
            for start in (0, 1, len(whole) - 1, len(whole)):
                assert shard_order(sampler, start).tolist() == whole[start:]
    tokens = window_sampler(50, 2, 1, True, 0)
    tokens.set_epoch(1)
    assert shard_order(tokens, 5)[0:len(shard_order(tokens, 5))].tolist() == list(tokens)[5:]


# ------------------------------------------- the cadence and preemption, one rank in-process
def _one_rank(cfg: dict, job_dir: str, port: int, out) -> None:
    """A world of one in a spawned process: (1) an uninterrupted fit; (2) the same run told of
    a preemption at its 7th step, which must stop with a step checkpoint at the check that
    carries the flag; (3) a fresh loop resumed from it, fitted to the end; (4) a run whose
    minutes cadence is always due. Puts the results on ``out``."""
    from helpers import one_rank_digits_world

    from ddp_exp.config.view import rank_config
    from ddp_exp.distributed.process_group import destroy_process_group
    from ddp_exp.metrics.writer import MetricsWriter
    from ddp_exp.train import state as train_state
    from ddp_exp.train import step_checkpoint
    from ddp_exp.train.loop import Trainer
    from ddp_exp.train.models import MLP
    from ddp_exp.train.objective import Objective
    from ddp_exp.train.step_checkpoint import Preempted

    world, datasets = one_rank_digits_world(port)

    def trainer(run: str, conf: dict, preempt=None) -> Trainer:
        torch.manual_seed(0)
        model = MLP((1, 8, 8), 10, [128])
        return Trainer(rank_config(conf), world, datasets, model, Objective(10),
                       torch.device("cpu"),
                       MetricsWriter(os.path.join(job_dir, run), {}, enabled=False), preempt)

    def weights(t: Trainer) -> dict:  # NumPy: pickled by value (a tensor would pass an fd)
        return {k: v.numpy().copy() for k, v in t.model.state_dict().items()}

    try:
        results = {}
        reference = trainer("reference", cfg)
        reference.fit()
        results["reference"] = weights(reference)
        told = trainer("run", cfg)
        told.cadence.preempt_requested = lambda: told.global_step >= 7
        try:
            told.fit()
            results["preempted"] = None
        except Preempted as exc:
            results["preempted"] = (str(exc), told.global_step)
        state = torch.load(os.path.join(job_dir, "run", "checkpoints", "last.pt"),
                           weights_only=True)
        results["checkpoint"] = (state["global_step"], state["position"], state["epoch"])
        resumed = trainer("run", cfg)
        train_state.load_state_dict(resumed, state, "last.pt")
        resumed.fit()
        results["resumed"] = weights(resumed)
        minutes = {**cfg, "trainer": {**cfg["trainer"], "epochs": 1,
                                      "checkpoint_every_n_minutes": 1e-9}}
        clock = trainer("clock", minutes)
        steps = []
        land = step_checkpoint._land  # where every step checkpoint lands
        step_checkpoint._land = lambda loop, taken: (steps.append(loop.global_step),
                                                     land(loop, taken))
        clock.fit()
        results["clock_steps"] = steps
        out.put(results)
    finally:
        destroy_process_group()


@pytest.mark.slow  # starts worlds of processes: make test, not test-fast
@pytest.mark.float_sensitive
def test_a_preemption_and_the_minutes_cadence_ride_on_the_logging_check(tmp_path, compose):
    """One rank, digits at batch 32 (47 steps an epoch), a check every 5 steps: told of a
    preemption from step 7 on, the loop learns it at the check of step 15 (the flag rides in
    the all-reduce started at step 10, finished at 15), writes a step checkpoint there
    (position 15 x 32 samples) and raises Preempted; a loop resumed from it ends with the
    uninterrupted run's weights. A minutes cadence that is always due checkpoints at step 10
    (the check started at 5 carries the first flag), then every other check: the check started
    at a checkpoint's step is finished by it, so its flag (raised before that checkpoint) is no
    decision; never at the epoch's last step (the epoch's own checkpoint is that)."""
    from helpers import in_spawned_rank
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(compose("world_size=1", "trainer.epochs=2",
                                         "trainer.log_every_n_steps=5", "trainer.progress=off",
                                         "trainer.perf_metrics=false"), resolve=True,
                               enum_to_str=True)
    results = in_spawned_rank(_one_rank, cfg, str(tmp_path))
    assert results["preempted"] is not None and results["preempted"][1] == 15, results
    assert results["checkpoint"] == (15, 15 * 32, -1)
    for name, value in results["reference"].items():
        torch.testing.assert_close(torch.from_numpy(results["resumed"][name]),
                                   torch.from_numpy(value), rtol=0, atol=1e-6, msg=name)
    assert results["clock_steps"] == [10, 20, 30, 40], results["clock_steps"]


def test_a_restart_from_a_step_checkpoint_says_where_inside_the_epoch(monkeypatch):
    """The elastic restart's line names a step checkpoint's place as the resume line does
    (inside epoch E, P samples in), not as an epoch that is done."""
    from ddp_exp.rank.failures import FAILURES_ENV, restart_line

    monkeypatch.delenv(FAILURES_ENV, raising=False)
    inside = restart_line(1, 3, "ck/last.pt", {"epoch": 0, "global_step": 30, "position": 640})
    assert inside.endswith("continues from ck/last.pt (epoch 2, 640 samples in, step 30)")
    done = restart_line(1, 3, "ck/last.pt", {"epoch": 0, "global_step": 24, "position": 0})
    assert done.endswith("continues from ck/last.pt (epoch 1 done, step 24)")
