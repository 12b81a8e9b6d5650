"""Resuming a run that ``trainer.max_steps`` ended inside an epoch (issue 30 follow-ups): its
``last.pt`` is at that step, so resuming it finds nothing left to train (was: the last step
checkpoint or epoch, whose later steps trained again and wrote their TensorBoard points twice),
and a larger ``max_steps`` continues it exactly."""

from __future__ import annotations

import pytest
import torch
from helpers import QUIET, folder_files, load_ckpt


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
