"""Rough edges a new user hit (fresh-user findings): bad input refused in one plain line, a
failure named plainly, a user's Dataset read no more than it must be."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import pytest
import torch

from ddp_exp.config.errors import ConfigError

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


def test_the_launcher_reads_a_datasets_item_0_once(compose, tmp_path):
    """Regression: before the ranks start, the launching process read item 0 of a user's
    Dataset twice: once to learn the shapes and the task (``ddp_exp.data.lazy.describe``), once
    more in the objective's probe of the first training samples (``ddp_exp.launch.build``). A
    Dataset
    that decodes a file or draws at random paid for it twice."""
    from ddp_exp.launch import elastic as launch

    cfg = compose("world_size=1", "trainer.epochs=1", "data=dataset",
                  "data._target_=lazy_data.counted_splits")
    job_dir = tmp_path / "run"
    job_dir.mkdir()
    _, inputs = launch.prepare_world(cfg, str(job_dir), 1)
    train = inputs.datasets.train
    assert 0 in train.indices[:2]  # the probe's samples hold item 0: it would be read again
    assert train.dataset.reads.count(0) == 1, train.dataset.reads
    assert len(train.dataset.reads) == 2  # item 0, then the probe's other sample
    assert inputs.datasets.items_read == {}  # the ranks read every item themselves


NAN_LINE = ("error: rank 1 failed: NonFiniteLossError: non-finite training loss at step 3 (the "
            "earliest on any rank); all 2 rank(s) stopped. Lower optim.lr or check the data for "
            "NaN/inf")


@pytest.mark.parametrize(("rank", "raised"), [(0, "PeerFailed"), (1, "NonFiniteLossError")])
def test_a_non_finite_loss_is_raised_by_the_rank_that_had_it(monkeypatch, rank, raised):
    """Regression: every rank raised the same NonFiniteLossError, so the launchers named any
    rank as the failed one: "rank 0 failed: NonFiniteLossError: ... (first seen on rank 1)".
    Now the rank whose loss went non-finite first raises it and the others raise PeerFailed,
    which the launchers report as a knock-on effect. Here rank 1's loss was NaN at step 3 and
    this rank's (when it is rank 0) only at step 4: the all-reduce (MIN of step x world + rank)
    is played by a stub."""
    import torch.distributed as dist

    from ddp_exp.distributed.process_group import PeerFailed, World
    from ddp_exp.metrics.train_loss import LossWindow, NonFiniteLossError
    from ddp_exp.rank.failures import is_peer_failure

    def all_reduce(tensor, op=None):
        assert op == dist.ReduceOp.MIN
        tensor.fill_(min(float(tensor.item()), 3 * 2 + 1))  # rank 1's first bad step: 3

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    world = World(rank=rank, local_rank=rank, world_size=2, local_world_size=2)
    window = LossWindow(torch.device("cpu"))
    for step, loss in enumerate([0.5, 0.5, 0.5 if rank == 0 else math.nan, math.nan], start=1):
        window.add(torch.tensor(loss), 8, step)
    with pytest.raises((PeerFailed, NonFiniteLossError)) as info:
        window._raise_nonfinite([float(t) for t in window.losses], window.steps, world)
    assert type(info.value).__name__ == raised
    assert is_peer_failure(info.value) == (raised == "PeerFailed")
    if raised == "PeerFailed":
        assert str(info.value) == "rank 1 failed first: non-finite training loss at step 3"
    else:
        assert f"rank {rank} failed: {type(info.value).__name__}: {info.value}" == NAN_LINE[7:]


def test_a_non_finite_loss_names_the_rank_that_had_it(run_cli, tmp_path):
    """The CLI: NaN outputs on rank 1 at step 3 give one line naming rank 1 (before: rank 0 or
    1, whichever exited first, "... (first seen on rank 1)"); status.json says the same; only
    rank 1 left an error file."""
    from faulty import write_model_yaml

    write_model_yaml(tmp_path / "conf", fault="nan", fault_step=3, fault_rank=1)
    tests = str(Path(__file__).parent)
    run = run_cli("--config-dir", str(tmp_path / "conf"), "model=faulty", "world_size=2",
                  "trainer.epochs=1", "print_config=false", timeout=120,
                  env={"PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])})
    assert run.returncode == 1, run.stdout + run.stderr
    assert [ln for ln in run.stderr.splitlines() if ln.strip()] == [NAN_LINE], run.stderr
    status = json.loads((run.job_dir / "status.json").read_text())
    assert status["status"] == "failed" and f"error: {status['error']}" == NAN_LINE, status
    assert sorted(p.name for p in (run.job_dir / "errors").iterdir()) == ["rank1.json"]


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
