"""The helpers tests share (fixtures and hooks are conftest.py's): run the real CLI in a
subprocess, read its outputs, check for orphans; compose and refuse a config in-process as the
CLI does before any rank starts; the session's shared runs; small helpers of several modules.
Tests import them from here (``from helpers import run_tagged``); no test module imports
another."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

CASE_TAG = "DDP_EXP_CASE_TAG"
TESTS = Path(__file__).resolve().parent


@dataclass
class Run:
    """A finished ``python -m ddp_exp`` invocation."""

    returncode: int
    stdout: str
    stderr: str
    job_dir: Path
    seconds: float

    @property
    def metrics(self) -> dict:
        return json.loads((self.job_dir / "metrics.json").read_text())

    def ok(self) -> Run:
        assert self.returncode == 0, f"exit {self.returncode}\n{self.stdout}\n{self.stderr}"
        return self


# How long a CLI run, or its wait for a point of its run, may take before a test calls it hung
# and fails with its processes' stacks: a hang detector, not a speed check. A run takes 1-10 s on
# a quiet machine and has taken 30x that on 2 cores shared by eight test suites; a test's own
# smaller limit is raised to this one (run_cli, run_once, run_sweep, start_at_phase).
HANG_S = 300.0

# The override that keeps a CLI run's output short: no printout of the resolved config.
QUIET = "print_config=false"
# torchrun on one node with two ranks, starting ddp_exp (run_cli's ``launcher=``).
TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc_per_node=2", "-m", "ddp_exp"]



def rel_close(a: float, b: float, rel: float) -> bool:
    """``a`` and ``b`` agree to ``rel``, relative to the larger of the two."""
    return abs(a - b) <= rel * max(abs(a), abs(b))


def tests_on_path() -> dict[str, str]:
    """A CLI run's PYTHONPATH with this folder first (so that ``faulty``, ``lazy_data`` and the
    other test modules import as a user's code would), the rest of it kept."""
    parts = [str(TESTS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(parts)}


tests_on_path.__test__ = False  # a helper, not a test, in every module that imports it


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Holds the sitecustomize.py that marks phases inside ddp_exp's own code (its imports, the forks).
PHASE_SITE = TESTS / "phase_site"


def start_at_phase(cmd: list[str], cwd: Path, tag: str, marker: Path, phase: str | None = None,
                   **popen) -> subprocess.Popen:
    """Start ``cmd`` tagged ``tag`` (stdin closed, stdout and stderr piped unless ``popen`` says
    otherwise, SIGINT as a terminal gives it) with tests/ and :data:`PHASE_SITE` on PYTHONPATH,
    and return it once it has touched ``marker``: at ``phase`` of ddp_exp's own code
    (``phase_site/sitecustomize.py``: ``import``, ``fork``), or where test code plugged into the
    run touches it (``phases.slow_digits``, ``hydra_hooks.SlowJobStart``); the child waits
    there. Fails the test with the child's output if it ends first or takes :data:`HANG_S`."""
    path = os.pathsep.join([str(PHASE_SITE), str(TESTS), os.environ.get("PYTHONPATH", "")])
    env = cli_env(tag, PYTHONPATH=path, DDP_EXP_TEST_MARKER=str(marker),
                  **({"DDP_EXP_TEST_PHASE": phase} if phase else {}))
    options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True,
               "stdin": subprocess.DEVNULL, **popen}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, **options)
    deadline = time.monotonic() + HANG_S
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            for pid in [proc.pid, *tagged_processes(tag)]:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"no {marker.name} from {' '.join(cmd)}:\n{out[-3000:]}\n"
                        f"{(err or '')[-3000:]}")
        time.sleep(0.02)
    return proc


@dataclass
class Watched:
    """A ``python -m ddp_exp`` started in its own session (so a test can signal its whole
    process group) whose stdout a thread collects line by line."""

    proc: subprocess.Popen
    lines: list[str]
    seen: threading.Event  # set once a line contains the awaited text
    reader: threading.Thread

    @property
    def text(self) -> str:
        return "".join(self.lines)


def start_watched(cmd: list[str], cwd: Path, tag: str, awaited: str,
                  stderr: int = subprocess.STDOUT, preexec_fn=None) -> Watched:
    """Start ``cmd`` tagged with ``tag`` (see :func:`cli_env`), stdin closed, and read its
    stdout in a thread that sets ``seen`` at the first line containing ``awaited``
    (``preexec_fn``: run in the child before its exec, as :class:`subprocess.Popen` does)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=cli_env(tag), stdout=subprocess.PIPE,
                            stderr=stderr, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True, preexec_fn=preexec_fn)
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if awaited in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return Watched(proc, lines, seen, reader)

def tagged_processes(tag: str) -> list[int]:
    """PIDs whose environment carries ``DDP_EXP_CASE_TAG=tag``."""
    needle = f"{CASE_TAG}={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def assert_no_orphans(tag: str, grace_s: float = 5.0) -> None:
    deadline = time.monotonic() + grace_s
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tagged_processes(tag) == [], f"processes left behind: {tagged_processes(tag)}"


def cli_env(tag: str, **extra: str) -> dict[str, str]:
    """This process's environment for a CLI run tagged ``tag``, without a rank's variables;
    Python's fault handler on, so that :func:`run_tagged` can have a hung run's processes
    print their stacks."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.pop("HYDRA_FULL_ERROR", None)
    env[CASE_TAG] = tag
    env["PYTHONFAULTHANDLER"] = "1"
    env.update(extra)
    return env


def start_cli(cmd: list[str], cwd: Path, env: dict[str, str]):
    """``cmd`` started with ``env`` in ``cwd``, stdin closed, stdout and stderr piped as text:
    forked from this test process's pre-imported ``python -m ddp_exp`` (:mod:`zygote`: the same
    output and exit status without the seconds of start-up) where ``cmd`` is
    ``python -m ddp_exp ...`` and nothing read at start-up differs, else a real process
    (always with ``DDP_EXP_TEST_NO_ZYGOTE=1``). A :class:`subprocess.Popen` or its stand-in."""
    import zygote

    return zygote.popen(cmd, cwd, env) or subprocess.Popen(
        cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL)


def run_tagged(cmd: list[str], cwd: Path, tag: str, timeout: float,
               env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``cmd`` (stdin closed, output captured) tagged ``tag`` and return it with its wall
    seconds, after checking that no process outlives it. A run still going after ``timeout``
    seconds fails the test with the Python stacks of every process it started (SIGABRT, which
    the fault handler turns into a dump of every thread): a rare hang then says where."""
    start = time.monotonic()
    proc = start_cli(cmd, cwd, cli_env(tag, **(env or {})))
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in tagged_processes(tag):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGABRT)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        for pid in tagged_processes(tag):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        pytest.fail(f"{' '.join(map(str, cmd))} still ran after {timeout:.0f} s; the stacks of "
                    f"its processes:\n{stderr[-12000:]}\nstdout:\n{stdout[-3000:]}")
    seconds = time.monotonic() - start
    assert_no_orphans(tag)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), seconds


def run_sweep(cwd: Path, *overrides: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m ddp_exp <overrides>`` in ``cwd`` (a sweep, or any run whose folder the test
    names itself); checks that no process outlives it. ``timeout``: see :data:`HANG_S`."""
    proc, _ = run_tagged([sys.executable, "-m", "ddp_exp", *overrides], cwd, uuid.uuid4().hex,
                         max(timeout, HANG_S))
    return proc


def run_once(root: Path, *overrides: str) -> Run:
    """``python -m ddp_exp <overrides>`` in ``root`` with job folder ``<root>/run``: finished,
    no process left behind."""
    job_dir = root / "run"
    proc, seconds = run_tagged([sys.executable, "-m", "ddp_exp", *overrides,
                                f"hydra.run.dir={job_dir}"], root, uuid.uuid4().hex, HANG_S)
    return Run(proc.returncode, proc.stdout, proc.stderr, job_dir, seconds).ok()


def session_dir(tmp_path_factory) -> Path:
    """A folder of this test session shared by all its processes: the base temp folder, or,
    under pytest-xdist, the folder above every worker's own (``pytest-<N>/``, made afresh
    for each session, so nothing in it outlives the session)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_run(tmp_path_factory, *overrides: str) -> Run:
    """:func:`run_once` with ``overrides``, made once per test session, not once per xdist
    worker (:func:`made_once`), in ``<session>/shared-runs/<key>/`` (its cwd holding only its
    job folder ``run/``). Tests only read the run's folder (copy it with :func:`copy_job` to
    write into one)."""
    def make(root: Path) -> dict:
        run = run_once(root, *overrides)
        return {"returncode": run.returncode, "stdout": run.stdout, "stderr": run.stderr,
                "seconds": run.seconds}

    root, record = made_once(tmp_path_factory, overrides, make)
    return Run(job_dir=root / "run", **record)


def made_once(tmp_path_factory, key: tuple[str, ...], make: Callable[[Path], dict]
              ) -> tuple[Path, dict]:
    """``make(root)`` once per test session for all xdist workers: the first process to ask
    runs it in ``root`` (``<session>/shared-runs/<hash of key>/``) and keeps the JSON record
    it returns, while the others wait on a ``filelock`` and then read that record. Returns
    (``root``, the record)."""
    from filelock import FileLock

    digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]
    cache = session_dir(tmp_path_factory) / "shared-runs"
    cache.mkdir(parents=True, exist_ok=True)
    root, record = cache / digest, cache / f"{digest}.json"
    with FileLock(cache / f"{digest}.lock"):
        if not record.exists():
            root.mkdir(exist_ok=True)
            record.write_text(json.dumps(make(root)))
    return root, json.loads(record.read_text())


def kill_when_held(job: Path, cwd: Path, args: list[str], marker: Path) -> subprocess.Popen:
    """Run ``python -m ddp_exp <args>`` in ``job`` in its own session and SIGKILL the whole
    process group (launcher and ranks) once ``marker`` exists (``resume_support.HoldingMLP``
    touched it after a mid-epoch checkpoint was on disk)."""
    tag = uuid.uuid4().hex
    return kill_group_when(job, cwd, args, cli_env(tag, **tests_on_path()), tag, marker.exists,
                           f"no {marker.name}")


def kill_group_when(job: Path, cwd: Path, args: list[str], env: dict[str, str], tag: str,
                    ready: Callable[[], bool], waiting_for: str, poll_s: float = 0.01
                    ) -> subprocess.Popen:
    """Run ``python -m ddp_exp <args>`` in ``job`` (cwd ``cwd``, environment ``env`` tagged
    ``tag``, output in ``<cwd>/killed-<tag>.log``) in its own session, and SIGKILL its whole
    process group (launcher and ranks) once ``ready()``; then no tagged process is left. Fails
    the test, saying ``waiting_for`` and the run's log, if it ends first or takes
    :data:`HANG_S`."""
    log = cwd / f"killed-{tag}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ddp_exp", *args, f"hydra.run.dir={job}"],
                                cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + HANG_S
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"{waiting_for}:\n{log.read_text()[-3000:]}"
            time.sleep(poll_s)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in tagged_processes(tag):
            os.kill(pid, signal.SIGKILL)
    assert_no_orphans(tag)
    return proc


def copy_job(run: Run, tmp_path: Path) -> Path:
    """A copy of ``run``'s job folder at ``<tmp_path>/run`` (the folder ``run_cli`` runs in),
    for a test that writes into a finished run's folder."""
    job = tmp_path / "run"
    shutil.copytree(run.job_dir, job, symlinks=True)
    return job


def folder_files(folder: Path) -> dict[Path, bytes]:
    """Every file under ``folder`` (relative path -> bytes), the job folder's lock file aside
    (each run takes it)."""
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and p.name != ".ddp_exp.lock"}


def refused_before_ranks(cfg, job_dir: Path) -> str:
    """Run, in this process, what ``python -m ddp_exp`` runs on ``cfg`` before any rank starts
    (``ddp_exp.launch.elastic.run_job`` up to the launch: the cluster layout, then
    ``launch.prepare_world`` in ``job_dir``), assert that it refuses it with a one-line
    ``ConfigError`` and that nothing of a run was written (in a folder that holds an earlier
    run: every file as it was, none added); returns the message (the CLI prints it as
    ``error: <message>``, exit 2)."""
    from ddp_exp.config.errors import ConfigError
    from ddp_exp.launch import cluster
    from ddp_exp.launch import elastic as launch

    job_dir.mkdir(parents=True, exist_ok=True)  # Hydra makes the job folder before the task
    before = folder_files(job_dir)
    with pytest.raises(ConfigError) as info:
        layout = cluster.apply_layout(cfg)
        assert layout is None or layout.ranks is None, "one task per rank: the torchrun path"
        launch.prepare_world(cfg, str(job_dir), layout.tasks_on_host if layout else 1)
    message = str(info.value)
    assert message and "\n" not in message, message
    if before:
        assert folder_files(job_dir) == before, "the earlier run's folder changed"
    else:
        for leftover in ("tensorboard", "metrics.json", "model.pt", "checkpoints"):
            assert not (job_dir / leftover).exists(), leftover
    return message


def scalars(job_dir: Path, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` pairs of one TensorBoard scalar tag in the job's single event stream."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list((job_dir / "tensorboard").glob("events.out.tfevents*"))
    assert len(files) == 1, files
    acc = EventAccumulator(str(files[0]), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def hparams_table(logdir: Path) -> dict[str, dict[str, float]]:
    """What TensorBoard's HParams tab shows for every run under ``logdir``: run name ->
    {metric column (its display name, else its tag): value}, computed by the HParams plugin's
    own session-group listing over TensorBoard's own data ingester (as ``tensorboard --logdir``
    serves it)."""
    import argparse

    from tensorboard import context
    from tensorboard.backend.event_processing import data_ingester
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, list_session_groups

    flags = argparse.Namespace(
        logdir=str(logdir), logdir_spec="", reload_interval=0, reload_task="blocking",
        reload_multifile=None, reload_multifile_inactive_secs=86400, samples_per_plugin={},
        max_reload_threads=1, purge_orphaned_data=True, generic_data="auto",
        detect_file_replacement=False, event_file_filter=None)
    ingester = data_ingester.LocalDataIngester(flags)
    ingester.start()
    plugin_context = backend_context.Context(base_plugin.TBContext(
        data_provider=ingester.data_provider, flags=flags, logdir=str(logdir)))
    request_context = context.RequestContext()
    metric_infos = plugin_context.experiment_from_metadata(
        request_context, "", True, plugin_context.hparams_metadata(request_context, ""),
        None).metric_infos
    names = {info.name.tag: info.display_name or info.name.tag for info in metric_infos}
    request = api_pb2.ListSessionGroupsRequest(
        start_index=0, slice_size=1000,
        allowed_statuses=[api_pb2.STATUS_UNKNOWN, api_pb2.STATUS_SUCCESS,
                          api_pb2.STATUS_FAILURE, api_pb2.STATUS_RUNNING])
    response = list_session_groups.Handler(request_context, plugin_context, "", request).run()
    return {session.name: {names[m.name.tag]: m.value for m in session.metric_values}
            for group in response.session_groups for session in group.sessions}


# ----------------------------------------------- helpers of more than one test module
UNREACHABLE = 10**9  # an epoch or step that a test's run never reaches


def faulty_args(config_dir: Path, **model) -> list[str]:
    """Write ``<config_dir>/model/faulty.yaml`` and return the overrides selecting it."""
    from faulty import write_model_yaml

    write_model_yaml(config_dir, **model)
    return ["--config-dir", str(config_dir), "model=faulty"]


def load_ckpt(path: Path) -> dict:
    """A checkpoint file's contents, on the CPU."""
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def tensorboard_series(job_dir: Path, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of ``tag`` as TensorBoard shows the job's folder: every event file,
    read in order, with what a resumed writer's ``purge_step`` hides removed."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(job_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def digits_split(val_size: int, seed: int, world_size: int):
    """The bundled digits split as a run with these settings splits them."""
    from ddp_exp.data import build_datasets, load_digits

    return build_datasets(load_digits(), val_size, seed, world_size)


def initial_mlp(seed: int, datasets):
    """The seeded initial MLP, built as ``ddp_exp.launch.build.prepare`` does (seed, then
    build), in eval mode."""
    import torch

    from ddp_exp.config.schema import MLPConfig
    from ddp_exp.train.models import MLP

    mlp = MLPConfig()  # the default model's keys (conf/model/mlp.yaml restates none)
    torch.manual_seed(seed)
    model = MLP(datasets.train.input_shape, datasets.train.num_outputs,
                hidden_sizes=mlp.hidden_sizes, dropout=mlp.dropout)
    return model.eval()


def cosine_lr(k: int, lr: float, warmup: int, total: int, min_lr: float) -> float:
    """The documented schedule, written out: the lr of optimizer step k = 1..total."""
    if k <= warmup:
        return lr * k / warmup
    progress = (k - warmup) / (total - warmup)
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def shared_sweep(tmp_path_factory, *overrides: str) -> Path:
    """A multirun ``python -m ddp_exp -m <overrides> hydra.sweep.dir=<folder>``, made once per
    test session for all xdist workers (:func:`made_once`), keyed by the overrides; returns
    the sweep folder after asserting exit 0. Tests only read it."""
    def make(root: Path) -> dict:
        proc = run_sweep(root, "-m", *overrides, f"hydra.sweep.dir={root / 'sweep'}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        return {"returncode": proc.returncode}

    root, _ = made_once(tmp_path_factory, ("-m", *overrides), make)
    return root / "sweep"


# Issue 38's shared sweep (tests/test_trackers.py, test_runs_command.py, test_run_record.py):
# every tracker on, three jobs differing in optim.lr alone.
TRACKED_LRS = ("0.01", "0.02", "0.05")
TRACKED_SWEEP = ("logger=[tensorboard,csv,mlflow,wandb]", "world_size=2", "trainer.epochs=1",
                 "record.hash_data=true", QUIET, f"optim.lr={','.join(TRACKED_LRS)}")


# The default digits run's training set and steps per epoch (test_resume_exact, test_signals,
# test_rank_failures, test_checkpoint_writers).
TRAIN_N = 1797 - 297  # digits minus the default val_size
STEPS_2 = math.ceil(TRAIN_N / (2 * 32))  # steps per epoch at world_size=2, batch 32: 24
STEPS_3 = math.ceil(TRAIN_N / (3 * 32))  # at world_size=3: 16


def output(run: Run) -> str:
    """What a run printed, stdout then stderr."""
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


def in_spawned_rank(target: Callable, *args, limit_s: float = HANG_S):
    """Run ``target(*args, free_port(), out)`` in a spawned process (a world of one of its
    own: :func:`one_rank_digits_world`) and return what it puts on ``out`` (plain values: a
    tensor would outlive the process's file descriptors). Fails if the process dies first, or
    exits non-zero; ``limit_s`` is a hang detector, not a speed check."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, free_port(), out))
    proc.start()
    try:
        for _ in range(int(limit_s)):
            try:
                result = out.get(timeout=1)
                break
            except queue.Empty:
                assert proc.is_alive(), f"the rank died, exit {proc.exitcode}"
        else:
            raise AssertionError(f"the rank put nothing in {limit_s:.0f} s")
        proc.join(60)
        assert proc.exitcode == 0
        return result
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


def one_rank_digits_world(port: int):
    """In a spawned test process: a gloo world of one on ``127.0.0.1:port`` (one intra-op
    thread) and digits' datasets (297 validation samples, seed 0). Returns (world, datasets);
    the caller destroys the process group."""
    import torch

    from ddp_exp.data import build_datasets, load_digits
    from ddp_exp.distributed.process_group import World, init_process_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    torch.set_num_threads(1)
    world = World.from_env()
    init_process_group("gloo", world, 60)
    return world, build_datasets(load_digits(), 297, 0, 1)


def default_signals() -> None:
    """``preexec_fn`` for a child that must start as from a terminal's shell whatever this
    process inherited: SIGINT, SIGTERM and SIGHUP at their defaults (a suite started by
    ``make test &`` from a script, or under ``nohup``, ignores SIGINT or SIGHUP, and every
    child would inherit that)."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
