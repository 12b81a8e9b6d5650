"""Exact resume (issue 4, "What must hold"; case C12): a run killed in an epoch, a run resumed to
more epochs and an elastic restart after a rank was killed all end with the uninterrupted run's
metrics, weights and TensorBoard curves.

Faults are injected without touching the product: ``tests/faulty.py`` holds ``FaultyMLP``, a
user model plugged in through the public entry (``--config-dir <dir> model=faulty`` with this
folder on ``PYTHONPATH``), which SIGKILLs its own rank at a given step. Expected values come
from an uninterrupted run of the plain ``model=mlp``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import (
    QUIET,
    STEPS_2,
    UNREACHABLE,
    Run,
    faulty_args,
    load_ckpt,
    output,
    root_cause,
    run_once,
    shared_run,
    tensorboard_series,
    tests_on_path,
)

# Final metrics that depend on the training alone (not on timing).
COMPARED = ("val/loss", "val/accuracy", "val/num_samples", "train/epoch_loss", "train/num_samples",
            "epoch", "global_step", "steps_per_epoch")


# ------------------------------------------------------------------------------------ helpers
def assert_same_result(run_dir: Path, ref_dir: Path, tol: float) -> None:
    """metrics.json (training values) and model.pt of ``run_dir`` equal ``ref_dir``'s."""

    got = json.loads((run_dir / "metrics.json").read_text())
    ref = json.loads((ref_dir / "metrics.json").read_text())
    for key in COMPARED:
        a, b = got[key], ref[key]
        if isinstance(b, float):
            assert a == pytest.approx(b, rel=tol, abs=tol), (key, a, b)
        else:
            assert a == b, (key, a, b)
    p_got = torch.load(run_dir / "model.pt", weights_only=True)
    p_ref = torch.load(ref_dir / "model.pt", weights_only=True)
    assert p_got.keys() == p_ref.keys() and len(p_ref) > 0
    for name in p_ref:
        torch.testing.assert_close(p_got[name], p_ref[name], rtol=0, atol=tol, msg=name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted world_size=2, 4-epoch run of the plain ``model=mlp`` (seed 0); its job
    folder (made once per test session: :func:`helpers.shared_run`). Tests only read it."""
    return shared_run(tmp_path_factory, "world_size=2", "trainer.epochs=4", "seed=0",
                      "model=mlp", QUIET).job_dir


# --------------------------------------------------------------------- 1. exact resume
@pytest.mark.slow
@pytest.mark.float_sensitive
def test_run_killed_in_epoch_3_resumes_exactly(run_cli, tmp_path, reference):
    """Must-hold 1: rank 1 SIGKILLed inside epoch 3 of 4 (no restarts), then the same job folder
    rerun with ``trainer.resume=auto``: same final metrics and parameters as a run never
    interrupted."""
    conf = tmp_path / "conf"
    kill_step = 2 * STEPS_2 + STEPS_2 // 2  # step 60: inside epoch 3 (steps 49..72)
    common = ("world_size=2", "trainer.epochs=4", "seed=0", "launcher.max_restarts=0", QUIET)
    killed = run_cli(*faulty_args(conf, fault="kill", fault_step=kill_step,
                                  after_checkpoint=str(tmp_path / "job/checkpoints/last.pt"),
                                  after_epoch=1), *common, job="job", env=tests_on_path())
    assert killed.returncode != 0, output(killed)
    assert "rank      : 1" in root_cause(output(killed))
    assert not (killed.job_dir / "metrics.json").exists()
    last = load_ckpt(killed.job_dir / "checkpoints" / "last.pt")
    assert last["epoch"] == 1  # epochs 0 and 1 (0-based) complete
    assert last["global_step"] == 2 * STEPS_2

    # Same model class (the checkpoint must fit), its fault now unreachable.
    resumed = run_cli(*faulty_args(conf, fault="kill", fault_step=UNREACHABLE), *common,
                      "trainer.resume=auto", job="job", env=tests_on_path()).ok()
    assert re.search(r"resumed from \S*checkpoints/last\.pt", resumed.stdout), resumed.stdout
    assert "epoch 3/4" in resumed.stdout and "epoch 1/4" not in resumed.stdout
    assert_same_result(resumed.job_dir, reference, tol=1e-7)


@pytest.fixture(scope="module")
def resumed_2_to_4(tmp_path_factory) -> Run:
    """world_size=2, seed 0, ``model=mlp`` for 2 epochs, then the same folder with
    ``trainer.epochs=4 trainer.resume=auto``: the resumed run (the two tests below ask it two
    questions; one world for both, on one xdist worker)."""
    root = tmp_path_factory.mktemp("resumed-2-to-4")
    common = ("world_size=2", "seed=0", "model=mlp", QUIET)
    run_once(root, *common, "trainer.epochs=2")
    return run_once(root, *common, "trainer.epochs=4", "trainer.resume=auto")


@pytest.mark.slow
@pytest.mark.float_sensitive
@pytest.mark.xdist_group("resumed_2_to_4")
def test_two_epochs_then_resume_auto_to_four_is_exact(resumed_2_to_4, reference):
    """Must-hold 1, the plain way: trainer.epochs=2, then the same folder with trainer.epochs=4
    trainer.resume=auto."""
    resumed = resumed_2_to_4
    assert re.search(r"resumed from \S*checkpoints/last\.pt", resumed.stdout), resumed.stdout
    assert_same_result(resumed.job_dir, reference, tol=1e-7)


@pytest.mark.slow
@pytest.mark.float_sensitive
@pytest.mark.xdist_group("resumed_2_to_4")
def test_resumed_run_tensorboard_curves_equal_uninterrupted(resumed_2_to_4, reference):
    """A resumed job's TensorBoard curves (all its event files, as TensorBoard reads them) show
    the same points as the uninterrupted run's: nothing lost at the resume step, no duplicate
    from the first attempt."""
    resumed = resumed_2_to_4
    for tag in ("val/loss", "val/accuracy", "train/loss"):
        got = tensorboard_series(resumed.job_dir, tag)
        ref = tensorboard_series(reference, tag)
        assert [s for s, _ in got] == [s for s, _ in ref], (tag, got, ref)
        assert [v for _, v in got] == pytest.approx([v for _, v in ref], rel=1e-6), tag


# ------------------------------------------------------------------- 2. elastic restart


@pytest.mark.slow
@pytest.mark.parametrize("kill_step", [STEPS_2 + STEPS_2 // 2, STEPS_2 // 2],
                         ids=["mid-epoch-2", "before-first-checkpoint"])
@pytest.mark.float_sensitive
def test_elastic_restart_after_rank_killed(run_cli, tmp_path, reference, kill_step):
    """Must-hold 2: ``launcher.max_restarts=1``, rank 1 SIGKILLed once mid-epoch: the world
    restarts from checkpoints/last.pt (after epoch 1: step 24), or from scratch when no epoch
    had finished, and ends exactly as an uninterrupted run."""
    once = tmp_path / "fired"
    done = kill_step // STEPS_2 * STEPS_2  # the step of the last checkpoint before the kill
    after = ({"after_checkpoint": str(tmp_path / "run/checkpoints/last.pt"),
              "after_epoch": done // STEPS_2 - 1} if done else {})
    run = run_cli(*faulty_args(tmp_path / "conf", fault="kill", fault_step=kill_step,
                               once_file=str(once), **after),
                  "world_size=2", "trainer.epochs=4", "seed=0", "launcher.max_restarts=1",
                  "distributed.timeout_s=30", QUIET,  # a hang ends in 30 s
                  env=tests_on_path()).ok()
    assert once.exists(), "the fault never fired"
    last = re.escape(str(run.job_dir / "checkpoints" / "last.pt"))
    resumed = re.findall(rf"resumed from {last}\b.*step (\d+)\b", run.stdout)
    assert resumed == ([str(done)] if done else []), run.stdout
    # U07: one line in the job log says which restart, which rank failed and from where.
    where = (f"continues from {run.job_dir / 'checkpoints' / 'last.pt'} (epoch "
             f"{done // STEPS_2} done, step {done})" if done
             else "starts again from the beginning (no epoch had finished)")
    expected = ("restart 1 of launcher.max_restarts=1: rank 1 failed (killed by SIGKILL); "
                f"the world {where}")
    log_lines = (run.job_dir / "ddp_exp.log").read_text().splitlines()
    assert [ln for ln in log_lines if "restart 1 of" in ln] == [
        ln for ln in log_lines if ln.endswith(f"[WARNING] - {expected}")], log_lines
    assert sum(ln.endswith(expected) for ln in log_lines) == 1, log_lines
    assert_same_result(run.job_dir, reference, tol=1e-6)
