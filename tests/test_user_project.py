"""A user's own project (issue 7): examples/user_project trains its own model, data, loss and
metric through the public entry, exactly across world sizes; plain functions and classes work as
loss and metric, and a loss that averages over the batch is refused before the ranks start."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.smoke
def test_user_project_trains_its_own_model_data_loss_and_metric(run_cli, tmp_path):
    """examples/user_project through the public entry, from its own folder."""
    project = tmp_path / "user_project"
    shutil.copytree(ROOT / "examples" / "user_project", project)
    run = run_cli("--config-dir", str(project / "conf"), "experiment=wine", "trainer.epochs=3",
                  "print_config=false", env={"PYTHONPATH": str(project)}).ok()
    m = run.metrics
    assert m["val/num_samples"] == 38 and m["world_size"] == 2
    assert m["val/accuracy"] >= 0.8
    # The custom metric is a per-sample mean: a count over 38, at most the accuracy.
    assert 0.0 <= m["val/confident"] <= m["val/accuracy"]
    assert abs(m["val/confident"] * 38 - round(m["val/confident"] * 38)) < 1e-9
    # The custom loss is the smoothed cross-entropy, so it stays above the plain one's floor:
    # with smoothing 0.1 over 3 classes the loss of any prediction is > 0.
    assert m["val/loss"] > 0.05


@pytest.mark.float_sensitive
def test_user_loss_and_metric_are_exact_across_world_sizes(run_cli, tmp_path):
    """Frozen weights: the custom loss and metric at world_size=3 equal world_size=1."""
    project = tmp_path / "user_project"
    shutil.copytree(ROOT / "examples" / "user_project", project)
    common = ("--config-dir", str(project / "conf"), "experiment=wine", "optim.lr=0.0",
              "trainer.epochs=1", "print_config=false")
    env = {"PYTHONPATH": str(project)}
    one = run_cli(*common, "world_size=1", job="ws1", env=env).ok().metrics
    three = run_cli(*common, "world_size=3", job="ws3", env=env).ok().metrics
    assert one["val/confident"] == three["val/confident"]
    assert one["val/accuracy"] == three["val/accuracy"]
    assert three["val/loss"] == pytest.approx(one["val/loss"], rel=1e-6)


@pytest.mark.float_sensitive
def test_plain_functions_and_classes_work_as_loss_and_metric(run_cli, default_run_1_epoch):
    """Regression: a bare function as a metric or loss (no options, no _partial_) was called
    with no arguments at build time and failed; a function is now bound, a class built (each
    compared with the session's default 1-epoch run)."""
    common = ("trainer.epochs=1", "print_config=false")
    default = default_run_1_epoch.metrics
    bare = run_cli(*common, "+loss._target_=ddp_exp.train.objective.cross_entropy",
                   "+metrics.acc2._target_=ddp_exp.train.objective.accuracy",
                   job="bare").ok().metrics
    assert bare["val/acc2"] == bare["val/accuracy"] == default["val/accuracy"]
    assert bare["val/loss"] == pytest.approx(default["val/loss"], rel=1e-6)
    cls = run_cli(*common, "+loss._target_=torch.nn.CrossEntropyLoss", "+loss.reduction=none",
                  job="class").ok().metrics
    assert cls["val/loss"] == pytest.approx(default["val/loss"], rel=1e-6)


@pytest.mark.float_sensitive
def test_a_batch_mean_loss_is_refused_before_the_ranks_start(run_cli, default_run_1_epoch):
    """Regression: a torch loss with its default reduction='mean' returns one number per batch;
    taken as per-sample values it made val/loss wrong (0.0099 instead of 1.4732). It must fail
    at once with one line saying what to do."""
    run = run_cli("+loss._target_=torch.nn.functional.cross_entropy", "+loss._partial_=true")
    assert run.returncode == 2
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "one value per sample" in lines[0]
    assert "reduction='none'" in lines[0]
    assert not (run.job_dir / "tensorboard").exists()
    fixed = run_cli("+loss._target_=torch.nn.functional.cross_entropy", "+loss._partial_=true",
                    "+loss.reduction=none", "trainer.epochs=1", "print_config=false",
                    job="fixed").ok()
    default = default_run_1_epoch  # trainer.epochs=1 print_config=false
    assert fixed.metrics["val/loss"] == pytest.approx(default.metrics["val/loss"], rel=1e-6)
