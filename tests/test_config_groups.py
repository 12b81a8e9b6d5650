"""Config groups and the primary config (issue 32 items 6 and 7; R19): ``group=null`` and
``~group`` name the option that means none, in one line; a primary config of the user's own
that leaves out ddp_exp's is one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ddp_exp.config.compose import group_options, null_group_line

HYDRA_NULL_GROUP = ValueError("Config group override must be a string or a list. Got NoneType")


# --- item 6 (R19): group=null and ~group -------------------------------------------------------

def test_null_group_names_the_option_that_means_none():
    """``scheduler=null`` was Hydra's 41-line ValueError, exit 1: now one line with the hint."""
    line = null_group_line(HYDRA_NULL_GROUP, ["world_size=2", "scheduler=null"])
    assert line == ("scheduler=null: a config group takes one of its options, not null; "
                    "scheduler=none")
    # the options are the packaged files of conf/model/, listed in order
    import ddp_exp.conf

    models = sorted(p.stem for p in Path(ddp_exp.conf.__file__).parent.joinpath(
        "model").glob("*.yaml"))
    assert null_group_line(HYDRA_NULL_GROUP, ["model=null"]).endswith(
        f"choose one of {', '.join(models)}")
    assert "leave debug out" in null_group_line(HYDRA_NULL_GROUP, ["debug=null"])
    # Another error, or a null that is not a group's (a key with a dot), is not this one.
    assert null_group_line(ValueError("other"), ["scheduler=null"]) is None
    assert null_group_line(HYDRA_NULL_GROUP, ["trainer.max_steps=null"]) is None
    assert group_options("scheduler") == ["cosine", "none", "step"]
    assert group_options("no_such_group") == []


def test_deleted_group_is_one_line_with_its_options(compose, tmp_path):
    """``~data`` was a 63-line MissingMandatoryValue traceback that left a folder."""
    from helpers import refused_before_ranks

    message = refused_before_ranks(compose("~data"), tmp_path / "run")
    assert message.startswith("data is required but was not set: add data=... (one of ")
    assert "digits" in message and "synthetic" in message


def test_null_group_on_the_command_line(run_cli):
    run = run_cli("scheduler=null")
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == ("error: scheduler=null: a config group takes one of its "
                                  "options, not null; scheduler=none")
    assert not run.job_dir.exists()


# --- item 7: a primary config of the user's own ------------------------------------------------

def test_primary_config_without_ddp_exps_is_one_line(run_cli, tmp_path):
    """``--config-dir D --config-name bare`` with a ``bare.yaml`` whose defaults list lacks
    ddp_exp's ``config`` was a 70-line "Key 'launcher' is not in struct", exit 1, a folder
    left: now one line saying what the primary config must include, before any folder."""
    conf = tmp_path / "myconf"
    conf.mkdir()
    (conf / "bare.yaml").write_text("defaults:\n  - data: digits\n  - _self_\nworld_size: 1\n")
    run = run_cli("--config-dir", str(conf), "--config-name", "bare")
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --config-name bare: "), run.stderr
    assert "defaults: [config, <your options>, _self_]" in lines[0]
    assert not run.job_dir.exists()


def test_primary_config_check_only_for_a_named_primary_config():
    from ddp_exp.config.compose import PrimaryConfigCheck, primary_config_overrides

    assert primary_config_overrides(["world_size=2", "--config-dir", "conf"]) == []
    for argv in (["--config-name", "bare"], ["-cn", "bare"], ["--config-name=bare"]):
        [override] = primary_config_overrides(argv)
        assert override.endswith("=ddp_exp.config.compose.PrimaryConfigCheck")
    with pytest.raises(SystemExit) as info:
        PrimaryConfigCheck().on_run_start(config=OmegaConf.create({"world_size": 1}),
                                          config_name="bare")
    assert info.value.code == 2
