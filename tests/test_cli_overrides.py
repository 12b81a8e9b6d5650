"""What the command line's overrides may say, and the one line each mistake gets: a new key needs
``+`` (and a group with a default does not), deleting a packaged option's key is not needed,
an interpolation that resolves nowhere names its key, and ``-m`` may follow the overrides.
"""

from __future__ import annotations

import pytest


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
    # Any other key of the schema (a fresh user's find: no hint at what would be valid).
    with pytest.raises(hydra.errors.ConfigCompositionException) as info:
        compose("~trainer.epochs")
    assert _one_line(info.value) == (
        "trainer.epochs: TrainerConfig (DictConfig) does not support deletion; a key of "
        "ddp_exp's schema cannot be deleted: give it a value instead (trainer.epochs=...)")


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


def test_an_unresolvable_override_replaced_by_a_later_one_is_never_resolved(run_cli):
    """Fresh-user finding (round 5): ``'trainer.epochs=${oops}' trainer.epochs=1`` failed in
    the launcher ("InterpolationKeyError", a half-made job folder): the config checks read
    Hydra's override list resolved. The later override wins, as Hydra composes it: it trains."""
    run = run_cli("trainer.epochs=${oops}", "trainer.epochs=1", "world_size=1",
                  "trainer.max_steps=2", "print_config=false").ok()
    assert run.metrics["epoch"] == 1 and run.metrics["global_step"] == 2


def test_the_multirun_flag_may_follow_the_overrides():
    """Fresh-user finding: ``python -m ddp_exp data.batch_size=16,32 -m`` was an 8-line
    argparse usage ending in "unrecognized arguments"; Hydra's parser takes the flag only
    before the overrides, so the entry point moves it there."""
    from ddp_exp.launch.torchrun_env import multirun_flag_first

    assert multirun_flag_first(["ddp_exp", "data.batch_size=16,32", "-m", "world_size=1"]) == [
        "ddp_exp", "-m", "data.batch_size=16,32", "world_size=1"]
    assert multirun_flag_first(["ddp_exp", "a=1", "--multirun"]) == ["ddp_exp", "--multirun",
                                                                     "a=1"]
    assert multirun_flag_first(["ddp_exp", "a=1"]) == ["ddp_exp", "a=1"]


@pytest.mark.parametrize("override", ["+experiment=digits_cnn_recipe", "+data=synthetic",
                                      "+optim=adamw", "+debug=default", "+hydra/launcher=basic"])
def test_a_plus_on_a_group_with_a_default_says_drop_the_plus(compose, override):
    """Regression: ``+experiment=<name>`` (any group the defaults list has already) got Hydra's
    bare "Multiple values for experiment. To override a value use 'override experiment: ...'",
    a defaults-list edit, with no word of the command-line fix."""
    from hydra.errors import HydraException

    from ddp_exp.cli.errors import _plus_on_a_default

    with pytest.raises(HydraException) as info:
        compose("world_size=1", override)
    argv = ["world_size=1", override]
    line = _plus_on_a_default(info.value, argv)
    group, _, option = override[1:].partition("=")
    assert line is not None and "\n" not in line, (line, str(info.value))
    assert line.startswith(f"{override}: the group {group} "), line
    assert line.endswith(f"choose its option without the +: {group}={option}"), line
    compose("world_size=1", override[1:])  # what the hint says composes


def test_the_drop_the_plus_hint_only_for_the_users_plus(compose):
    """Other composition errors, and a group added twice by the user, keep Hydra's message."""
    from hydra.errors import HydraException

    from ddp_exp.cli.errors import _plus_on_a_default

    with pytest.raises(HydraException) as info:
        compose("world_size=1", "data=digitz")
    assert _plus_on_a_default(info.value, ["data=digitz"]) is None
    with pytest.raises(HydraException) as info:
        compose("world_size=1", "+data=synthetic")
    assert _plus_on_a_default(info.value, ["data=synthetic"]) is None  # not from argv
    assert _plus_on_a_default(info.value, ["+data=synthetic", "+data=digits"]) is None


def test_a_plus_on_a_group_with_a_default_is_one_line_on_the_cli(run_cli):
    run = run_cli("+experiment=digits_cnn_recipe", timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.splitlines() == [
        "error: +experiment=digits_cnn_recipe: the group experiment is in the defaults list "
        "already (a + adds a group that is not); choose its option without the +: "
        "experiment=digits_cnn_recipe"], run.stderr
    assert not run.job_dir.exists()


def test_cfg_job_prints_the_config_and_starts_nothing(run_cli):
    run = run_cli("--cfg", "job", "model=cnn", "data=digits", "world_size=2")
    assert run.returncode == 0, run.stderr
    assert "ddp_exp.train.models.CNN" in run.stdout and "world_size: 2" in run.stdout
    assert not run.job_dir.exists()
