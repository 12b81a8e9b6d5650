"""Everyday use: logs, progress, the user-project example (issue 7)."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ANSI_OR_CR = re.compile(r"\x1b\[|\r")
TAGGED = re.compile(r"^\[[^\]]+\]\[(rank\d+|launcher)\]")


def test_output_to_a_file_is_plain_log_lines_each_tagged(default_run_2_epochs):
    """Not a terminal: no bar escape codes; every line of the job log carries its rank or the
    launcher tag; non-zero ranks log nothing at INFO (the session's world_size=2, 2-epoch run,
    its output captured)."""
    run = default_run_2_epochs
    log_text = (run.job_dir / "ddp_exp.log").read_text()
    for text in (run.stdout, log_text):
        assert not ANSI_OR_CR.search(text)
    lines = [ln for ln in log_text.splitlines() if ln.strip()]
    assert lines and all(TAGGED.match(ln) for ln in lines), lines
    assert not [ln for ln in lines if "[rank1]" in ln and "[INFO]" in ln]
    assert sum(ln.split(" - ", 1)[1].startswith("epoch ") for ln in lines) == 2


def test_progress_bar_mode_draws_a_bar_on_stderr(run_cli):
    """trainer.progress=bar draws tqdm's bar (rank 0 only); log lines stay clean."""
    run = run_cli("world_size=2", "trainer.epochs=1", "print_config=false",
                  "trainer.progress=bar").ok()
    assert "epoch 1/1" in run.stderr and "step" in run.stderr
    assert not ANSI_OR_CR.search((run.job_dir / "ddp_exp.log").read_text())


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


def test_cfg_job_prints_the_config_and_starts_nothing(run_cli):
    run = run_cli("--cfg", "job", "model=cnn", "data=digits", "world_size=2")
    assert run.returncode == 0, run.stderr
    assert "ddp_exp.train.models.CNN" in run.stdout and "world_size: 2" in run.stdout
    assert not run.job_dir.exists()


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_no_output_left_outside_the_job_folder(default_run_1_epoch):
    """A run writes only inside its job folder (no stray outputs/ or event files in cwd): the
    session's world_size=2, 1-epoch run, whose cwd was a folder of its own."""
    cwd = default_run_1_epoch.job_dir.parent
    stray = [p for p in cwd.iterdir() if p.name != "run"]
    assert stray == [], stray
    assert os.path.isdir(cwd / "run" / "tensorboard")


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


@pytest.mark.slow
def test_a_global_batch_larger_than_the_training_set_is_said(run_cli):
    """world_size=100 at the default batch gave a global batch of 3,200 for digits' 1,500
    training samples without a word (a fresh user): each step took the whole set. Now one
    warning line says so, with the step's real size per rank."""
    run = run_cli("world_size=2", "data.batch_size=1000", "trainer.epochs=1",
                  "print_config=false").ok()
    out = run.stdout + run.stderr
    assert ("the global batch of 2000 is larger than the 1500 training samples: each "
            "optimizer step takes the whole training set (750 per rank), not 2000") in out
    assert run.metrics["steps_per_epoch"] == 1
