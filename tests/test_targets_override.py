"""First-day findings, round 3 (issue 26 items 5, 7, 8, 11): relative paths under
``hydra.job.chdir``, your own ``_target_`` from the command line, ``trainer.resume=auto`` with
nothing to resume, and the smaller ones (the config printed once per sweep, the lock file out of
sight, the sweep summary's ``wall_s``, where Python looked for a module that is not there)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ddp_exp.config.checks import validate
from ddp_exp.config.errors import ConfigError
from ddp_exp.config.targets import locate
from ddp_exp.launch import user_input

TINY_NET = """\
import math

import torch.nn as nn


class TinyNet(nn.Module):
    def __init__(self, input_shape, num_outputs, width=16):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width),
                                 nn.ReLU(), nn.Linear(width, num_outputs))

    def forward(self, x):
        return self.net(x)
"""

MY_DATA = """\
import torch
from torch.utils.data import TensorDataset


def make(size=100):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(size, 4, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())
"""

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


# ------------------------------------------- item 8: trainer.resume=auto, nothing there
def test_resume_auto_with_nothing_to_resume_says_so(tmp_path, caplog):
    """Regression (V05): ``trainer.resume=auto`` without ``hydra.run.dir`` trained from
    scratch in a new timestamped folder without a word. One warning names the folder and how
    to resume a run; none when there is a last.pt to continue from or resume is not asked."""
    from ddp_exp.io.checkpoint import LAST, checkpoint_dir
    from ddp_exp.job.earlier_run import refuse_earlier_run

    job = tmp_path / "outputs" / "runs" / "new"
    job.mkdir(parents=True)
    caplog.set_level(logging.INFO, logger="ddp_exp")
    refuse_earlier_run(str(job), "auto")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"trainer.resume=auto: nothing to resume in {job}: starting fresh; to "
                        "resume a run, pass its folder as hydra.run.dir"]
    caplog.clear()
    refuse_earlier_run(str(job), None)
    os.makedirs(checkpoint_dir(str(job)))
    Path(checkpoint_dir(str(job)), LAST).write_bytes(b"")
    refuse_earlier_run(str(job), "auto")
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


# ------------------------------------------------ item 11b: the lock file out of sight
def test_the_lock_file_lives_under_dot_hydra_and_still_locks(tmp_path):
    """Regression: ``.ddp_exp.lock`` stayed in every finished job folder and made it look in
    use. It lives in ``.hydra/`` (beside the record it keeps), still refuses a second run
    there, and a refused single run's folder that holds only what its start made is still
    removed."""
    from ddp_exp.job.folder import (
        LOCK_FILE,
        JobFolderBusy,
        job_folder_lock,
        note_new_folders,
        remove_refused_folder,
    )

    job = tmp_path / "run"
    note_new_folders(str(job))
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "config.yaml").write_text("seed: 0\n")
    with job_folder_lock(str(job), str(job / ".hydra")):
        with pytest.raises(JobFolderBusy):
            with job_folder_lock(str(job), str(job / ".hydra")):
                pass
    assert sorted(p.name for p in job.iterdir()) == [".hydra"]
    assert (job / ".hydra" / LOCK_FILE).is_file()
    assert remove_refused_folder(str(job), ".hydra", None) and not job.exists()


# ----------------------------------------------------------- item 7: your own _target_
def test_a_target_override_drops_the_replaced_options_arguments(compose, tmp_path, monkeypatch,
                                                                caplog):
    """Regression (V02): ``model._target_=mymodel.TinyNet`` passed model=mlp's hidden_sizes
    and dropout to TinyNet ("unexpected keyword argument 'hidden_sizes'"), and
    ``~model.hidden_sizes`` is refused by the schema. A _target_ override drops the replaced
    option's arguments that the new target does not accept, for every group, and says so."""
    (tmp_path / "mymodel.py").write_text(TINY_NET)
    (tmp_path / "mydata.py").write_text(MY_DATA)
    monkeypatch.syspath_prepend(str(tmp_path))
    caplog.set_level(logging.INFO, logger="ddp_exp")
    cases = [
        (["model._target_=mymodel.TinyNet", "+model.width=8"], "model",
         {"_target_": "mymodel.TinyNet", "width": 8}, ["hidden_sizes", "dropout"]),
        (["optim._target_=torch.optim.Adam"], "optim",
         {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 0.05, "lr_scaling": "none",
          "reference_batch_size": 64, "weight_decay": 0.0}, ["momentum", "nesterov"]),
        (["scheduler=cosine", "scheduler._target_=torch.optim.lr_scheduler.ExponentialLR",
          "+scheduler.gamma=0.9"], "scheduler",
         {"_target_": "torch.optim.lr_scheduler.ExponentialLR", "interval": "step",
          "gamma": 0.9}, ["warmup_steps", "min_lr"]),
        (["data=synthetic", "data._target_=mydata.make"], "data", None,
         ["num_samples", "num_features", "noise_std", "seed"]),  # num_classes: ddp_exp's too
    ]
    from omegaconf import OmegaConf

    for overrides, group, expected, gone in cases:
        caplog.clear()
        cfg = compose(*overrides)
        assert user_input.drop_replaced_keys(cfg) == {group: gone}
        validate(cfg)
        node = OmegaConf.to_container(cfg[group], resolve=True)
        if expected is not None:
            assert node == expected
        assert not set(gone) & set(node)
        assert "batch_size" in OmegaConf.to_container(cfg.data)  # ddp_exp's own keys stay
        lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        assert len(lines) == 1 and ", ".join(gone) in lines[0], lines


def test_a_target_override_keeps_what_the_new_target_accepts_or_the_user_typed(compose,
                                                                               tmp_path,
                                                                               monkeypatch):
    """Keys the new target accepts stay (weight_decay for Adam); a key given on the command
    line stays (its error is the user's to see); a target that takes **kwargs or cannot be
    imported keeps every key; the packaged option itself loses nothing."""
    (tmp_path / "anymodel.py").write_text("def Net(**kwargs):\n    return kwargs\n\n\n"
                                          "def Plain(input_shape, num_outputs):\n    return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert user_input.drop_replaced_keys(compose("optim._target_=torch.optim.AdamW")) == {
        "optim": ["momentum", "nesterov"]}
    typed = compose("model._target_=anymodel.Plain", "model.hidden_sizes=[4]")
    assert user_input.drop_replaced_keys(typed, {"model.hidden_sizes", "model._target_"}) == {
        "model": ["dropout"]}
    assert list(typed.model.hidden_sizes) == [4]
    (tmp_path / "mydata.py").write_text(MY_DATA)
    data = compose("data=file", "data.path=x.csv", "data._target_=mydata.make")
    assert user_input.drop_replaced_keys(data, {"data.path", "data._target_"}) == {}
    assert data.data.task == "auto"  # ddp_exp reads it (data.task), whatever the target takes
    for overrides in (["model._target_=anymodel.Net"], ["model._target_=nosuchmodule.Net"],
                      [], ["model=cnn"], ["scheduler=step"]):
        assert user_input.drop_replaced_keys(compose(*overrides)) == {}, overrides


def test_your_own_model_from_the_command_line_trains(run_cli, tmp_path):
    """Regression (V02): ``model._target_=mymodel.TinyNet +model.width=8`` as a user first
    types it trains to the end, the log naming the keys dropped."""
    (tmp_path / "mymodel.py").write_text(TINY_NET)
    run = run_cli("model._target_=mymodel.TinyNet", "+model.width=8", "trainer.epochs=1",
                  "world_size=1", "print_config=false").ok()
    assert "dropped model=mlp's hidden_sizes, dropout (not arguments of TinyNet)" in run.stdout
    state = torch.load(run.job_dir / "model.pt", weights_only=True)
    assert state["net.1.weight"].shape == (8, 64)


def test_a_data_yaml_that_extends_dataset_takes_its_own_arguments(compose, tmp_path):
    """Regression: a data YAML over /schema/data/dataset (or base) with its target's own
    argument failed with Hydra's "Key 'size' not in 'TorchDatasetConfig'" (4 lines); the
    schema's own keys stay typed."""
    import hydra
    from omegaconf.errors import ValidationError

    conf = tmp_path / "conf" / "data"
    conf.mkdir(parents=True)
    for name, schema in (("mine", "dataset"), ("mine_base", "base")):
        (conf / f"{name}.yaml").write_text(
            f"defaults:\n  - /schema/data/{schema}@_here_\n  - _self_\n\n"
            "_target_: mydata.make\nsize: 120\nval_size: 20\n")
    search = f"hydra.searchpath=[file://{tmp_path / 'conf'}]"
    for name in ("mine", "mine_base"):
        cfg = compose(search, f"data={name}")
        assert cfg.data.size == 120 and cfg.data.val_size == 20 and cfg.data.batch_size == 32
        validate(cfg)
    with pytest.raises(hydra.errors.ConfigCompositionException) as info:
        compose(search, "data=mine", "data.batch_size=x")
    assert isinstance(info.value.__cause__, ValidationError)


def test_a_new_data_key_without_plus_is_told_to_add_the_plus(run_cli):
    """Regression: ``data=dataset data.size=100`` listed the schema's valid keys without
    saying that a target's own argument is added with ``+data.size=``."""
    run = run_cli("data=dataset", "data._target_=mydata.make", "data.size=100")
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "+data.size=" in run.stderr, run.stderr


def test_a_new_model_key_without_plus_on_a_packaged_option_says_add_the_plus(compose):
    """Regression: ``model._target_=mymodel.TinyNet model.width=8`` (TinyNet's own argument,
    without the +) listed model=mlp's valid keys only, as if width could not be given."""
    import hydra

    from ddp_exp.cli.errors import _one_line

    for override, key in (("model.width=8", "model.width"), ("optim.amsgrad=true",
                                                             "optim.amsgrad")):
        with pytest.raises(hydra.errors.ConfigCompositionException) as info:
            compose(override)
        line = _one_line(info.value)
        assert "valid keys: " in line and f"added with +{key}=..." in line, line
        assert "\n" not in line


def test_deleting_a_packaged_options_key_says_there_is_no_need(compose):
    """Regression (V02): ``~model.hidden_sizes``, what a user tries next, was refused with
    "MLPConfig (DictConfig) does not support deletion" and no way on."""
    import hydra

    from ddp_exp.cli.errors import _one_line

    with pytest.raises(hydra.errors.ConfigCompositionException) as info:
        compose("~model.hidden_sizes", "model._target_=mymodel.TinyNet")
    line = _one_line(info.value)
    assert line.startswith("model.hidden_sizes: ") and "\n" not in line
    assert "one given in its place drops the keys its signature does not take" in line


# ------------------------------------------------------- item 11d: where Python looked
def test_an_unimportable_user_module_says_where_python_looked(tmp_path, monkeypatch):
    """Regression: ``data._target_=mydata.make`` whose module is nowhere said only "No module
    named 'mydata'"; the line now names the folder the command runs in and PYTHONPATH, for any
    _target_ (one resolver). A module missing *inside* the user's module gets no such hint."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for key in ("data._target_", "model._target_", "optim._target_"):
        with pytest.raises(ConfigError) as info:
            locate("nosuchmodule_r3.make", key)
        message = str(info.value)
        assert message.startswith(f"{key}='nosuchmodule_r3.make' cannot be imported")
        assert "PYTHONPATH" in message and str(tmp_path) in message and "\n" not in message
        assert "python -m ddp_exp" not in message
    (tmp_path / "usesmissing.py").write_text("import nosuchdependency_r3\n")
    with pytest.raises(ConfigError) as info:
        locate("usesmissing.make", "data._target_")
    assert "nosuchdependency_r3" in str(info.value) and "PYTHONPATH" not in str(info.value)


def test_the_console_script_hint_says_it_does_not_look_in_the_folder(tmp_path, monkeypatch):
    """The ``ddp-exp`` console script's sys.path holds its own folder, not the current one:
    the hint says so and how to run it instead."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path
                                      if os.path.abspath(p or os.curdir) != str(tmp_path)])
    with pytest.raises(ConfigError) as info:
        locate("nosuchmodule_r3.make", "data._target_")
    assert "python -m ddp_exp" in str(info.value) and "PYTHONPATH" in str(info.value)


@pytest.mark.parametrize("override, key", [("data.val_size=${oops}", "data.val_size"),
                                           ("trainer.epochs=${now:}", "trainer.epochs")])
def test_an_interpolation_that_resolves_nowhere_is_one_line_naming_its_key(run_cli, tmp_path,
                                                                          override, key):
    """Regression: a typed ``${...}`` that names no key was resolved while the entry point read
    Hydra's override list (an ``InterpolationKeyError`` traceback, exit 0, a folder without
    ``status.json``), and a bad resolver call failed later in the same way: one line naming the
    key, exit 2, no folder."""
    run = run_cli(override)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and run.stderr.startswith(f"error: {key}: "), run.stderr
    assert not (tmp_path / "run").exists()


def test_the_multirun_flag_may_follow_the_overrides():
    """Fresh-user finding: ``python -m ddp_exp data.batch_size=16,32 -m`` was an 8-line
    argparse usage ending in "unrecognized arguments"; Hydra's parser takes the flag only
    before the overrides, so the entry point moves it there."""
    from ddp_exp.launch.torchrun import multirun_flag_first

    assert multirun_flag_first(["ddp_exp", "data.batch_size=16,32", "-m", "world_size=1"]) == [
        "ddp_exp", "-m", "data.batch_size=16,32", "world_size=1"]
    assert multirun_flag_first(["ddp_exp", "a=1", "--multirun"]) == ["ddp_exp", "--multirun",
                                                                     "a=1"]
    assert multirun_flag_first(["ddp_exp", "a=1"]) == ["ddp_exp", "a=1"]
