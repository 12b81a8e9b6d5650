"""Faults (issue 4, "What must hold"; cases C12 and C13): exact resume, elastic restarts, a rank
that raises, dies or produces NaN, Ctrl-C / SIGTERM, checkpoint files, bad resume files.

Faults are injected without touching the product: ``tests/faulty.py`` holds ``FaultyMLP``, a
user model plugged in through the public entry (``--config-dir <dir> model=faulty`` with this
folder on ``PYTHONPATH``), which raises, returns NaN or SIGKILLs its own rank at a given step.

Expected values come from elsewhere than the run under test: an uninterrupted run of the plain
``model=mlp``, the checkpoint files themselves, or counts derived from the dataset sizes.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from helpers import (
    QUIET,
    TORCHRUN_2,
    UNREACHABLE,
    Run,
    assert_no_orphans,
    cli_env,
    copy_job,
    faulty_args,
    folder_files,
    load_ckpt,
    refused_before_ranks,
    shared_run,
    start_at_phase,
    start_watched,
    tagged_processes,
    tensorboard_series,
    tests_on_path,
)

TRAIN_N = 1797 - 297  # digits minus the default val_size
STEPS_2 = math.ceil(TRAIN_N / (2 * 32))  # steps per epoch at world_size=2, batch 32: 24
STEPS_3 = math.ceil(TRAIN_N / (3 * 32))  # at world_size=3: 16
# Final metrics that depend on the training alone (not on timing).
COMPARED = ("val/loss", "val/accuracy", "val/num_samples", "train/epoch_loss", "train/num_samples",
            "epoch", "global_step", "steps_per_epoch")


# ------------------------------------------------------------------------------------ helpers
def output(run: Run) -> str:
    return run.stdout + run.stderr


def root_cause(text: str) -> str:
    """The "Root Cause" section of PyTorch's elastic failure table."""
    assert "Root Cause (first observed failure):" in text, text
    section = text.split("Root Cause (first observed failure):", 1)[1]
    return section.split("=" * 20, 1)[0]


def temp_files(folder: Path) -> list[str]:
    """Names in ``folder`` (hidden ones included) that look like temp or partial files."""
    return sorted(n for n in os.listdir(folder) if n.endswith((".tmp", ".partial")) or
                  n.startswith("."))


def assert_same_result(run_dir: Path, ref_dir: Path, tol: float) -> None:
    """metrics.json (training values) and model.pt of ``run_dir`` equal ``ref_dir``'s."""
    import json

    got = json.loads((run_dir / "metrics.json").read_text())
    ref = json.loads((ref_dir / "metrics.json").read_text())
    for key in COMPARED:
        a, b = got[key], ref[key]
        if isinstance(b, float):
            assert a == pytest.approx(b, rel=tol, abs=tol), (key, a, b)
        else:
            assert a == b, (key, a, b)
    p_got = torch.load(run_dir / "model.pt", weights_only=True)
    p_ref = torch.load(ref_dir / "model.pt", weights_only=True)
    assert p_got.keys() == p_ref.keys() and len(p_ref) > 0
    for name in p_ref:
        torch.testing.assert_close(p_got[name], p_ref[name], rtol=0, atol=tol, msg=name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted world_size=2, 4-epoch run of the plain ``model=mlp`` (seed 0); its job
    folder (made once per test session: :func:`helpers.shared_run`). Tests only read it."""
    return shared_run(tmp_path_factory, "world_size=2", "trainer.epochs=4", "seed=0",
                      "model=mlp", QUIET).job_dir


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


# --------------------------------------------------------------------- 1. exact resume
@pytest.mark.slow
@pytest.mark.float_sensitive
def test_run_killed_in_epoch_3_resumes_exactly(run_cli, tmp_path, reference):
    """Must-hold 1: rank 1 SIGKILLed inside epoch 3 of 4 (no restarts), then the same job folder
    rerun with ``trainer.resume=auto``: same final metrics and parameters as a run never
    interrupted."""
    conf = tmp_path / "conf"
    kill_step = 2 * STEPS_2 + STEPS_2 // 2  # step 60: inside epoch 3 (steps 49..72)
    common = ("world_size=2", "trainer.epochs=4", "seed=0", "launcher.max_restarts=0", QUIET)
    killed = run_cli(*faulty_args(conf, fault="kill", fault_step=kill_step,
                                  after_checkpoint=str(tmp_path / "job/checkpoints/last.pt"),
                                  after_epoch=1), *common, job="job", env=tests_on_path())
    assert killed.returncode != 0, output(killed)
    assert "rank      : 1" in root_cause(output(killed))
    assert not (killed.job_dir / "metrics.json").exists()
    last = load_ckpt(killed.job_dir / "checkpoints" / "last.pt")
    assert last["epoch"] == 1  # epochs 0 and 1 (0-based) complete
    assert last["global_step"] == 2 * STEPS_2

    # Same model class (the checkpoint must fit), its fault now unreachable.
    resumed = run_cli(*faulty_args(conf, fault="kill", fault_step=UNREACHABLE), *common,
                      "trainer.resume=auto", job="job", env=tests_on_path()).ok()
    assert re.search(r"resumed from \S*checkpoints/last\.pt", resumed.stdout), resumed.stdout
    assert "epoch 3/4" in resumed.stdout and "epoch 1/4" not in resumed.stdout
    assert_same_result(resumed.job_dir, reference, tol=1e-7)


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_two_epochs_then_resume_auto_to_four_is_exact(run_cli, reference):
    """Must-hold 1, the plain way: trainer.epochs=2, then the same folder with trainer.epochs=4
    trainer.resume=auto."""
    common = ("world_size=2", "seed=0", "model=mlp", QUIET)
    run_cli(*common, "trainer.epochs=2", job="job").ok()
    resumed = run_cli(*common, "trainer.epochs=4", "trainer.resume=auto", job="job").ok()
    assert re.search(r"resumed from \S*checkpoints/last\.pt", resumed.stdout), resumed.stdout
    assert_same_result(resumed.job_dir, reference, tol=1e-7)


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_resumed_run_tensorboard_curves_equal_uninterrupted(run_cli, reference):
    """A resumed job's TensorBoard curves (all its event files, as TensorBoard reads them) show
    the same points as the uninterrupted run's: nothing lost at the resume step, no duplicate
    from the first attempt."""
    common = ("world_size=2", "seed=0", "model=mlp", QUIET)
    run_cli(*common, "trainer.epochs=2", job="job").ok()
    resumed = run_cli(*common, "trainer.epochs=4", "trainer.resume=auto", job="job").ok()
    for tag in ("val/loss", "val/accuracy", "train/loss"):
        got = tensorboard_series(resumed.job_dir, tag)
        ref = tensorboard_series(reference, tag)
        assert [s for s, _ in got] == [s for s, _ in ref], (tag, got, ref)
        assert [v for _, v in got] == pytest.approx([v for _, v in ref], rel=1e-6), tag


# ------------------------------------------------------------------- 2. elastic restart



@pytest.mark.slow
@pytest.mark.parametrize("kill_step", [STEPS_2 + STEPS_2 // 2, STEPS_2 // 2],
                         ids=["mid-epoch-2", "before-first-checkpoint"])
@pytest.mark.float_sensitive
def test_elastic_restart_after_rank_killed(run_cli, tmp_path, reference, kill_step):
    """Must-hold 2: ``launcher.max_restarts=1``, rank 1 SIGKILLed once mid-epoch: the world
    restarts from checkpoints/last.pt (after epoch 1: step 24), or from scratch when no epoch
    had finished, and ends exactly as an uninterrupted run."""
    once = tmp_path / "fired"
    done = kill_step // STEPS_2 * STEPS_2  # the step of the last checkpoint before the kill
    after = ({"after_checkpoint": str(tmp_path / "run/checkpoints/last.pt"),
              "after_epoch": done // STEPS_2 - 1} if done else {})
    run = run_cli(*faulty_args(tmp_path / "conf", fault="kill", fault_step=kill_step,
                               once_file=str(once), **after),
                  "world_size=2", "trainer.epochs=4", "seed=0", "launcher.max_restarts=1",
                  "distributed.timeout_s=30", QUIET,  # a hang ends in 30 s
                  env=tests_on_path()).ok()
    assert once.exists(), "the fault never fired"
    last = re.escape(str(run.job_dir / "checkpoints" / "last.pt"))
    resumed = re.findall(rf"resumed from {last}\b.*step (\d+)\b", run.stdout)
    assert resumed == ([str(done)] if done else []), run.stdout
    # U07: one line in the job log says which restart, which rank failed and from where.
    where = (f"continues from {run.job_dir / 'checkpoints' / 'last.pt'} (epoch "
             f"{done // STEPS_2} done, step {done})" if done
             else "starts again from the beginning (no epoch had finished)")
    expected = ("restart 1 of launcher.max_restarts=1: rank 1 failed (killed by SIGKILL); "
                f"the world {where}")
    log_lines = (run.job_dir / "ddp_exp.log").read_text().splitlines()
    assert [ln for ln in log_lines if "restart 1 of" in ln] == [
        ln for ln in log_lines if ln.endswith(f"[WARNING] - {expected}")], log_lines
    assert sum(ln.endswith(expected) for ln in log_lines) == 1, log_lines
    assert_same_result(run.job_dir, reference, tol=1e-6)


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


@pytest.mark.smoke
def test_ctrl_c_while_the_entry_point_imports_is_one_line(tmp_path):
    """Fresh-user finding: Ctrl-C in the first seconds (torch's import) printed a 16-49 line
    KeyboardInterrupt traceback from inside an import. The signal comes while the entry point
    imports torch (held there: ``phase_site/sitecustomize.py``)."""
    tag, job, marker = uuid.uuid4().hex, tmp_path / "importing", tmp_path / "importing-torch"
    proc = start_at_phase([sys.executable, "-m", "ddp_exp", f"hydra.run.dir={job}"], tmp_path,
                          tag, marker, phase="import")
    try:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert [ln for ln in err.splitlines() if ln.strip()] == ["interrupted (SIGINT)"], err
    assert not job.exists()
    assert_no_orphans(tag)


# ------------------------------------------------------------------------ 4. signals (C12)
SIGNAL_CASES = [
    pytest.param("group", signal.SIGINT, 130, id="sigint-group"),
    pytest.param("pid", signal.SIGINT, 130, id="sigint-pid"),
    pytest.param("pid", signal.SIGTERM, 143, id="sigterm-pid"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("target", "sig", "code"), SIGNAL_CASES)
def test_signal_ends_every_rank_and_leaves_complete_checkpoint(run_cli, tmp_path, target, sig,
                                                               code):
    """C12 / must-hold 4: after epoch 1 of 200 and its checkpoint, SIGINT to the process group
    (Ctrl-C), or SIGINT / SIGTERM to the top PID: exit 130 (143), no hang (30 s), no tagged process,
    last.pt complete, no temp file; the same command can run again at once."""
    tag = uuid.uuid4().hex
    job = tmp_path / "sig"
    cmd = [sys.executable, "-m", "ddp_exp", "backend=gloo", "world_size=2",
           "data.num_workers=2", "trainer.epochs=200", QUIET, f"hydra.run.dir={job}"]
    watched = start_watched(cmd, tmp_path, tag, "epoch 1/200")
    proc, lines, reader = watched.proc, watched.lines, watched.reader
    try:
        assert watched.seen.wait(120), "".join(lines)
        # The epoch line comes before that epoch's checkpoint: wait for the first last.pt, so
        # that a complete one must survive the signal.
        deadline = time.monotonic() + 60
        while not (job / "checkpoints" / "last.pt").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.05)
        if target == "group":
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 30 s after {sig.name}:\n{''.join(lines)}")
        reader.join(10)
        text = "".join(lines)
        assert rc == code, (rc, text)
        assert_no_orphans(tag)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in tagged_processes(tag):  # children of the process started here
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # U07: torch's "Closing process <pid> via signal" lines are not shown on a normal stop.
    assert "Closing process" not in text, text
    ckpts = job / "checkpoints"
    state = load_ckpt(ckpts / "last.pt")
    assert state["epoch"] >= 0 and state["global_step"] == (state["epoch"] + 1) * STEPS_2
    assert temp_files(ckpts) == [], os.listdir(ckpts)
    # best.pt (trainer.monitor, val/loss by default): a second name of a new best epoch's file.
    assert sorted(os.listdir(ckpts)) == ["best.pt", "last.pt"]

    again = run_cli("backend=gloo", "world_size=2", "trainer.epochs=1", QUIET, job="again",
                    timeout=120).ok()
    assert "epoch 1/1" in again.stdout



@pytest.mark.slow
@pytest.mark.parametrize(("target", "sig", "code"), [SIGNAL_CASES[0], SIGNAL_CASES[2]])
def test_signal_during_checkpoint_write_leaves_no_partial_file(tmp_path, target, sig, code):
    """C12 "no half-written checkpoint is left": once epoch 1's last.pt exists, the signal is
    sent the moment the next temp file appears in checkpoints/ (a large model makes the write
    last); afterwards last.pt is complete, holds epoch 1 or 2 (the previous file or the new
    one), and no temp file remains."""
    tag = uuid.uuid4().hex
    job = tmp_path / "sig"
    ckpts = job / "checkpoints"
    cmd = [sys.executable, "-m", "ddp_exp", "backend=gloo", "world_size=2", "trainer.epochs=200",
           "data.val_size=1600", "model.hidden_sizes=[2048,2048]", QUIET,
           f"hydra.run.dir={job}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(tag), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        seen = []
        while not seen:
            assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint write"
            try:
                names = os.listdir(ckpts)
            except FileNotFoundError:
                names = []
            if "last.pt" in names:  # epoch 1's complete file: the next write is epoch 2's
                seen = [n for n in names if n.endswith(".tmp")]
            time.sleep(0.001)
        (os.killpg if target == "group" else os.kill)(proc.pid, sig)
        assert proc.wait(timeout=30) == code
        assert_no_orphans(tag)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    state = load_ckpt(ckpts / "last.pt")
    steps = math.ceil((1797 - 1600) / (2 * 32))  # 197 training samples, global batch 64
    assert state["epoch"] in (0, 1) and state["global_step"] == (state["epoch"] + 1) * steps
    assert temp_files(ckpts) == [], [(n, (ckpts / n).stat().st_size) for n in os.listdir(ckpts)]


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


# ---------------------------------------------------------------- 6. checkpoint files (C13)
@pytest.mark.slow
@pytest.mark.parametrize("keep", [None, 2])
def test_three_ranks_write_one_complete_checkpoint_per_epoch(run_cli, keep):
    """C13: world_size=3, 3 epochs, a checkpoint every epoch: exactly epoch_0000..0002.pt plus
    last.pt (and best.pt), each loadable with weights_only=True and recording its epoch; no temp
    files. With keep_checkpoints=2 only the newest two epoch files stay."""
    extra = [f"trainer.keep_checkpoints={keep}"] if keep else []
    run = run_cli("world_size=3", "trainer.epochs=3", "trainer.checkpoint_every_n_epochs=1",
                  *extra, QUIET, timeout=240).ok()
    folder = run.job_dir / "checkpoints"
    epochs = [0, 1, 2] if keep is None else [1, 2]
    names = [f"epoch_{e:04d}.pt" for e in epochs]
    # best.pt: the best epoch's weights of trainer.monitor (val/loss by default), not an epoch
    # checkpoint.
    assert sorted(os.listdir(folder)) == sorted(names + ["last.pt", "best.pt"])
    assert temp_files(folder) == []
    assert load_ckpt(folder / "best.pt")["epoch"] in (0, 1, 2)
    for e, name in zip(epochs, names, strict=True):
        state = load_ckpt(folder / name)
        assert state["epoch"] == e, name
        assert state["global_step"] == (e + 1) * STEPS_3, name
    last = load_ckpt(folder / "last.pt")
    assert last["epoch"] == 2
    final = torch.load(run.job_dir / "model.pt", weights_only=True)
    assert last["model"].keys() == final.keys()
    for name in final:
        assert torch.equal(last["model"][name], final[name]), name


# ------------------------------------------------------------- 7. bad trainer.resume files
def _garbage(path: Path) -> None:
    path.write_bytes(b"\x00not a checkpoint\xff" * 64)


def _foreign(path: Path) -> None:
    torch.save({"a": 1}, path)


def _truncated(path: Path) -> None:
    torch.save({"a": torch.zeros(1000)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _objects(path: Path) -> None:
    import argparse

    torch.save({"format": 1, "args": argparse.Namespace(lr=0.1)}, path)


TRUNCATED = "cannot load it as a checkpoint: not a complete torch.save file: truncated or corrupt"


@pytest.mark.parametrize(("make", "why"), [
    (_garbage, TRUNCATED), (_foreign, "not a ddp_exp checkpoint"), (_truncated, TRUNCATED),
    (_objects, "cannot load it as a checkpoint: it holds a Python object (argparse.Namespace) "
               "that is not a tensor or a plain container; files are loaded with "
               "weights_only=True, so that loading one runs no code"),
    (None, "no such checkpoint file")],
    ids=["garbage", "foreign", "truncated", "objects", "missing"])
def test_bad_resume_file_is_refused_before_any_rank_naming_it(compose, tmp_path, make, why):
    """A corrupt, foreign, truncated or missing ``trainer.resume=PATH`` is refused by the
    steps the CLI runs before any rank (in-process): one line naming trainer.resume, the path
    and what is wrong with it, nothing written. (The CLI's exit and line: the test below.)"""
    path = tmp_path / "bad.pt"
    if make is not None:
        make(path)
    message = refused_before_ranks(compose("world_size=2", f"trainer.resume={path}", QUIET),
                                   tmp_path / "run")
    assert message.startswith(f"trainer.resume={str(path)!r}: {why}"), message
    assert "\n" not in message and "\x1b" not in message, message  # torch's text: 8 lines


def test_bad_resume_file_is_one_line_error_before_any_rank(run_cli, tmp_path):
    """A corrupt ``trainer.resume=PATH`` through the CLI: non-zero exit before any rank starts,
    a one-line error naming trainer.resume and the path, no traceback, no rank started (no
    tensorboard/). (Every kind of bad file in-process, above.)"""
    path = tmp_path / "bad.pt"
    _garbage(path)
    run = run_cli("world_size=2", f"trainer.resume={path}", QUIET, timeout=60)
    assert run.returncode != 0, output(run)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, run.stderr  # one line, no traceback or warning
    assert "trainer.resume" in lines[0] and str(path) in lines[0], lines
    assert "Traceback" not in output(run)
    for produced in ("tensorboard", "checkpoints", "metrics.json", "model.pt"):
        assert not (run.job_dir / produced).exists(), produced


def test_resuming_a_finished_run_changes_nothing(run_cli, tmp_path, default_run_1_epoch):
    """Regression: resume=auto on a run that trained all its epochs rewrote its metrics.json
    (train/loss null) and status.json, and added a duplicate TensorBoard point."""
    job = copy_job(default_run_1_epoch, tmp_path)  # trainer.epochs=1, finished
    before = {p.name: p.read_bytes() for p in job.iterdir() if p.is_file()}
    record = {p.name: p.read_bytes() for p in (job / ".hydra").iterdir()}
    events = sorted((job / "tensorboard").iterdir())
    again = run_cli("trainer.epochs=1", "trainer.resume=auto", "optim.lr=0.5",
                    "print_config=false")
    assert again.returncode == 0 and "nothing left to train" in again.stderr  # says so
    assert "error" not in again.stderr
    after = {p.name: p.read_bytes() for p in job.iterdir() if p.is_file()}
    for name in ("metrics.json", "status.json", "model.pt"):
        assert after[name] == before[name], name
    # Hydra rewrote .hydra/ before the refusal; the record of what trained here is back.
    assert {p.name: p.read_bytes() for p in (job / ".hydra").iterdir()} == record
    assert sorted((job / "tensorboard").iterdir()) == events


def test_a_fresh_run_into_a_finished_folder_is_refused(run_cli, tmp_path,
                                                       default_run_1_epoch):
    """Regression: the same hydra.run.dir without trainer.resume retrained from scratch,
    overwrote the run's files and left two event streams plotting the same steps twice."""
    job = copy_job(default_run_1_epoch, tmp_path)  # trainer.epochs=1, finished
    before = folder_files(job)
    again = run_cli("trainer.epochs=1", "optim.lr=0.5", "print_config=false")
    assert again.returncode == 2
    lines = [ln for ln in again.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "trainer.resume=auto" in lines[0], again.stderr
    assert "metrics.json" in lines[0] and "tensorboard/" in lines[0]
    assert folder_files(job) == before  # every file, .hydra/ included, as the first run left it


def test_a_second_run_into_a_busy_job_folder_is_refused(run_cli, tmp_path):
    """Regression: two runs given the same hydra.run.dir both ran and mixed their event
    streams, checkpoints and metrics in one folder."""
    job = tmp_path / "run"
    tag = uuid.uuid4().hex
    first = subprocess.Popen([sys.executable, "-m", "ddp_exp", "trainer.epochs=100000",
                              "print_config=false", f"hydra.run.dir={job}"], cwd=tmp_path,
                             env=cli_env(tag), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (job / "tensorboard").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        record = {p.name: p.read_bytes() for p in (job / ".hydra").iterdir()}
        second = run_cli("trainer.epochs=1", "model=cnn")
        assert second.returncode == 2
        assert "in use by another running job" in second.stderr
        assert len(list((job / "tensorboard").iterdir())) == 1
        # The refused run's Hydra rewrote .hydra/ (trainer.epochs=1, model=cnn); put back.
        assert {p.name: p.read_bytes() for p in (job / ".hydra").iterdir()} == record
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=30)
    assert_no_orphans(tag)
    assert json.loads((job / "status.json").read_text())["status"] == "interrupted"


def test_single_node_ranks_never_resolve_host_names(run_cli, tmp_path):
    """Regression for a start-up hang: a rank forked while another thread of the launcher held
    glibc's resolver lock blocked for ever in getaddrinfo("localhost"). On one node every rank
    must get a numeric MASTER_ADDR and a named gloo interface (no name lookup at all)."""
    import ipaddress

    import yaml

    probe = tmp_path / "probe"
    probe.mkdir()
    conf = tmp_path / "conf" / "model"
    conf.mkdir(parents=True)
    (conf / "probe.yaml").write_text(yaml.safe_dump(
        {"_target_": "faulty.EnvProbeMLP", "probe_dir": str(probe)}))
    run_cli("--config-dir", str(tmp_path / "conf"), "model=probe", "world_size=3",
            "trainer.epochs=1", "print_config=false",
            env={"PYTHONPATH": str(Path(__file__).parent)}).ok()
    envs = [json.loads((probe / f"rank{r}.json").read_text()) for r in range(3)]
    for env in envs:
        assert ipaddress.ip_address(env["MASTER_ADDR"]).is_loopback, env
        assert env["GLOO_SOCKET_IFNAME"], env


def test_config_error_in_a_used_folder_keeps_its_record(run_cli, tmp_path,
                                                        default_run_1_epoch):
    """Regression: a typo rerun into a finished folder rewrote its status.json ("failed",
    with the typo) and .hydra/, next to the first run's weights and metrics."""
    job = copy_job(default_run_1_epoch, tmp_path)  # trainer.epochs=1, finished
    kept = folder_files(job)
    typo = run_cli("trainer.epochs=2", "trainer.resume=auto", "optim.lr=-1")
    assert typo.returncode == 2 and "optim.lr" in typo.stderr
    assert folder_files(job) == kept


def test_resume_auto_without_a_checkpoint_in_a_used_folder_is_refused(run_cli):
    """Regression: resume=auto found no last.pt and silently trained from step 0 beside the
    earlier run's event stream."""
    run_cli("trainer.epochs=1", "trainer.save_last=false", "print_config=false").ok()
    again = run_cli("trainer.epochs=2", "trainer.resume=auto", "print_config=false")
    assert again.returncode == 2
    assert "finds no checkpoints/last.pt" in again.stderr, again.stderr
    assert len(list((again.job_dir / "tensorboard").iterdir())) == 1


def test_a_resumed_run_that_completes_clears_earlier_errors(run_cli, tmp_path,
                                                            default_run_1_epoch):
    """Regression: errors/rankN.json of a failed attempt stayed beside a completed resume."""
    job = copy_job(default_run_1_epoch, tmp_path)  # trainer.epochs=1, finished
    (job / "errors").mkdir()
    (job / "errors" / "rank1.json").write_text("{}")
    run_cli("trainer.epochs=2", "trainer.resume=auto", "print_config=false").ok()
    assert not (job / "errors").exists()


def test_resume_with_another_optimizer_fails_before_the_ranks(run_cli, tmp_path,
                                                              default_run_1_epoch):
    """Regression: optim=adamw on an SGD checkpoint started the ranks, which failed with the
    whole failure table; it is one line from the launcher now, the folder untouched."""
    job = copy_job(default_run_1_epoch, tmp_path)  # trainer.epochs=1 of optim=sgd, finished
    status = (job / "status.json").read_bytes()
    run = run_cli("trainer.epochs=2", "trainer.resume=auto", "optim=adamw")
    assert run.returncode == 2
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "optimizer state does not fit optim" in lines[0], run.stderr
    assert "torch.optim.AdamW" in lines[0] and "Root Cause" not in run.stdout + run.stderr
    assert (job / "status.json").read_bytes() == status


def _split_refusal(key: str, value: str, before: object) -> str:
    return (f"{key}={value} differs from the checkpoint's {key}={before} "
            "(trainer.resume=auto): another split would move samples between training, "
            f"validation and test; resume with {key}={before}, or add "
            "trainer.resume_allow_changes=true to accept it")


def test_resume_with_another_split_is_refused_unless_forced(run_cli, tmp_path,
                                                            default_run_1_epoch):
    """U05: resuming with another seed would move training samples into validation: one line
    naming the key, exit 2, the folder unchanged; trainer.resume_allow_changes=true forces it
    and the run continues at epoch 2. (Every split key, in-process: the test below.)"""
    job = copy_job(default_run_1_epoch, tmp_path)  # trainer.epochs=1 of seed=0, finished
    kept = folder_files(job)
    run = run_cli("trainer.epochs=2", "trainer.resume=auto", "seed=1", QUIET)
    assert run.returncode == 2, run.stderr
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert lines == [f"error: {_split_refusal('seed', '1', 0)}"], run.stderr
    assert folder_files(job) == kept
    forced = run_cli("trainer.epochs=2", "trainer.resume=auto", "seed=1",
                     "trainer.resume_allow_changes=true", QUIET).ok()
    assert "epoch 2/2" in forced.stdout and "epoch 1/2" not in forced.stdout
    assert "seed=1 differs from the checkpoint's seed=0 " \
           "(trainer.resume_allow_changes=true)" in forced.stdout


@pytest.mark.parametrize("change", ["seed=1", "data.val_size=300"])
def test_a_changed_split_is_refused_before_the_ranks_unless_forced(compose, tmp_path,
                                                                   default_run_1_epoch, caplog,
                                                                   change):
    """U05 for each split key, by the steps the CLI runs before any rank (in-process): resuming
    with another seed or data.val_size is refused with one line naming the key, the used folder
    unchanged; with trainer.resume_allow_changes=true the same steps accept it and warn."""
    from ddp_exp.launch import elastic as launch

    job = copy_job(default_run_1_epoch, tmp_path)  # trainer.epochs=1 of seed=0, val_size=297
    key, value = change.split("=")
    before = {"seed": 0, "data.val_size": 297}[key]
    overrides = ("trainer.epochs=2", "trainer.resume=auto", change, QUIET)
    assert refused_before_ranks(compose(*overrides), job) == _split_refusal(key, value, before)
    kept = folder_files(job)
    with caplog.at_level("WARNING", logger="ddp_exp"):
        launch.prepare_world(compose(*overrides, "trainer.resume_allow_changes=true"), str(job))
    assert f"{key}={value} differs from the checkpoint's {key}={before} " \
           "(trainer.resume_allow_changes=true)" in caplog.text
    assert folder_files(job) == kept


def test_a_resume_value_that_is_no_file_names_the_valid_values(compose, tmp_path):
    """``trainer.resume=yes`` said only "'.../yes': no such checkpoint file" (a fresh user):
    the line now also says what the key takes."""
    message = refused_before_ranks(compose("world_size=2", "trainer.resume=yes", QUIET),
                                   tmp_path / "run")
    assert "no such checkpoint file; trainer.resume takes auto" in message, message
    assert "null, or a checkpoint file's path" in message and "\n" not in message
