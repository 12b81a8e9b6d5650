"""Resume findings of a fresh user (issue 30 follow-ups, session 34):

3. a run that ``trainer.max_steps`` ended inside an epoch leaves ``last.pt`` at that step, so
   resuming it finds nothing left to train (was: the last step checkpoint or epoch, whose
   later steps trained again and wrote their TensorBoard points twice);
4. a refused resume, or a warned one, in a world of another size gives advice that is accepted
   (a global batch the new world divides, else the world sizes that divide it; an epoch file
   only where one exists), and no "resuming ..." line comes before a refusal;
6. ``data=tokens``: the epoch line's rate is tokens/s, ``train/num_samples`` counts windows.
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from helpers import QUIET, folder_files, load_ckpt

from ddp_exp.launch import build
from ddp_exp.metrics.progress import EpochResult, epoch_line
from ddp_exp.train import state as train_state

DIGITS_TRAIN = 1500  # digits' training samples (1797 minus 297 validation)


# ---------------------------------------------------------- 3. max_steps inside an epoch
@pytest.mark.slow
@pytest.mark.parametrize("overrides, steps, per_epoch", [
    # the brief's run: step checkpoints every 5 steps, max_steps at step 12 of epoch 1
    (("trainer.epochs=1", "trainer.checkpoint_every_n_steps=5", "trainer.max_steps=12"), 12, 24),
    # no step checkpoints: last.pt was epoch 1's end (step 24), max_steps at step 30
    (("trainer.epochs=2", "trainer.max_steps=30"), 30, 24),
])
def test_a_run_ended_by_max_steps_inside_an_epoch_has_nothing_left(run_cli, overrides, steps,
                                                                    per_epoch):
    first = run_cli("world_size=2", *overrides, QUIET).ok()
    last = load_ckpt(first.job_dir / "checkpoints" / "last.pt")
    # last.pt is where the run stopped: a step checkpoint inside the epoch at max_steps
    assert last["global_step"] == steps
    assert last["epoch"] == steps // per_epoch - 1  # the last completed epoch, 0-based
    assert last["position"] == (steps % per_epoch) * 64  # global batch 64 (32 x 2 ranks)
    before = folder_files(first.job_dir)
    again = run_cli("world_size=2", *overrides, QUIET, "trainer.resume=auto")
    assert again.returncode == 0, again.stderr
    assert "nothing left to train" in again.stderr, again.stderr
    assert "resumed from" not in again.stderr + again.stdout
    assert folder_files(first.job_dir) == before  # no step retrained, no event file added


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_a_larger_max_steps_continues_the_stopped_run_exactly(run_cli):
    """The step checkpoint at max_steps=12 continued to max_steps=20 trains the weights of a
    run that went to step 20 at once (same CPU, same order: 1e-6)."""
    common = ("world_size=2", "trainer.epochs=1", QUIET)
    straight = run_cli(*common, "trainer.max_steps=20", job="straight").ok()
    run_cli(*common, "trainer.max_steps=12", job="stopped").ok()
    resumed = run_cli(*common, "trainer.max_steps=20", "trainer.resume=auto", job="stopped").ok()
    assert "step 12, inside epoch 1" in resumed.stdout + resumed.stderr
    want = torch.load(straight.job_dir / "model.pt", weights_only=True)
    got = torch.load(resumed.job_dir / "model.pt", weights_only=True)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-6, atol=1e-7, msg=name)
    assert resumed.metrics["val/loss"] == pytest.approx(straight.metrics["val/loss"], rel=1e-6)
    assert resumed.metrics["global_step"] == 20


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


# ----------------------------------------------------------------- 6. data=tokens' units
def test_the_epoch_line_names_the_unit_it_counts():
    val = {"val/loss": 1.0, "val/accuracy": None, "val/num_samples": 10}
    tokens = EpochResult(0, 10, 2.0, 2560, 1.0, val, unit="tokens")
    assert epoch_line(tokens, 1).endswith("| 2,560 tokens/s")
    samples = EpochResult(0, 10, 2.0, 640, 1.0, val)
    assert epoch_line(samples, 1).endswith("| 640 samples/s")


@pytest.mark.slow
def test_token_runs_count_samples_as_samples(run_cli):
    """data=tokens: the epoch line says tokens/s, metrics.json's train/num_samples and
    train/samples_per_sec count the windows trained (20 steps x 32 of the 3277),
    train/num_tokens and train/tokens_per_sec their tokens (16 per window)."""
    run = run_cli("data=tokens", "model=gpt", "model.n_layer=1", "model.n_head=2",
                  "model.n_embd=16", "data.block_size=16", "world_size=2", "trainer.epochs=1",
                  "trainer.max_steps=20", "trainer.limit_val_batches=1", QUIET).ok()
    metrics = run.metrics
    assert metrics["train/num_samples"] == 20 * 32
    assert metrics["train/num_tokens"] == 20 * 32 * 16
    assert abs(metrics["train/tokens_per_sec"] - 16 * metrics["train/samples_per_sec"]) <= (
        1e-9 * metrics["train/tokens_per_sec"])
    output = run.stdout + run.stderr
    epoch = [line for line in output.splitlines() if "| step 20 |" in line]
    assert epoch and epoch[0].rstrip().endswith("tokens/s"), output
    assert "samples/s" not in epoch[0]
