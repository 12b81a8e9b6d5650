"""Issue 30 items 2 and 3: ``data.global_batch_size`` (the per-rank batch and the accumulation
follow from the world), and a run saved mid-epoch at one world size resumed at another with the
same global batch: the same global order of samples, the same weights and validation values as
the run never interrupted (1e-5: sums over another number of ranks round differently)."""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from helpers import HANG_S, QUIET, folder_files, load_ckpt, refused_before_ranks, run_tagged
from helpers import tests_on_path as on_path
from resume_support import HoldingMLP, global_order, mid_epoch, served

from ddp_exp.launch import build
from ddp_exp.train import state as train_state

NUM_TRAIN = 256  # divisible by 1, 2 and 4 ranks: no padding duplicate in any world
GLOBAL_BATCH = 32


# ------------------------------------------------------------- item 2: the global batch
@pytest.mark.parametrize(("world", "cap", "per_rank", "accumulate"), [
    (1, None, 32, 1), (2, None, 16, 1), (4, None, 8, 1), (1, 8, 8, 4), (2, 10, 8, 2),
    (4, 8, 8, 1), (2, 5, 4, 4)])
def test_global_batch_gives_the_per_rank_batch_and_accumulation(world, cap, per_rank,
                                                                accumulate):
    """The per-rank batch is the largest divisor of ``global / world`` within the cap; the
    rest is accumulated; their product times the world is the global batch."""
    from ddp_exp.config.checks import batch_layout

    assert batch_layout(GLOBAL_BATCH, world, cap) == (per_rank, accumulate)
    assert per_rank * accumulate * world == GLOBAL_BATCH


def test_a_global_batch_the_world_does_not_divide_is_one_line(compose, tmp_path):
    for overrides, words in (
            (["world_size=3", "data.global_batch_size=32"], "data.global_batch_size=32"),
            (["world_size=2", "data.global_batch_size=32", "data.max_batch_size_per_rank=0"],
             "data.max_batch_size_per_rank=0"),
            (["world_size=2", "data.global_batch_size=0"], "data.global_batch_size=0")):
        message = refused_before_ranks(compose(*overrides), tmp_path / str(len(words)))
        assert message.startswith(words), message


def test_the_resolved_config_holds_the_derived_batch(compose):
    """What the ranks get: data.batch_size and trainer.accumulate_grad_batches derived from
    data.global_batch_size and the world."""
    from omegaconf import OmegaConf

    from ddp_exp.config.checks import apply_global_batch, global_batch_size

    plain = OmegaConf.to_container(compose("world_size=2", "data.global_batch_size=48",
                                           "data.max_batch_size_per_rank=8"), resolve=True)
    apply_global_batch(plain, 2)
    assert (plain["data"]["batch_size"], plain["trainer"]["accumulate_grad_batches"]) == (8, 3)
    assert global_batch_size(plain) == 48


# ------------------------------------------------------------ item 3: another world size
def keyed_rows(positions, seed=0, epoch=1):
    """The augmented images of ``positions`` of an 8x8 batch, each keyed by the sample."""
    from ddp_exp.data.image_batch import ImageBatch
    from ddp_exp.data.loaders import sample_keys

    images = torch.arange(64 * 40, dtype=torch.uint8).reshape(40, 1, 8, 8)
    batch = ImageBatch(augment=True)
    return batch(images[list(positions)], keys=sample_keys(seed, epoch, positions))


def test_augmentation_draws_are_keyed_by_the_sample_not_the_batch():
    """A sample's augmentation is the same whichever batch (rank, micro-batch) serves it; it
    changes with the epoch and the seed."""
    whole = keyed_rows(range(8))
    halves = torch.cat([keyed_rows(range(0, 8, 2)), keyed_rows(range(1, 8, 2))])
    torch.testing.assert_close(halves, whole[[0, 2, 4, 6, 1, 3, 5, 7]], rtol=0, atol=1e-6)
    assert not torch.allclose(keyed_rows(range(8), epoch=2), whole)
    assert not torch.allclose(keyed_rows(range(8), seed=1), whole)


def recording_args(record: Path, world: int) -> list[str]:
    return [f"world_size={world}", "trainer.epochs=2", QUIET, "data=dataset",
            "data._target_=resume_support.recording_pair", f"+data.record_dir={record}",
            f"data.global_batch_size={GLOBAL_BATCH}"]


def run(job: Path, cwd: Path, *args: str) -> None:
    proc, _ = run_tagged([sys.executable, "-m", "ddp_exp", *args, f"hydra.run.dir={job}"], cwd,
                         uuid.uuid4().hex, 240, on_path())
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


class SavingMLP(HoldingMLP):
    """:class:`resume_support.HoldingMLP` that, where that one holds rank 0 for the test to
    kill the world, copies the step checkpoint of the middle of an epoch it waited for to
    ``marker`` (the world saved mid-epoch) and trains on: the run is also the uninterrupted
    one. A test's class, reached by the ranks as ``test_resume_world_size.SavingMLP``."""

    def _hold(self) -> None:
        deadline = time.monotonic() + HANG_S
        state = None
        while state is None or state["epoch"] != self.epoch:
            assert time.monotonic() < deadline, f"no step checkpoint at {self.checkpoint}"
            time.sleep(0.01)
            state = mid_epoch(self.checkpoint)
        torch.save(state, self.marker)


def saving_args(config_dir: Path, hold_call: int = 0, checkpoint: str | None = None,
                saved: str | None = None) -> list[str]:
    """Write ``<config_dir>/model/saving.yaml`` (``model=mlp``'s sizes, :class:`SavingMLP`
    copying the step checkpoint inside epoch 2 to ``saved`` at rank 0's ``hold_call``-th step;
    0: a plain MLP) and return the overrides selecting it."""
    node = {"_target_": "test_resume_world_size.SavingMLP", "hidden_sizes": [128],
            "dropout": 0.0, "hold_call": hold_call, "checkpoint": checkpoint, "epoch": 0,
            "marker": saved}
    (config_dir / "model").mkdir(parents=True, exist_ok=True)
    (config_dir / "model" / "saving.yaml").write_text(yaml.safe_dump(node, sort_keys=False))
    return ["--config-dir", str(config_dir), "model=saving"]


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_saved_at_two_ranks_mid_epoch_resumes_at_one_and_four(tmp_path, compose):
    """A lazy dataset that records the samples it serves, data.global_batch_size=32, 8 steps
    per epoch, a step checkpoint every 3: the world_size=2 run, uninterrupted, has its step
    checkpoint inside epoch 2 copied aside as rank 0 reaches step 14 (the kill of a world is
    test_step_checkpoints.py's: here, what another world makes of the checkpoint); resumed
    from it at world_size=1 and at world_size=4, the global order of the samples served
    equals the uninterrupted run's exactly, the final weights and val/* to 1e-5."""
    reference, saved = tmp_path / "reference", tmp_path / "mid_epoch_2.pt"
    model = saving_args(tmp_path / "conf", 14, str(reference / "checkpoints" / "last.pt"),
                        str(saved))
    run(reference, tmp_path, *model, *recording_args(tmp_path / "rec_ref", 2),
        "trainer.checkpoint_every_n_steps=3")
    want = global_order(served(tmp_path / "rec_ref", 2))
    assert len(want) == 2 * NUM_TRAIN and sorted(want[:NUM_TRAIN]) == list(range(NUM_TRAIN))
    state = torch.load(saved, weights_only=True)
    assert state["epoch"] == 0 and state["global_step"] in (9, 12), state["global_step"]
    position = state["position"]
    assert position == (state["global_step"] - 8) * GLOBAL_BATCH

    # Another global batch cannot continue inside the epoch: one line, before any rank.
    message = refused_before_ranks(compose(
        "world_size=1", "data=dataset", "data._target_=resume_support.recording_pair",
        f"+data.record_dir={tmp_path / 'rec_x'}", "data.global_batch_size=64",
        f"trainer.resume={saved}", "trainer.epochs=2"), tmp_path / "refused")
    assert "data.global_batch_size" in message and "32" in message, message

    plain = saving_args(tmp_path / "conf")
    for world in (1, 4):
        record, folder = tmp_path / f"rec_{world}_resumed", tmp_path / f"ws{world}"
        copy = folder / "checkpoints" / saved.name  # the checkpoint taken to the new job
        copy.parent.mkdir(parents=True)
        shutil.copy(saved, copy)
        run(folder, tmp_path, *plain, *recording_args(record, world), f"trainer.resume={copy}")
        assert want[:NUM_TRAIN + position] + global_order(served(record, world)) == want, world
        got = json.loads((folder / "metrics.json").read_text())
        ref = json.loads((reference / "metrics.json").read_text())
        for key in ("val/loss", "val/accuracy", "train/epoch_loss"):
            assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), (world, key)
        assert got["global_step"] == ref["global_step"] == 16
        weights = [torch.load(d / "model.pt", weights_only=True) for d in (folder, reference)]
        for name in weights[1]:
            torch.testing.assert_close(weights[0][name], weights[1][name], rtol=0, atol=1e-5,
                                       msg=f"world {world}: {name}")


# ----------------------------------------------- 4. advice that works in another world size
def test_exact_batch_advice_names_only_what_is_accepted():
    assert train_state.exact_batch_advice(8, 4) == "data.global_batch_size=8"
    advice = train_state.exact_batch_advice(8, 3)
    assert "data.global_batch_size=8" in advice and "world_size=1, 2, 4 or 8" in advice
    assert "3 ranks cannot divide" in advice
    assert "world_size=1, 2, 4, 8, 16, 32 or 64" in train_state.exact_batch_advice(64, 3)


def test_the_epoch_end_warning_keeps_only_a_global_batch_the_world_divides(compose, caplog):
    state = {"world_size": 2, "global_batch_size": 64}
    with caplog.at_level(logging.INFO, logger="ddp_exp"):
        build._log_world_change(compose("world_size=3", "data.batch_size=32"), state, 3)
        text = caplog.text
        assert "keep data.global_batch_size=64" not in text, text  # 3 ranks cannot take 64
        assert "world_size=1, 2, 4, 8, 16, 32 or 64 with data.global_batch_size=64" in text
        caplog.clear()
        build._log_world_change(compose("world_size=4", "data.batch_size=8"), state, 4)
        assert "keep data.global_batch_size=64 for an exact continuation" in caplog.text



def test_a_global_batch_changed_at_the_same_world_size_is_warned_of(compose, caplog):
    """``data.batch_size`` changed on resume, same world size: the global batch changes (64
    to 32) and the run no longer continues the interrupted one; it was accepted without a
    word (a fresh user's find). The same batch says nothing."""
    state = {"world_size": 2, "global_batch_size": 64}
    with caplog.at_level(logging.INFO, logger="ddp_exp"):
        build._log_world_change(compose("world_size=2", "data.batch_size=16"), state, 2)
        assert ("resuming at a global batch of 32, the interrupted run's was 64: the data order "
                "and the schedule differ from it (keep data.global_batch_size=64 for an exact "
                "continuation)") in caplog.text, caplog.text
        caplog.clear()
        build._log_world_change(compose("world_size=2", "data.batch_size=32"), state, 2)
        assert caplog.text == ""

@pytest.mark.slow
def test_a_step_checkpoint_in_another_world_is_refused_with_advice_that_works(run_cli, tmp_path):
    """Saved at world_size=2 with data.global_batch_size=8 inside epoch 1; resumed at
    world_size=3 (global batch 12): one line, exit 2, no "resuming ..." line before it, no
    data.global_batch_size=8 offered to 3 ranks, no epoch file named where none exists."""
    common = ("trainer.epochs=1", "trainer.checkpoint_every_n_steps=5", "trainer.max_steps=12",
              QUIET)
    first = run_cli("world_size=2", "data.global_batch_size=8", *common).ok()
    last = load_ckpt(first.job_dir / "checkpoints" / "last.pt")
    assert last["position"] > 0 and last["global_batch_size"] == 8  # inside epoch 1
    before = folder_files(first.job_dir)
    resume = ("trainer.resume=auto", "trainer.max_steps=20", "trainer.epochs=1",
              "trainer.checkpoint_every_n_steps=5", QUIET)
    refused = run_cli("world_size=3", "data.batch_size=4", *resume)
    assert refused.returncode == 2, refused.stderr
    assert "resuming a world" not in refused.stdout + refused.stderr  # none before a refusal
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    line = lines[0]
    assert "resume with data.global_batch_size=8" not in line, line
    assert "world_size=1, 2, 4 or 8 with data.global_batch_size=8" in line, line
    assert "epoch_" not in line, line  # no epoch file exists in that folder
    # (the job log aside: the refused world's oversubscription line is appended to it)
    assert _without_log(folder_files(first.job_dir)) == _without_log(before)
    checkpoints = first.job_dir / "checkpoints"
    shutil.copy(checkpoints / "last.pt", checkpoints / "epoch_0000.pt")
    named = run_cli("world_size=3", "data.batch_size=4", *resume)
    assert named.returncode == 2, named.stderr
    assert f"({checkpoints / 'epoch_0000.pt'})" in named.stderr, named.stderr
    (checkpoints / "epoch_0000.pt").unlink()
    # The world sizes it names are accepted: 4 ranks continue it exactly.
    fits = run_cli("world_size=4", "data.global_batch_size=8", *resume[:-1], QUIET)
    assert fits.returncode == 0, fits.stderr
    assert load_ckpt(checkpoints / "last.pt")["global_step"] == 20


def _without_log(files: dict) -> dict:
    return {path: data for path, data in files.items() if path.name != "ddp_exp.log"}
