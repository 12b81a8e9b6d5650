"""A user's ``--config-dir`` wins over ddp_exp's configs of the same name (hydra #2758, issue 41
item 6, case W04; :mod:`ddp_exp.config.user_dir`).

Before: ``model/mlp.yaml`` with ``hidden_sizes: [7]`` and an edited copy of
``experiment/digits_cnn_recipe.yaml`` (``epochs: 2``) were silently ignored for the packaged
files (width 128, 15 epochs). Composition is read with ``--cfg job`` (the config the run trains).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import run_sweep

CONF = Path(__file__).resolve().parents[1] / "conf"


def _cfg_job(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return run_sweep(cwd, "--cfg", "job", *args, timeout=120)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.slow
def test_the_users_model_config_of_a_packaged_name_is_the_one_composed(tmp_path):
    _write(tmp_path / "conf" / "model" / "mlp.yaml",
           "defaults:\n  - /schema/model/mlp@_here_\n  - _self_\nhidden_sizes: [7]\n")
    out = _cfg_job(tmp_path, "--config-dir", "conf")
    assert out.returncode == 0, out.stderr
    model = yaml.safe_load(out.stdout)["model"]
    assert model["hidden_sizes"] == [7]
    assert model["_target_"].endswith("MLP")


@pytest.mark.slow
def test_an_edited_copy_of_a_packaged_experiment_is_the_one_composed(tmp_path):
    recipe = (CONF / "experiment" / "digits_cnn_recipe.yaml").read_text()
    assert "  epochs: 15\n" in recipe  # the packaged value the copy edits
    _write(tmp_path / "conf" / "experiment" / "digits_cnn_recipe.yaml",
           recipe.replace("  epochs: 15\n", "  epochs: 2\n"))
    out = _cfg_job(tmp_path, "--config-dir=conf", "experiment=digits_cnn_recipe")
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["trainer"]["epochs"] == 2
    packaged = _cfg_job(tmp_path, "experiment=digits_cnn_recipe")
    assert yaml.safe_load(packaged.stdout)["trainer"]["epochs"] == 15


@pytest.mark.slow
def test_a_users_file_of_one_key_is_refused_naming_the_file_it_replaced(tmp_path):
    """A file of one key replaces the packaged one whole (Hydra's rule for a config of the same
    name): its ``_target_`` is gone, and the line says which file and how to keep it."""
    _write(tmp_path / "conf" / "model" / "mlp.yaml", "hidden_sizes: [7]\n")
    out = run_sweep(tmp_path, "--config-dir", "conf", "print_config=false",
                    f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error: model._target_=null is invalid")
    assert (f"your {tmp_path / 'conf'}/model/mlp.yaml replaces ddp_exp's model/mlp.yaml"
            in lines[0])
    assert "/schema/model/mlp@_here_" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_users_config_yaml_keeps_the_packaged_primary_with_one_warning(tmp_path):
    _write(tmp_path / "conf" / "config.yaml", "defaults:\n  - config\n")
    _write(tmp_path / "conf" / "model" / "mlp.yaml", "hidden_sizes: [7]\n")
    out = _cfg_job(tmp_path, "--config-dir", "conf")
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["model"]["hidden_sizes"] == [128]
    warnings = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1
    assert "config.yaml is not read" in warnings[0] and "model/mlp.yaml" in warnings[0]
    assert "--config-name" in warnings[0]


@pytest.mark.parametrize(("argv", "expected"), [
    (["model=tiny"], None),
    (["--config-dir", "a", "x=1"], "a"),
    (["--config-dir=b"], "b"),
    (["-cd", "c", "-m"], "c"),
    (["-cd=d", "--config-dir", "e"], "e"),
])
def test_the_config_dir_is_read_from_the_command_line(argv, expected):
    import os

    from ddp_exp.config.user_dir import config_dir_from_argv

    assert config_dir_from_argv(argv) == (None if expected is None else os.path.abspath(expected))


def test_the_packaged_configs_are_listed_by_their_path():
    from ddp_exp.config.user_dir import packaged_configs

    assert {"config.yaml", "model/mlp.yaml", "experiment/digits_cnn_recipe.yaml"} <= (
        packaged_configs())
