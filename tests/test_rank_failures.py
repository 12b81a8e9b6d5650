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
import time
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


# ---------------------------------------------------------------------- 6. a rank that stalls
@pytest.mark.slow
def test_a_stalled_rank_is_named_where_it_stalled_by_the_line_of_its_peers_timeout(run_cli,
                                                                                  tmp_path):
    """Rank 1 of 3 stalls in the user's model at step 3 (``time.sleep``): its peers' next
    collective times out after ``distributed.timeout_s`` and the first of them is reported.
    The line named only that rank and gloo's "Timed out waiting ... for recv" (round 4: the
    rank that waited, not the one it waited for). Now it also says where the ranks still
    running were, from their stacks, taken before the launcher stopped them: rank 1 in the
    user's ``forward``; its threads' stacks are kept in ``errors/rank1.stacks.txt``. Exit 1,
    status.json "failed" with the same line, no process left (run_cli checks)."""
    run = run_cli(*faulty_args(tmp_path / "conf", fault="stall", fault_step=3, fault_rank=1),
                  "world_size=3", "trainer.epochs=1", "launcher.max_restarts=0",
                  "distributed.timeout_s=4", QUIET, env=tests_on_path(), timeout=120)
    text = output(run)
    assert run.returncode == 1, text
    said = [ln[len("error: "):] for ln in run.stderr.splitlines() if ln.startswith("error: ")]
    assert len(said) == 1, text
    line = said[0]
    assert re.match(r"rank [02] failed: RuntimeError: Timed out waiting 4000ms for (recv|send) "
                    r"operation to complete \(the limit is distributed.timeout_s\); ", line), line
    kept = run.job_dir / "errors" / "rank1.stacks.txt"
    assert "rank 1 was still running, at faulty.py:" in line, line
    assert f" in forward (its threads' stacks: {kept})" in line, line
    assert "in forward" in kept.read_text() and "time.sleep" not in line
    status = json.loads((run.job_dir / "status.json").read_text())
    assert status["status"] == "failed" and status["error"] == line, status


STALLS = '''import sys, time
from ddp_exp.rank import stacks
stacks.listen()
def stalled_here():
    print("ready", flush=True); time.sleep(60)
def train_rank():  # as a rank's training thread is named
    stalled_here()
train_rank()
'''


def _stalled_process(tmp_path: Path, listen: bool = True):
    import subprocess

    script = tmp_path / "stalls.py"
    script.write_text(STALLS if listen else STALLS.replace("stacks.listen()", ""))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_a_running_ranks_stacks_are_read_from_its_process_and_name_where_it_is(tmp_path):
    """:mod:`ddp_exp.rank.stacks`: a process that listens (faulthandler on the real-time
    signal, into its in-memory file) gives every thread's stack on request, read by another
    process through /proc; :func:`where` names its innermost frame outside torch, the standard
    library and ddp_exp. A process that does not listen is left out; a stopped one gives
    none within the wait, and the note says so (an earlier request's text is not read
    again)."""
    import signal

    from ddp_exp.rank import stacks

    proc = _stalled_process(tmp_path)
    deaf = _stalled_process(tmp_path, listen=False)
    try:
        taken = stacks.take({0: proc.pid, 1: deaf.pid}, wait_s=5)
        assert list(taken) == [0], taken  # the one that does not listen is left out
        assert 'stalls.py", line 5 in stalled_here' in taken[0], taken[0]
        assert stacks.where(taken[0], stacks._library_dirs()) == "stalls.py:5 in stalled_here"
        note = stacks.keep(str(tmp_path / "job"), first_rank=4)
        kept = tmp_path / "job" / "errors" / "rank4.stacks.txt"
        assert note == f"rank 4 was still running, at stalls.py:5 in stalled_here " \
                       f"(its threads' stacks: {kept})"
        assert kept.read_text() == taken[0]
        # Stopped (kill -STOP): it cannot answer; it is continued, so that the world's stop
        # ends it at once (torch's SIGTERM waited 30 s for a stopped rank: a fresh user's find)
        os.kill(proc.pid, signal.SIGSTOP)
        while not stacks._stopped(proc.pid):
            time.sleep(0.01)
        assert stacks.take({0: proc.pid}, wait_s=5) == {0: stacks.STOPPED}
        assert stacks.keep(str(tmp_path / "job"), first_rank=None) == (
            "local rank 0 was stopped (SIGSTOP, Ctrl-Z): it gave no stacks")
        assert stacks.keep(str(tmp_path / "job"), first_rank=0) == ""  # kept once
        for _ in range(500):  # continued
            if not stacks._stopped(proc.pid):
                break
            time.sleep(0.01)
        assert not stacks._stopped(proc.pid)
        # A rank no longer in its training (failing too, or ending) is left out of the note.
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        stacks._taken.update({3: taken[0].replace("train_rank", "run_rank")})
        assert stacks.keep(str(tmp_path / "job"), first_rank=0) == ""
    finally:
        for p in (proc, deaf):
            p.kill()
            p.wait()


def test_where_names_the_main_threads_innermost_frame_of_the_users_code():
    """:func:`ddp_exp.rank.stacks.where` on faulthandler's text: the thread that runs the rank
    (``run_rank`` in it), not the thread the signal landed on; its innermost frame outside
    the libraries and ddp_exp; ddp_exp's own where the rank waits inside torch (a collective),
    with that frame; None for a text with no frame."""
    from ddp_exp.rank.stacks import where

    text = """Thread 0x00007f01 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/site/torch/utils/data/_utils/pin_memory.py", line 50 in _pin_memory_loop

Current thread 0x00007f02 (most recent call first):
  File "/home/me/net.py", line 9 in forward
  File "/site/torch/nn/modules/module.py", line 1789 in _call_impl
  File "/src/ddp_exp/train/steps.py", line 78 in train_step
  File "/src/ddp_exp/rank/worker.py", line 278 in run_rank
"""
    libs = ("/usr/lib/python3.11/", "/site/torch/")
    assert where(text, libs) == "net.py:9 in forward"
    waiting = text.replace('  File "/home/me/net.py", line 9 in forward\n', "").replace(
        "module.py\", line 1789 in _call_impl", "distributed_c10d.py\", line 2950 in all_reduce")
    assert where(waiting, libs) == (
        "steps.py:78 in train_step (inside distributed_c10d.py:2950 in all_reduce)")
    assert where("Stack (most recent call first):\n", libs) is None
    # A fresh user's finds: a rank waiting for its DataLoader worker named Hydra's run_job
    # (an installed library's frame, outside the user's code), a spawned rank "<string>", and
    # under torchrun a background thread listed first ("threading.py:327 in wait").
    worker = """Thread 0x00007f03 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait
  File "/site/tensorboard/summary/writer/event_file_writer.py", line 240 in run

Stack (most recent call first):
  File "/site/torch/utils/data/dataloader.py", line 1284 in _try_get_data
  File "/src/ddp_exp/data/loaders.py", line 181 in __iter__
  File "/src/ddp_exp/rank/worker.py", line 172 in train_rank
  File "/src/ddp_exp/launch/torchrun.py", line 95 in run_under_torchrun
  File "/site/hydra/core/utils.py", line 189 in run_job
  File "<string>", line 1 in <module>
"""
    libs = ("/usr/lib/python3.11/", "/site/")
    assert where(worker, libs) == (
        "loaders.py:181 in __iter__ (inside dataloader.py:1284 in _try_get_data)")
    # The rank's DataLoader worker's stacks follow its own (rank.stacks.take): the user's
    # Dataset line where the worker is.
    child = """
--- child process 4242 (a DataLoader worker), its stacks:
Current thread 0x00007f04 (most recent call first):
  File "/home/me/stallds.py", line 16 in __getitem__
  File "/site/torch/utils/data/_utils/worker.py", line 349 in _worker_loop
  File "/src/ddp_exp/rank/worker.py", line 172 in train_rank
"""
    assert where(worker.replace("/site/", "/x/site-packages/") + child,
                 ("/usr/lib/python3.11/", "/x/site-packages/")) == (
        "loaders.py:181 in __iter__ (inside dataloader.py:1284 in _try_get_data), its "
        "DataLoader worker at stallds.py:16 in __getitem__")


def test_a_collectives_timeout_names_its_limit_and_the_ranks_still_running():
    """gloo's timeout line loses the C++ source path of torch's build machine and names the
    key of its limit, ``distributed.timeout_s``; the launcher's line ends with the note of the
    ranks still running (:func:`ddp_exp.rank.stacks.keep`), when it took their stacks."""
    from types import SimpleNamespace

    from ddp_exp.rank.failures import failure_detail, world_failure

    gloo = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
            "unbound_buffer.cc:78] Timed out waiting 8000ms for recv operation to complete")
    assert failure_detail(gloo) == ("RuntimeError: Timed out waiting 8000ms for recv operation "
                                    "to complete (the limit is distributed.timeout_s)")
    closed = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
              "pair.cc:534] Connection closed by peer [127.0.0.1]:4567")
    assert failure_detail(closed) == "RuntimeError: Connection closed by peer [127.0.0.1]:4567"
    failure = SimpleNamespace(exitcode=1, message={"message": gloo})
    exc = SimpleNamespace(get_first_failure=lambda: (0, failure))
    assert world_failure(exc)[0].endswith("(the limit is distributed.timeout_s)")
    exc.ddp_exp_stacks_note = "rank 1 was still running, at net.py:9 in forward (...)"
    assert world_failure(exc) == (
        "rank 0 failed: " + failure_detail(gloo) + "; rank 1 was still running, at net.py:9 "
        "in forward (...)", True)


@pytest.mark.slow
def test_under_torchrun_the_timed_out_rank_names_where_its_node_peers_were(run_cli, tmp_path,
                                                                          monkeypatch):
    """Under torchrun the launcher is not ddp_exp's: the rank whose collective timed out asks
    this node's other ranks (its siblings under torchrun's agent) for their stacks itself,
    before it records the failure: the line names rank 1, stalled in the user's ``forward``,
    and keeps its stacks in ``errors/rank1.stacks.txt``. Real processes: ranks forked from the
    tests' pre-imported server are not torchrun's children (``tests/zygote.py``)."""
    monkeypatch.setenv("DDP_EXP_TEST_NO_ZYGOTE", "1")
    run = run_cli(*faulty_args(tmp_path / "conf", fault="stall", fault_step=3, fault_rank=1),
                  "trainer.epochs=1", "distributed.timeout_s=4", QUIET, env=tests_on_path(),
                  timeout=120, launcher=TORCHRUN_2)
    text = output(run)
    assert run.returncode == 1, text
    status = json.loads((run.job_dir / "status.json").read_text())
    line = status["error"]
    kept = run.job_dir / "errors" / "rank1.stacks.txt"
    assert re.match(r"rank 0 failed: RuntimeError: Timed out waiting 4000ms for (recv|send) "
                    r"operation to complete \(the limit is distributed.timeout_s\); rank 1 was "
                    r"still running, at faulty.py:\d+ in forward \(its threads' stacks: "
                    + re.escape(str(kept)) + r"\)$", line), line
    assert "in forward" in kept.read_text()
    assert [ln for ln in run.stderr.splitlines() if ln.startswith("error: ")] == [
        f"error: {line}"], text
