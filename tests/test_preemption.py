"""Issue 30 item 4: a cluster's warning signal (``trainer.preempt_signal``) stops every rank after
the same step, rank 0 writes a step checkpoint, the job exits ``preempted`` (exit 75) and
requeues itself once; the requeued job, same ``SLURM_JOB_ID`` and folder, ends as a run never
stopped.

The CLI test fakes SLURM: ``SLURM_*`` variables and an ``scontrol`` on PATH that records its
arguments. The signal is sent by the run itself (a ``sitecustomize`` written by the test: an
optimizer step hook in rank 0 sends ``SIGUSR1`` to the launcher at a chosen step), so it lands
mid-epoch on any machine, never by a sleep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import QUIET, free_port, tensorboard_series
from omegaconf import OmegaConf

from ddp_exp.config.errors import ConfigError
from ddp_exp.launch import cluster
from ddp_exp.rank import preemption

# Sends $DDP_EXP_TEST_PREEMPT_SIGNAL (SIGUSR1) to the launcher (rank 0's parent) before rank 0's
# step $DDP_EXP_TEST_PREEMPT_AT, noting the time in $DDP_EXP_TEST_MARKER, then holds rank 0 for
# 0.5 s.
SITE = """
import os
_at = int(os.environ.get("DDP_EXP_TEST_PREEMPT_AT", "0"))
if _at:
    import signal, time
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    _seen = [0]

    def _hook(optimizer, args, kwargs):
        if os.environ.get("RANK") != "0":
            return
        _seen[0] += 1
        if _seen[0] == _at:
            with open(os.environ["DDP_EXP_TEST_MARKER"], "w") as fh:
                fh.write(str(time.time()))
            name = os.environ.get("DDP_EXP_TEST_PREEMPT_SIGNAL", "SIGUSR1")
            os.kill(os.getppid(), getattr(signal, name))
            time.sleep(0.5)  # the signal reaches every rank before the next logging check

    register_optimizer_step_pre_hook(_hook)
"""
# scontrol that appends its arguments to $SCONTROL_LOG ("show hostnames X" prints X).
SCONTROL = """#!/bin/sh
echo "$*" >> "$SCONTROL_LOG"
if [ "$1" = show ] && [ "$2" = hostnames ]; then echo "$3"; fi
"""
JOB_ID = "4242"


def fake_scontrol(tmp_path: Path) -> tuple[Path, Path]:
    """A folder holding the recording ``scontrol``, and its record file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "scontrol"
    script.write_text(SCONTROL)
    script.chmod(0o755)
    return bin_dir, tmp_path / "scontrol.log"


def slurm_env(tmp_path: Path) -> dict[str, str]:
    """One SLURM task on one node (``srun --ntasks-per-node=1``), scontrol faked."""
    bin_dir, record = fake_scontrol(tmp_path)
    return {"SLURM_JOB_ID": JOB_ID, "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
            "SLURM_NTASKS": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "localhost",
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SCONTROL_LOG": str(record)}


def requeues(record: Path) -> list[str]:
    lines = record.read_text().splitlines() if record.exists() else []
    return [line for line in lines if line.startswith("requeue")]


# ------------------------------------------------------------------------------ in-process
@pytest.mark.parametrize(("value", "cluster_name", "expected"), [
    ("auto", "slurm", signal.SIGUSR1), ("auto", None, None), ("auto", "submitit", signal.SIGUSR2),
    (None, "slurm", None), ("off", "slurm", None), ("USR1", None, signal.SIGUSR1),
    ("SIGUSR1", None, signal.SIGUSR1), ("usr2", None, signal.SIGUSR2),
    ("TERM", "slurm", signal.SIGTERM), (str(int(signal.SIGHUP)), None, signal.SIGHUP),
])
def test_preempt_signal_values(value, cluster_name, expected, monkeypatch):
    monkeypatch.delenv("SUBMITIT_PREEMPT_SIGNAL", raising=False)
    assert preemption.signal_number(value, cluster_name) == expected


@pytest.mark.parametrize("value", ["KILL", "SIGSTOP", "INT", "USR3", "-1", "sigusr"])
def test_bad_preempt_signal_is_one_line(value):
    with pytest.raises(ConfigError) as info:
        preemption.signal_number(value, "slurm")
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"trainer.preempt_signal={value!r}")
    assert "USR1" in message


def test_preempt_signal_key_composes(compose):
    assert compose().trainer.preempt_signal == "auto"
    assert compose("trainer.preempt_signal=USR2").trainer.preempt_signal == "USR2"


def test_rank_handler_notes_the_request_instead_of_dying():
    before = signal.getsignal(signal.SIGUSR1)
    preemption.reset()
    try:
        preemption.install(signal.SIGUSR1)
        assert not preemption.requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not preemption.requested() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert preemption.requested()
    finally:
        signal.signal(signal.SIGUSR1, before)
        preemption.reset()


# A stand-in for a rank: notes SIGUSR1 in a file, then ends.
RANK_STANDIN = """
import signal, sys, time
def noted(signum, frame):
    open(sys.argv[1], "w").write(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGUSR1, noted)
print("ready", flush=True)
time.sleep(60)
sys.exit(3)
"""


def test_launcher_passes_the_signal_to_its_ranks_and_restores_the_handler(tmp_path):
    """The launcher's handler (SIGUSR1's default would kill it) notes the request and sends
    the signal to each of its ranks; the handler before (submitit's, say) is back after."""
    notes = [tmp_path / f"rank{r}" for r in range(2)]
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_STANDIN, str(n)], text=True,
                              stdout=subprocess.PIPE) for n in notes]
    try:
        for rank in ranks:
            assert rank.stdout.readline().strip() == "ready"
        calls = []
        before = signal.signal(signal.SIGUSR1, lambda s, f: calls.append(s))
        preemption.reset()
        try:
            with preemption.forwarded(signal.SIGUSR1, lambda: [r.pid for r in ranks]) as held:
                os.kill(os.getpid(), signal.SIGUSR1)
                for rank in ranks:
                    assert rank.wait(timeout=30) == 0
                assert held.requested
            assert calls == []  # held: not the handler before
            assert signal.getsignal(signal.SIGUSR1) is not held
            os.kill(os.getpid(), signal.SIGUSR1)  # the handler before is back
            deadline = time.monotonic() + 5
            while not calls and time.monotonic() < deadline:
                time.sleep(0.01)
            assert calls == [signal.SIGUSR1]
        finally:
            signal.signal(signal.SIGUSR1, before)
            preemption.reset()
        assert [n.read_text() for n in notes] == ["SIGUSR1", "SIGUSR1"]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()


def test_torch_agent_leaves_a_preempt_signal_it_would_handle():
    assert preemption.torch_signals(signal.SIGUSR1) == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    assert preemption.torch_signals(None) == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    assert preemption.torch_signals(signal.SIGTERM) == "SIGINT,SIGHUP,SIGQUIT"


def test_a_stopped_rank_makes_the_job_preempted():
    assert preemption.preempted_in({0: {"val/loss": 0.1}, 1: None}) is None
    before = signal.getsignal(signal.SIGUSR1)
    try:
        preemption.install(signal.SIGUSR1)
        stop = preemption.preempted_in({1: preemption.stopped(30, "/j/last.pt"),
                                        0: preemption.stopped(30, "/j/last.pt")})
    finally:
        signal.signal(signal.SIGUSR1, before)
    assert stop.global_step == 30 and stop.signum == signal.SIGUSR1
    assert stop.line == "preempted by SIGUSR1 after step 30: checkpoint /j/last.pt"


def test_a_preempted_folder_or_a_restarted_world_continues_as_resume_auto(tmp_path):
    cfg = OmegaConf.create({"trainer": {"resume": None}})
    assert not preemption.continue_stopped(cfg, str(tmp_path), "completed")
    assert not preemption.continue_stopped(cfg, str(tmp_path), None)
    assert cfg.trainer.resume is None
    assert preemption.continue_stopped(cfg, str(tmp_path), "preempted")
    assert cfg.trainer.resume == "auto"
    restarted = OmegaConf.create({"trainer": {"resume": None}})
    assert preemption.continue_stopped(restarted, str(tmp_path), "failed", restart=1)
    assert restarted.trainer.resume == "auto"
    given = OmegaConf.create({"trainer": {"resume": "/elsewhere/last.pt"}})
    assert not preemption.continue_stopped(given, str(tmp_path), "preempted")
    assert given.trainer.resume == "/elsewhere/last.pt"


def test_slurm_requeue_calls_scontrol_once(tmp_path, monkeypatch):
    for key, value in slurm_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    cfg = OmegaConf.create({"launcher": {"cluster": "slurm"}})
    line = cluster.requeue(cfg, signal.SIGUSR1)
    assert requeues(tmp_path / "scontrol.log") == [f"requeue {JOB_ID}"]
    assert line == f"requeued: scontrol requeue {JOB_ID}"
    assert cluster.requeue(OmegaConf.create({"launcher": {"cluster": None}}),
                           signal.SIGUSR1) is None


def test_submitit_requeue_is_its_own_protocol():
    """Under launcher=slurm the handler submitit installed for its signal (checkpoint the
    submission, ``scontrol requeue``, exit) runs once the world has stopped."""
    calls = []
    before = signal.signal(signal.SIGUSR2, lambda s, f: calls.append(s))
    try:
        cfg = OmegaConf.create({"launcher": {"cluster": "submitit"}})
        cluster.requeue(cfg, signal.SIGUSR2)
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert calls == [signal.SIGUSR2]


# ------------------------------------------------------------------------------------- CLI
RUN = ["world_size=2", "trainer.epochs=2", QUIET]  # conftest's default_run_2_epochs
# digits: 1500 samples / (2 x 32) per step; logging checks at 10, 20, 24 (the epoch's end), 30,
# 40, 48. The signal goes out before step 25 (rank 0 then waits 0.5 s: time for it to reach
# every rank on a loaded machine), its flag rides the check at 30 and settles at 40: mid-epoch 2.
STEPS_PER_EPOCH, LOG_EVERY, SIGNAL_AT = 24, 10, 25


@pytest.mark.float_sensitive
def test_sigusr1_mid_epoch_checkpoints_requeues_once_and_resumes_exactly(
        tmp_path, run_cli, default_run_2_epochs):
    """Must hold (issue 30, preemption): SIGUSR1 to the launcher in the middle of epoch 2 of a
    faked SLURM job: every rank stops within trainer.log_every_n_steps, a step checkpoint,
    status ``preempted``, exit 75, ``scontrol requeue 4242`` once; the same command again (the
    requeued job) continues in the same folder and ends with the uninterrupted run's weights
    and metrics, TensorBoard without a repeated step."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    env = slurm_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    marker = tmp_path / "signalled"
    args = [*RUN, "launcher.cluster=slurm", f"launcher.rdzv_endpoint=127.0.0.1:{free_port()}"]
    job = tmp_path / "outputs" / "runs" / f"slurm-{JOB_ID}"  # the folder from SLURM_JOB_ID

    first = run_cli(*args, run_dir=False, env={**env, "DDP_EXP_TEST_PREEMPT_AT": str(SIGNAL_AT),
                                               "DDP_EXP_TEST_MARKER": str(marker)})
    ended = time.time()
    assert first.returncode == preemption.EXIT_PREEMPTED, f"{first.stdout}\n{first.stderr}"
    assert json.loads((job / "status.json").read_text())["status"] == "preempted"
    assert requeues(tmp_path / "scontrol.log") == [f"requeue {JOB_ID}"]
    state = torch.load(job / "checkpoints" / "last.pt", weights_only=True)
    # Stopped mid-epoch 2 at a logging check: the flags ride the interval's all-reduce, which
    # the loop settles where it starts when a preemption signal is on (train.step_checkpoint),
    # so within one interval of the signal, not at the epoch's end.
    assert SIGNAL_AT <= state["global_step"] <= SIGNAL_AT + LOG_EVERY, state["global_step"]
    assert state["global_step"] % LOG_EVERY == 0
    assert state["global_step"] % STEPS_PER_EPOCH, "stopped at an epoch's end"
    assert ended - float(marker.read_text()) < 30  # not the rest of the run: a step and a save
    assert "preempted by SIGUSR1 after step" in first.stderr
    assert not (job / "metrics.json").exists()

    again = run_cli(*args, run_dir=False, env=env).ok()
    assert "holds a preempted run: continuing it" in again.stdout + again.stderr
    assert json.loads((job / "status.json").read_text())["status"] == "completed"
    assert requeues(tmp_path / "scontrol.log") == [f"requeue {JOB_ID}"]  # not again
    reference = default_run_2_epochs.job_dir
    mine = torch.load(job / "model.pt", weights_only=True)
    theirs = torch.load(reference / "model.pt", weights_only=True)
    for key, value in theirs.items():
        torch.testing.assert_close(mine[key], value, rtol=0, atol=1e-6)
    metrics = json.loads((job / "metrics.json").read_text())
    for key in ("val/loss", "val/accuracy", "train/epoch_loss", "global_step", "epoch"):
        expected = default_run_2_epochs.metrics[key]
        assert metrics[key] == pytest.approx(expected, abs=1e-6), key
    for tag in ("train/loss", "val/loss"):  # as TensorBoard shows it: no step twice
        series, ref = tensorboard_series(job, tag), tensorboard_series(reference, tag)
        assert [s for s, _ in series] == [s for s, _ in ref], tag
        assert [v for _, v in series] == pytest.approx([v for _, v in ref], rel=1e-5), tag


def test_sigterm_as_the_preempt_signal_is_not_an_interrupt(tmp_path, run_cli):
    """trainer.preempt_signal=TERM (a SLURM preemption's SIGTERM before its SIGKILL): the run
    stops at a shared step with a checkpoint, status ``preempted``, exit 75. torch's agent, which
    takes SIGTERM for itself by default (stop every rank: interrupted, exit 143), leaves it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    run = run_cli(*RUN, "trainer.preempt_signal=TERM", env={
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        "DDP_EXP_TEST_PREEMPT_AT": str(SIGNAL_AT), "DDP_EXP_TEST_PREEMPT_SIGNAL": "SIGTERM",
        "DDP_EXP_TEST_MARKER": str(tmp_path / "signalled")})
    assert run.returncode == preemption.EXIT_PREEMPTED, f"{run.stdout}\n{run.stderr}"
    assert "preempted by SIGTERM after step" in run.stderr
    assert json.loads((run.job_dir / "status.json").read_text())["status"] == "preempted"
    state = torch.load(run.job_dir / "checkpoints" / "last.pt", weights_only=True)
    assert SIGNAL_AT <= state["global_step"] <= SIGNAL_AT + 2 * LOG_EVERY, state["global_step"]


def test_world_sizes_are_recorded_in_a_job_folder_without_checkpoints_yet(tmp_path):
    """A resume from another run's checkpoint (``trainer.resume=<path>``) at another world
    size, into a fresh job folder: rank 0 records the sizes before any checkpoint of this
    run exists, so ``checkpoints/`` is not there yet. It failed with FileNotFoundError on the
    temp file; every atomic write now makes its folder."""
    history = preemption.world_sizes(str(tmp_path), 3, {"world_size": 2}, write=True)
    assert history == [2, 3]
    path = tmp_path / "checkpoints" / preemption.WORLDS_FILE
    assert json.loads(path.read_text()) == [2, 3]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.endswith(".tmp")]
