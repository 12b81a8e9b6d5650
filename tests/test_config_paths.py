"""Paths in the config (issue 26 item 5): every path key is made absolute against the folder the
command ran in (what is not a local path is left as typed), so relative data and resume paths
work under ``hydra.job.chdir=true``, in a run and in a sweep (which also prints its config
once, keeps the lock file out of sight and records each job's ``wall_s``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ddp_exp.launch import user_input

ROWS = 120


def _write_csv(folder: Path) -> Path:
    """``mydata.csv``: 120 rows of 3 features and a 0/1 label."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 3))
    path = folder / "mydata.csv"
    np.savetxt(path, np.c_[x, (x.sum(1) > 0).astype(int)], delimiter=",", fmt="%.5f")
    return path


# ------------------------------------------------------------------ item 5: relative paths
def test_every_path_key_is_made_absolute_against_the_command_folder(compose, tmp_path):
    """data.path of a packaged option, trainer.resume=<file>, and a user target's path-named
    keys (nested ones too) mean the folder the command ran in, not the job's cwd."""
    (tmp_path / "images").mkdir()
    (tmp_path / "vocab.txt").write_text("a\n")
    cases = [
        (["data=file", "data.path=mydata.csv"], "data.path", "mydata.csv"),
        (["data=image_folder", "data.path=images"], "data.path", "images"),
        (["data=image_folder", "data.path=sub/../images"], "data.path", "images"),
        (["trainer.resume=run/checkpoints/last.pt"], "trainer.resume",
         "run/checkpoints/last.pt"),
        (["data=dataset", "data._target_=m.f", "+data.root=./downloads"], "data.root",
         "downloads"),
        (["data=dataset", "data._target_=m.f", "+data.vocab_file=vocab.txt"], "data.vocab_file",
         "vocab.txt"),
        (["model._target_=m.Net", "+model.init_path=vocab.txt"], "model.init_path", "vocab.txt"),
        (["data=image_folder", "data.path=/abs/images", "+data.transform._target_=m.T",
          "+data.transform.mask_dir=./masks"], "data.transform.mask_dir", "masks"),
    ]
    from omegaconf import OmegaConf

    for overrides, key, expected in cases:
        cfg = compose(*overrides)
        user_input.absolute_paths(cfg, str(tmp_path))
        assert OmegaConf.select(cfg, key) == str(tmp_path / expected), (overrides, key)


def test_names_that_are_not_local_paths_are_left_as_typed(compose, tmp_path):
    """A user target's key of a path-like name that names nothing here (a Hugging Face dataset
    id), an absolute path, a URL, trainer.resume=auto and null stay as typed."""
    cfg = compose("data=dataset", "data._target_=m.f", "+data.path=ylecun/mnist",
                  "+data.cache_dir=/abs/cache", "+data.data_files=https://x.org/a.csv",
                  "trainer.resume=auto")
    user_input.absolute_paths(cfg, str(tmp_path))
    assert cfg.data.path == "ylecun/mnist"
    assert cfg.data.cache_dir == "/abs/cache"
    assert cfg.data.data_files == "https://x.org/a.csv"
    assert cfg.trainer.resume == "auto"
    assert compose().trainer.resume is None


@pytest.mark.parametrize("chdir", ["true", "false"])
def test_relative_data_and_resume_paths_under_chdir(run_cli, tmp_path, chdir):
    """Regression (R07): ``data=file data.path=mydata.csv hydra.job.chdir=true`` looked for the
    file in the job folder ("no such file (looked at <job folder>/mydata.csv)"); a relative
    trainer.resume=<file> did the same. Both mean the folder the command ran in."""
    _write_csv(tmp_path)
    common = ["data=file", "data.path=mydata.csv", "world_size=1", "print_config=false",
              f"hydra.job.chdir={chdir}"]
    first = run_cli(*common, "trainer.epochs=1", job="first").ok()
    assert first.metrics["train/num_samples"] == ROWS
    second = run_cli(*common, "trainer.epochs=2", "trainer.resume=first/checkpoints/last.pt",
                     job="second").ok()
    assert f"resumed from {tmp_path / 'first' / 'checkpoints' / 'last.pt'}" in second.stdout
    assert second.metrics["epoch"] == 2


def test_a_chdir_sweep_config_print_lock_file_and_wall_s(run_cli, tmp_path):
    """One sweep, four findings. Item 5: under -m every job runs in its own folder with
    chdir=true, and data.path still means the folder the sweep was started in (each job
    failed: "no such file (looked at <sweep>/<job>/mydata.csv)"). Item 11: the whole config
    was printed once per job (now once per sweep; a later job prints its overrides and keeps
    the whole in its own ddp_exp.log); every finished job folder showed ``.ddp_exp.lock``
    (now under ``.hydra/``); summary.md now says what ``wall_s`` measures and that the first
    job's includes one-off warm-up."""
    _write_csv(tmp_path)
    sweep = tmp_path / "sweep"
    run = run_cli("-m", "data=file", "data.path=mydata.csv", "hydra.job.chdir=true",
                  "data.batch_size=16,32", "trainer.epochs=1", "world_size=1",
                  f"hydra.sweep.dir={sweep}", run_dir=False).ok()
    for job in ("0", "1"):
        status = json.loads((sweep / job / "status.json").read_text())
        assert status["status"] == "completed", status
        metrics = json.loads((sweep / job / "metrics.json").read_text())
        assert metrics["train/num_samples"] == ROWS
        assert not (sweep / job / ".ddp_exp.lock").exists()
        assert (sweep / job / ".hydra" / ".ddp_exp.lock").is_file()
        assert "hidden_sizes:" in (sweep / job / "ddp_exp.log").read_text()
    assert run.stdout.count("hidden_sizes:") == 1, run.stdout
    job_lines = [line for line in run.stdout.splitlines() if "this job's overrides:" in line]
    assert len(job_lines) == 1 and "data.batch_size=32" in job_lines[0], job_lines
    assert "first job a process runs also pays one-off warm-up" in (
        sweep / "summary.md").read_text()
