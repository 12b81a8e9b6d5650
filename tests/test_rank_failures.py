"""A rank that fails ends the whole world with one line naming it (issue 4, cases C12 and C13):
an exception, a NaN loss or a SIGKILL of one rank, under the launcher and under torchrun.

Faults are injected without touching the product: ``tests/faulty.py`` holds ``FaultyMLP``, a
user model plugged in through the public entry (``--config-dir <dir> model=faulty`` with this
folder on ``PYTHONPATH``), which raises, returns NaN or SIGKILLs its own rank at a given step.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers import (
    QUIET,
    TORCHRUN_2,
    faulty_args,
    output,
    root_cause,
    tests_on_path,
)


def test_faulty_model_matches_mlp_and_fires_once(tmp_path, monkeypatch):
    """The injector itself: same initial weights and keys as MLP, fires at its step, once."""
    from faulty import FaultyMLP

    from ddp_exp.train.models import MLP

    torch.manual_seed(0)
    plain = MLP((1, 8, 8), 10)
    torch.manual_seed(0)
    once = tmp_path / "once"
    faulty = FaultyMLP((1, 8, 8), 10, fault="raise", fault_step=2, fault_rank=1,
                       once_file=str(once))
    assert plain.state_dict().keys() == faulty.state_dict().keys()
    for k, v in plain.state_dict().items():
        assert torch.equal(v, faulty.state_dict()[k]), k
    x = torch.rand(4, 1, 8, 8)
    monkeypatch.setenv("RANK", "1")
    faulty.eval()
    for _ in range(3):
        faulty(x)  # evaluation does not count
    faulty.train()
    faulty(x)
    with pytest.raises(RuntimeError, match="injected failure at step 2"):
        faulty(x)
    assert once.exists()
    faulty.calls = 1
    faulty(x)  # step 2 again, but the once file exists
    nan = FaultyMLP((1, 8, 8), 10, fault="nan", fault_step=1, fault_rank=0)
    monkeypatch.setenv("RANK", "1")
    assert torch.isfinite(nan(x)).all()  # other rank: no fault
    nan.calls = 0
    monkeypatch.setenv("RANK", "0")
    assert torch.isnan(nan(x)).all()


# ------------------------------------------------------------ 3. a rank that raises or dies
@pytest.mark.slow
@pytest.mark.parametrize(("fault", "rank"), [("raise", 1), ("raise", 0), ("kill", 1)])
def test_failing_rank_ends_job_naming_the_rank(run_cli, tmp_path, fault, rank):
    """Must-hold 3: a rank raises (or is SIGKILLed) at step 5, no restarts: non-zero exit, no
    hang (run_cli's timeout), that rank named as the root cause with its error shown once, no
    process left (run_cli checks)."""
    run = run_cli(*faulty_args(tmp_path / "conf", fault=fault, fault_step=5, fault_rank=rank),
                  "world_size=2", "trainer.epochs=2", "launcher.max_restarts=0", QUIET,
                  env=tests_on_path(), timeout=120)
    text = output(run)
    assert run.returncode != 0, text
    # A rank that raised is one line (issue 26 item 6), its table in the job log; a rank
    # killed by a signal has no traceback and gets the table on the console.
    cause = root_cause(text if fault == "kill" else (run.job_dir / "ddp_exp.log").read_text())
    assert f"rank      : {rank}" in cause, cause
    assert f"rank      : {1 - rank}" not in cause, cause
    kept = run.job_dir / "errors" / f"rank{rank}.json"
    if fault == "raise":
        assert text.count("injected failure at step 5") == 1, text
        assert "RuntimeError: injected failure at step 5" in cause
        # The table points at a file that outlives the launch (the agent's folder does not).
        assert f"error_file: {kept}" in cause, cause
        assert "injected failure at step 5" in json.loads(kept.read_text())["message"]["message"]
    else:
        assert "SIGKILL" in cause, cause
        assert "error_file: <none" in cause and not kept.exists(), cause
    assert not (run.job_dir / "metrics.json").exists()


@pytest.mark.parametrize(("fault", "rank", "world_size", "line"), [
    ("exit", 0, 1, "rank 0 failed: ExitCalled: sys.exit(0) was called at faulty.py:"),
    ("os_exit", 0, 1, "rank 0 failed: its process ended with exit code 0 before the run did"),
    ("os_exit", 1, 2, "rank 1 failed: its process ended with exit code 0 before the run did")])
def test_a_rank_that_exits_with_code_0_part_way_fails_the_run(run_cli, tmp_path, fault, rank,
                                                              world_size, line):
    """A rank whose code leaves with exit code 0 at step 5 (the user's model, Dataset or an
    argparse in them): ``sys.exit(0)`` was recorded as a completed run, with no training and
    no metrics.json, and ``os._exit(0)`` left the launcher waiting for the rank's result for
    ever (round 4, found while measuring). Now: exit 1, one line naming the rank (and where
    sys.exit was called), status.json "failed", no hang (run_cli's timeout), no process left
    (run_cli checks)."""
    run = run_cli(*faulty_args(tmp_path / "conf", fault=fault, fault_step=5, fault_rank=rank),
                  f"world_size={world_size}", "trainer.epochs=2", "launcher.max_restarts=0",
                  QUIET, env=tests_on_path(), timeout=120)
    text = output(run)
    assert run.returncode == 1, text
    said = [ln for ln in run.stderr.splitlines() if ln.startswith("error: ")]
    assert len(said) == 1 and said[0].startswith(f"error: {line}"), text
    if fault == "exit":
        assert "in forward before the run ended" in said[0], said
    status = json.loads((run.job_dir / "status.json").read_text())
    assert status["status"] == "failed" and status["error"] == said[0][len("error: "):], status
    assert not (run.job_dir / "metrics.json").exists()


@pytest.mark.parametrize(("fault", "line"), [
    ("raise", "rank 1 failed: RuntimeError: injected failure at step 5"),
    ("nan", "rank 1 failed: NonFiniteLossError: non-finite training loss at step 5 "
            "(the earliest on any rank)")])
def test_a_failing_rank_under_torchrun_is_recorded_like_the_launchers(run_cli, tmp_path, fault,
                                                                      line):
    """Under torchrun a rank that raises (or a loss that diverges on every rank at once)
    leaves what the built-in launcher leaves: status.json "failed" naming the rank, its
    errors/rank<R>.json, the traceback in the job log, one line on stderr (once, however many
    ranks raised it) and no rank's own traceback (fresh-user finding: ~250 lines, no record)."""
    run = run_cli(*faulty_args(tmp_path / "conf", fault=fault, fault_step=5, fault_rank=1),
                  "trainer.epochs=2", QUIET, env=tests_on_path(), timeout=120, launcher=TORCHRUN_2)
    text = output(run)
    assert run.returncode == 1, text
    status = json.loads((run.job_dir / "status.json").read_text())
    assert status["status"] == "failed" and line in status["error"], status
    assert [ln for ln in run.stderr.splitlines() if ln.startswith("error: ")] == [
        f"error: {status['error']}"], text
    assert "[rank0]: Traceback" not in text and "[rank1]: Traceback" not in text, text
    errors = sorted(p.name for p in (run.job_dir / "errors").iterdir())
    assert errors and set(errors) <= {"rank0.json", "rank1.json"}, errors
    recorded = json.loads((run.job_dir / "errors" / errors[0]).read_text())["message"]
    assert line.split(": ", 1)[1] in recorded["message"]
    assert "Traceback" in recorded["extraInfo"]["py_callstack"]
    assert "Traceback" in (run.job_dir / "ddp_exp.log").read_text()
    assert not (run.job_dir / "metrics.json").exists()


# ---------------------------------------------------------------------------- 5. NaN loss
@pytest.mark.slow
def test_nan_on_one_rank_stops_all_naming_the_step(run_cli, tmp_path):
    """Must-hold 5: NaN outputs on rank 1 at step 3 (logging every 10 steps): every rank stops,
    non-zero exit, the error names step 3; nobody hangs."""
    run = run_cli(*faulty_args(tmp_path / "conf", fault="nan", fault_step=3),
                  "world_size=2", "trainer.epochs=2", "trainer.log_every_n_steps=10", QUIET,
                  env=tests_on_path(), timeout=120)
    text = output(run)
    assert run.returncode != 0, text
    assert re.search(r"non-finite training loss at step 3\b", text), text
    assert not (run.job_dir / "metrics.json").exists()
    assert not (run.job_dir / "checkpoints").exists()  # stopped inside epoch 1
    # Anticipated, not a bug: one line on the console, the failure table in the job log.
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    # Every rank raises it at the same check, so the first failure torch reports is any rank's.
    assert len(lines) == 1 and re.match(r"error: rank [01] failed: NonFiniteLossError: ",
                                        lines[0]), lines
    assert "Traceback" not in text
    assert "Traceback" in (run.job_dir / "ddp_exp.log").read_text()


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


@pytest.mark.parametrize(("code", "shown"), [
    (0, "sys.exit(0)"), (None, "sys.exit()"), (2, "sys.exit(2)"),
    ("bad input", "sys.exit('bad input')")])
def test_sys_exit_in_a_rank_becomes_a_failure_naming_where_it_was_called(code, shown):
    """Any ``SystemExit`` inside a rank's training (an ``argparse`` in the user's Dataset exits
    with 2) is raised again as ``ExitCalled``: one line, the call's file, line and function."""
    from ddp_exp.rank.failures import ExitCalled, exit_is_a_failure

    def users_code():
        sys.exit(code)

    with pytest.raises(ExitCalled) as caught, exit_is_a_failure():
        users_code()
    line = str(caught.value)
    assert "\n" not in line
    assert line.startswith(f"{shown} was called at test_rank_failures.py:"), line
    assert " in users_code before the run ended" in line, line
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_sys_exit_while_the_launcher_builds_the_run_is_recorded_as_a_failure(tmp_path):
    """``sys.exit(0)`` in a model's or Dataset's ``__init__``, run by the launcher while it
    builds the run: the command ended with exit code 0, no status.json and no line (round 4,
    found while measuring). Now it is the launcher's failure: BuildFailed's one line naming
    where, the folder recorded as failed."""
    from ddp_exp.rank.failures import BuildFailed, build_failure_recorded

    def users_init():
        sys.exit(0)

    with (mock.patch("ddp_exp.rank.failures.task_overrides", return_value=[]),
          mock.patch("ddp_exp.rank.failures.HydraConfig"),
          mock.patch("ddp_exp.rank.failures.jobdir.job_log_file", return_value=None),
          pytest.raises(BuildFailed) as caught, build_failure_recorded(str(tmp_path), True)):
        users_init()
    assert str(caught.value).startswith(
        "the launcher failed before any rank started: ExitCalled: sys.exit(0) was called at "
        "test_rank_failures.py:"), caught.value
    assert " in users_init while the run was being built" in str(caught.value)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "failed" and "sys.exit(0)" in status["error"], status


def test_a_rank_ended_with_code_0_and_no_result_is_named_in_one_line():
    """The launcher's line for the agent's failure of a rank that ended with exit code 0
    before its result (``os._exit(0)``): one line, which says it all (no torch table)."""
    from types import SimpleNamespace

    from ddp_exp.rank.failures import ENDED_WITHOUT_RESULT, world_failure

    failure = SimpleNamespace(exitcode=0, message="To enable traceback see: https://pytorch.org")
    exc = SimpleNamespace(get_first_failure=lambda: (3, failure))
    assert world_failure(exc) == (f"rank 3 failed: {ENDED_WITHOUT_RESULT}", True)
    failure.exitcode = -9  # a signal: torch's table is the report
    line, one_line = world_failure(exc)
    assert not one_line and line == "rank 3 failed: To enable traceback see: https://pytorch.org"


def test_ddps_unused_parameter_error_names_the_config_key():
    """DDP's reducer error for a parameter that took no part in the loss advises a keyword
    argument of DistributedDataParallel and ran past the line's 300 characters; the line
    names ``ddp.find_unused_parameters=true`` (a fresh user's find). Other errors keep
    their first line."""
    from ddp_exp.rank.failures import failure_detail

    torch_text = (
        "RuntimeError: Expected to have finished reduction in the prior iteration before "
        "starting a new one. This error indicates that your module has parameters that were "
        "not used in producing loss. You can enable unused parameter detection by passing the "
        "keyword argument `find_unused_parameters=True` to "
        "`torch.nn.parallel.DistributedDataParallel`, and by\nmaking sure all `forward` "
        "function outputs participate in calculating loss.")
    line = failure_detail(torch_text)
    assert line.startswith("RuntimeError: DDP found parameters of the model that took no part "
                           "in the loss"), line
    assert "set ddp.find_unused_parameters=true" in line and len(line) <= 300
    assert failure_detail("ValueError: bad\nmore") == "ValueError: bad"
