"""A ``_target_`` whose module cannot be imported (issue 26 item 11d; fresh-user findings): one
line, no log record, naming the module and why (not found, or an error while importing it), and
where Python looked (the console script does not look in the current folder)."""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

from ddp_exp.config.errors import ConfigError
from ddp_exp.config.targets import locate

UNIMPORTABLE = "nosuchmodule.make"


def _hydra_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("hydra")]


@pytest.mark.parametrize("where", ["data", "loss", "metrics.m"])
def test_an_unimportable_target_is_one_error_and_no_log_record(caplog, where):
    """Regression: ``data._target_=nosuchmodule.make`` (and a loss or metric that cannot be
    imported) printed Hydra's multi-line ERROR log record ("Error getting object at ...") on
    stdout before the one-line error: the lookups that inspect a target before instantiating
    it went through ``hydra.utils.get_object``, which logs."""
    from ddp_exp.data import load
    from ddp_exp.train.objective import Objective

    caplog.set_level(logging.DEBUG)
    with pytest.raises(ConfigError) as info:
        if where == "data":
            load({"_target_": UNIMPORTABLE, "val_size": 0, "batch_size": 8, "num_workers": 0,
                  "task": "auto", "num_classes": None}, seed=0, world_size=1)
        elif where == "loss":
            Objective(10, loss={"_target_": UNIMPORTABLE})
        else:
            Objective(10, metrics={"m": {"_target_": UNIMPORTABLE}})
    message = str(info.value)
    assert message.startswith(f"{where}._target_='{UNIMPORTABLE}'"), message
    assert "\n" not in message and "nosuchmodule" in message
    assert _hydra_records(caplog) == []


def test_find_target_finds_what_instantiate_finds(tmp_path, monkeypatch, caplog):
    """find_target and Hydra's instantiate resolve the same paths (builtins, a class's
    attribute, a module under a package), and find_target says nothing when it finds none."""
    import collections

    from hydra.utils import get_object

    from ddp_exp.config.targets import find_target
    from ddp_exp.train.objective import cross_entropy

    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = {"ddp_exp.train.objective.cross_entropy": cross_entropy, "builtins.len": len,
             "collections.OrderedDict.fromkeys": collections.OrderedDict.fromkeys,
             "torch.nn.functional.cross_entropy": torch.nn.functional.cross_entropy}
    for path, obj in found.items():
        assert find_target(path) == obj == get_object(path), path
    for path in (UNIMPORTABLE, "ddp_exp.train.objective.no_such_name", "raises_on_import.f",
                 "torch.nn.NoSuchLayer"):
        assert find_target(path) is None, path
    assert caplog.records == []


def test_an_unimportable_data_target_prints_one_line_only(run_cli):
    """The CLI: nothing on stdout, one line on stderr, exit 2, no folder left."""
    run = run_cli(f"data._target_={UNIMPORTABLE}", timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout.strip() == "", run.stdout
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: data._target_='{UNIMPORTABLE}'"), \
        run.stderr
    assert not run.job_dir.exists()


@pytest.mark.parametrize(("package", "source", "expected"), [
    ("raising_pkg", "raise RuntimeError('boom at import')\n",
     "cannot be imported: importing raising_pkg.broken raised RuntimeError: boom at import"),
    ("needing_pkg", "import missing_dependency_xyz\n",
     "cannot be imported (No module named 'missing_dependency_xyz')"),
])
def test_a_model_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch, package, source,
                                                         expected):
    """Regression: ``model._target_`` (or ``scheduler._target_``) in a module that raises while
    it is imported ended the CLI with that traceback, exit 1; one whose own import is missing
    was reported as "no such module or attribute"."""
    from ddp_exp.config.targets import locate

    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "broken.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        locate(f"{package}.broken.Model", "model._target_")
    assert str(info.value) == f"model._target_='{package}.broken.Model' {expected}"


@pytest.mark.parametrize("key", ["data", "loss", "metrics.f1", "optim"])
def test_any_target_whose_module_fails_to_import_names_the_module_and_why(tmp_path, monkeypatch,
                                                                          key):
    """Regression: ``data._target_`` (or any node built by ``instantiate_node``) in a module
    that raises while it is imported gave Hydra's text, "... Are you sure that module
    'raising_data' is installed?", a wrong guess; now the same line as ``model._target_``."""
    from ddp_exp.config.targets import instantiate_node

    (tmp_path / "raising_data.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        instantiate_node({"_target_": "raising_data.make"}, key)
    assert str(info.value) == (f"{key}._target_='raising_data.make' cannot be imported: "
                               "importing raising_data raised RuntimeError: boom at import")


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
