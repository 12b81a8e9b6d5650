"""Issue 26 items 2, 3 and 6: every failure a user's own code can cause is one line.

* A model's output shape is checked against the targets and the dataset's classes before any
  rank starts (``ddp_exp.train.objective.output_shape_error``): one line naming ``model`` and both
  shapes, exit 2, no folder.
* A model returning a dict or a tuple, and any other exception while the launcher builds and
  probes, is one line, exit 2, and leaves no folder (a refusal) or a recorded one
  (``status.json`` failed, the traceback in ``ddp_exp.log``).
* An exception from the user's Dataset (with or without DataLoader workers) or model inside a
  rank is one ``error: rank R failed: <type>: <message>`` line, exit 1; the failure table and
  traceback are in ``ddp_exp.log``.

User code plugs in through the public entry (``tests/faulty.py`` on ``PYTHONPATH``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from faulty import write_model_yaml
from helpers import QUIET, refused_before_ranks, tests_on_path
from omegaconf import open_dict

TESTS = Path(__file__).parent


def _shaped_model_args(config_dir: Path, **node) -> list[str]:
    """``<config_dir>/model/shaped.yaml`` for ``faulty.ShapedOutput`` and the overrides that
    select it."""
    folder = config_dir / "model"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "shaped.yaml").write_text(yaml.safe_dump({"_target_": "faulty.ShapedOutput",
                                                        **node}))
    return ["--config-dir", str(config_dir), "model=shaped"]


# ----------------------------------------------------------------- the rule, in one place
@pytest.mark.parametrize(("output", "target", "num_classes", "builtin", "fits"), [
    ((4, 10), (4,), 10, True, True),        # logits for 10 classes, one label per sample
    ((4, 5), (4,), 10, True, False),        # 5 outputs for the dataset's 10 classes
    ((4, 11), (4,), 10, False, False),      # a custom loss does not change what accuracy reads
    ((4,), (4,), 10, True, False),          # one value per sample is no logits
    ((4, 10, 7), (4, 7), 10, True, True),   # per-element labels [B, T]: logits [B, C, T]
    ((4, 7, 10), (4, 7), 10, True, False),  # ... not [B, T, C]
    ((4, 1), (4, 1), 0, True, True),        # regression: the target's shape
    ((4, 3), (4, 1), 0, True, False),       # would broadcast to [4, 3]
    ((4,), (4, 1), 0, True, False),         # would broadcast to [4, 4]
    ((4, 2), (4, 1), 0, False, True),       # a user's loss takes what it takes (mean, var)
])
def test_output_shape_rule(output, target, num_classes, builtin, fits):
    from ddp_exp.train.objective import output_shape_error

    problem = output_shape_error(output, target, num_classes, builtin_loss=builtin)
    assert (problem is None) == fits, problem
    if problem is not None:
        assert "\n" not in problem


def test_output_shape_message_names_both_shapes_and_the_right_one():
    from ddp_exp.train.objective import output_shape_error

    assert output_shape_error((2, 5), (2,), 10) == (
        "the output has shape [batch, 5] but the targets have shape [batch]: the model must "
        "return [batch, 10] (10 classes)")
    assert output_shape_error((2, 3), (2, 1), 0) == (
        "the output has shape [batch, 3] but the targets have shape [batch, 1]: the model "
        "must return [batch, 1] (regression: the target's shape)")


# ------------------------------------------------- refused before any rank, in this process
def _with_model(cfg, **node):
    with open_dict(cfg):
        cfg.model = {"_target_": "faulty.ShapedOutput", **node}
    return cfg


@pytest.mark.parametrize(("data", "node", "expected"), [
    (["data=synthetic"], {"kind": "width", "width": 3},
     "model: the output has shape [batch, 3] but the targets have shape [batch, 1]: the model "
     "must return [batch, 1] (regression: the target's shape)"),
    (["data=synthetic"], {"kind": "flat"},
     "model: the output has shape [batch] but the targets have shape [batch, 1]: the model "
     "must return [batch, 1] (regression: the target's shape)"),
    # The probe's two samples are labelled 0 and 1: the dataset's 10 classes decide.
    ([], {"kind": "width", "width": 5},
     "model: the output has shape [batch, 5] but the targets have shape [batch]: the model "
     "must return [batch, 10] (10 classes)"),
    # Issue 28: a mapping output is read at trainer.output_key (a tuple's first element is the
    # output: tests/test_sequences.py); a mapping without that key is refused.
    (["trainer.output_key=out"], {"kind": "dict"},
     "trainer.output_key='out' is not a key of the model's output, a dict {'logits': tensor "
     "[batch, 10]}; set trainer.output_key=<key>"),
])
def test_a_model_output_that_does_not_fit_is_refused_before_ranks(compose, tmp_path,
                                                                    monkeypatch, data, node,
                                                                    expected):
    """Items 2 and 3: trained to exit 0 through broadcasting ([B, 3] or [B] for [B, 1]),
    failed in the ranks with 49 lines ("Target 6 is out of bounds"), or crashed the launcher
    with a 54-line AttributeError ('dict' object has no attribute 'float')."""
    monkeypatch.syspath_prepend(str(TESTS))
    cfg = _with_model(compose(*data), **node)
    assert refused_before_ranks(cfg, tmp_path / "run") == expected


def test_a_user_loss_that_raises_on_the_output_is_one_line(compose, tmp_path, monkeypatch):
    """Item 3: any exception of the loss or a metric on the probe is a refusal naming it."""
    monkeypatch.syspath_prepend(str(TESTS))
    cfg = compose("+metrics.product={_target_: torch.matmul}")
    message = refused_before_ranks(cfg, tmp_path / "run")
    assert message.startswith("metrics.product: failed on the model's output [batch, 10] and "
                              "targets [batch]: RuntimeError: "), message


# ------------------------------------------------------------------------- from the CLI
@pytest.mark.parametrize(("node", "overrides", "line"), [
    ({"kind": "width", "width": 3}, ("data=synthetic",),
     "error: model: the output has shape [batch, 3] but the targets have shape [batch, 1]: "
     "the model must return [batch, 1] (regression: the target's shape)"),
    # R05: was a 54-line traceback, exit 1, a folder without status.json
    ({"kind": "dict"}, ("trainer.output_key=out",),
     "error: trainer.output_key='out' is not a key of the model's output, a dict {'logits': "
     "tensor [batch, 10]}; set trainer.output_key=<key>"),
], ids=["wrong-shape", "dict-output"])
def test_a_model_output_that_does_not_fit_from_the_cli_is_one_line_and_no_folder(
        run_cli, tmp_path, node, overrides, line):
    run = run_cli(*_shaped_model_args(tmp_path / "conf", **node), *overrides,
                  "trainer.epochs=1", QUIET, env=tests_on_path())
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.splitlines() == [line], run.stderr
    assert not run.job_dir.exists()


def test_any_exception_while_the_launcher_builds_is_one_line_and_recorded(run_cli, tmp_path):
    """Item 3: an exception that is no refusal of the input (here a model whose
    ``parameters()`` raises where the launcher builds the optimizer) was a traceback that
    left a folder without status.json: one line, exit 2, the folder recorded as failed with
    the traceback in its log."""
    config_dir = tmp_path / "conf"
    folder = config_dir / "model"
    folder.mkdir(parents=True)
    (folder / "broken.yaml").write_text("_target_: faulty.BrokenParameters\n")
    # The launcher builds the optimizer where it checks a scheduler (a plain run's optimizer is
    # built in the ranks alone): a scheduler puts the fault in the launcher.
    run = run_cli("--config-dir", str(config_dir), "model=broken", "trainer.epochs=1", QUIET,
                  "scheduler._target_=torch.optim.lr_scheduler.ExponentialLR",
                  "+scheduler.gamma=0.9", env=tests_on_path())
    log = run.job_dir / "ddp_exp.log"
    line = ("error: the launcher failed before any rank started: RuntimeError: parameters "
            f"are broken (the traceback is in {log})")
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.splitlines() == [line], run.stderr
    status = json.loads((run.job_dir / "status.json").read_text())
    assert status["status"] == "failed" and status["error"] == line[len("error: "):], status
    assert "Traceback (most recent call last)" in log.read_text()
    assert not (run.job_dir / "tensorboard").exists()


@pytest.mark.parametrize("case", ["dataset", "dataset_workers", "forward"])
def test_an_exception_from_user_code_in_a_rank_is_one_line(run_cli, tmp_path, case):
    """Item 6 (V04): a ValueError in a Dataset's __getitem__ (in the rank, or re-raised from a
    DataLoader worker as "Caught ValueError in DataLoader worker process 0") and a
    RuntimeError in a model's forward at step 3 printed 57-75 lines (the elastic failure
    table): one line naming the rank and the error, exit 1, the table and traceback in
    ddp_exp.log, status.json failed with the same line."""
    if case == "forward":
        config_dir = write_model_yaml(tmp_path / "conf", fault="raise", fault_step=3,
                                      fault_rank=1)
        args, error = (["--config-dir", str(config_dir), "model=faulty"],
                       r"rank 1 failed: RuntimeError: injected failure at step 3")
    else:
        args = ["data=dataset", "data._target_=faulty.RaisingDigits", "data.val_size=297",
                f"data.num_workers={1 if case == 'dataset_workers' else 0}"]
        error = None
    run = run_cli(*args, "trainer.epochs=1", "launcher.max_restarts=0", QUIET,
                  env=tests_on_path(), timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank "), run.stderr
    if error is None:  # which rank reads a bad item first varies; the error is the Dataset's
        prefix, _, rest = lines[0].partition(" failed: ")
        assert prefix in ("error: rank 0", "error: rank 1"), lines[0]
        assert rest.startswith("ValueError: bad item "), lines[0]
    else:
        assert lines[0] == f"error: {error}"
    assert "Traceback" not in run.stdout and "Root Cause" not in run.stdout, run.stdout
    status = json.loads((run.job_dir / "status.json").read_text())
    assert status["status"] == "failed" and status["error"] == lines[0][len("error: "):]
    log = (run.job_dir / "ddp_exp.log").read_text()
    assert "Root Cause (first observed failure)" in log and "Traceback" in log, log


def test_a_failed_rank_is_named_by_the_first_line_unless_it_carries_a_traceback():
    """A multi-line message of the rank's own exception is named by its first line (its last
    was a stray tail: the last missing key of a state_dict); a DataLoader worker's, which
    carries the worker's traceback, by its last line, the original error."""
    from ddp_exp.rank.failures import failure_detail

    assert failure_detail("RuntimeError: Error(s) in loading state_dict for MLP:\n\t"
                          "Missing key(s): net.0.weight") == (
        "RuntimeError: Error(s) in loading state_dict for MLP:")
    assert failure_detail("ValueError: Caught ValueError in DataLoader worker process 0.\n"
                          "Original Traceback (most recent call last):\n  File ...\n"
                          "ValueError: bad item 7\n") == "ValueError: bad item 7"
    # The traceback names the type with its module; the line as with num_workers=0 (a fresh
    # user's find: "ddp_exp.config.errors.ConfigError: ..." in a worker, "ConfigError" not).
    assert failure_detail("ConfigError: Caught ConfigError in DataLoader worker process 0.\n"
                          "Original Traceback (most recent call last):\n  File ...\n"
                          "ddp_exp.config.errors.ConfigError: data: item 3 is None\n") == (
        "ConfigError: data: item 3 is None")


def test_an_output_shape_changed_after_the_check_names_both_shapes_at_its_step():
    """A model whose forward returns [batch, 5] from its third step (the check before the run
    saw [batch, 10]): torch's error was "IndexError: Target 7 is out of bounds", naming no
    shape (a fresh user's find). The built-in loss now names both shapes and the right one;
    an error of the loss on fitting shapes passes as torch raised it."""
    import torch

    from ddp_exp.train.objective import Objective

    objective = Objective(10)
    with pytest.raises(ValueError, match=r"model: at this step the output has shape \[batch, "
                       r"5\] but the targets have shape \[batch\]: the model must return "
                       r"\[batch, 10\] \(10 classes\); the check before the run saw the "
                       r"right shape") as caught:
        objective.batch_loss(torch.zeros(4, 5), torch.tensor([7, 1, 2, 3]))
    assert isinstance(caught.value.__cause__, IndexError)
    with pytest.raises(IndexError, match="out of bounds"):  # shapes fit: torch's own error
        objective.batch_loss(torch.zeros(4, 10), torch.tensor([12, 1, 2, 3]))
    # Labels per element (a language model's [batch, time] at trainer.class_dim=last): the same.
    with pytest.raises(ValueError, match=r"the output has shape \[batch, 3, 5\] but the "
                       r"targets have shape \[batch, 3\]: the model must return "
                       r"\[batch, 3, 10\]"):
        objective.element_terms(torch.zeros(2, 3, 5), torch.tensor([[7, 1, 2], [3, 4, 0]]))
