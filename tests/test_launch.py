"""The one-node rendezvous (ddp_exp.launch.rendezvous) and the end of the process (exit_now)."""

from __future__ import annotations

import contextlib
import datetime
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousParameters,
    rendezvous_handler_registry,
)

from ddp_exp.launch import rendezvous


def _handler() -> rendezvous.LocalRendezvous:
    params = RendezvousParameters(backend=rendezvous.BACKEND, endpoint="127.0.0.1:0",
                                  run_id="r1", min_nodes=1, max_nodes=1, timeout=30)
    handler = rendezvous_handler_registry.create_handler(params)
    assert isinstance(handler, rendezvous.LocalRendezvous)
    return handler


def test_each_round_is_node_0_of_1_on_a_fresh_store_the_ranks_can_reach():
    """A rank connects to the round's store as a torchrun rank does (a client at
    MASTER_ADDR:MASTER_PORT); a restart's round has a store of its own, so a new world never
    reads the dead one's keys."""
    handler = _handler()
    first = handler.next_rendezvous()
    assert (first.rank, first.world_size) == (0, 1)
    assert handler.use_agent_store and handler.num_nodes_waiting() == 0
    info = first.bootstrap_store_info
    assert info.master_addr == "127.0.0.1" and info.master_port > 0
    client = dist.TCPStore(info.master_addr, info.master_port, is_master=False,
                           timeout=datetime.timedelta(seconds=10))
    client.set("attempt_0/key", b"dead world")
    assert handler.store.get("attempt_0/key") == b"dead world"

    second = handler.next_rendezvous()
    assert second.bootstrap_store_info.master_port != info.master_port
    client2 = dist.TCPStore("127.0.0.1", second.bootstrap_store_info.master_port,
                            is_master=False, timeout=datetime.timedelta(seconds=10))
    assert not client2.check(["attempt_0/key"])
    assert handler.shutdown() and handler.is_closed()


@pytest.mark.parametrize(("nnodes", "endpoint", "backend", "chosen"), [
    (1, "127.0.0.1:0", "c10d", rendezvous.BACKEND),
    (1, "127.0.0.1:29511", "c10d", "c10d"),  # a port the user chose: theirs
    (2, "127.0.0.1:0", "c10d", "c10d"),
    (2, "127.0.0.1:29511", "static", "static"),
])
def test_one_node_on_a_free_port_uses_the_local_rendezvous(monkeypatch, nnodes, endpoint,
                                                            backend, chosen):
    from omegaconf import OmegaConf

    import ddp_exp.launch.elastic as launch

    seen = {}

    def fake_elastic_launch(config, entrypoint):
        seen["backend"] = config.rdzv_backend
        return lambda *args: {}

    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", fake_elastic_launch)
    cfg = OmegaConf.create({"launcher": {
        "nnodes": nnodes, "rdzv_endpoint": endpoint, "rdzv_backend": backend, "node_rank": 0,
        "rdzv_id": "x", "max_restarts": 0, "monitor_interval_s": 0.05, "start_method": "fork",
        "rdzv_timeout_s": 30}})

    class Inputs:
        backend = "gloo"
        job_dir = "/nonexistent"

    launch._elastic_launch(cfg, 2, Inputs(), owns_folder=False)
    assert seen["backend"] == chosen


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_exit_now_flushes_what_a_normal_exit_flushes(tmp_path):
    log_file = tmp_path / "job.log"
    run = _run(f"""
        import atexit, logging
        from ddp_exp.cli.signals import exit_now
        logging.basicConfig(filename={str(log_file)!r}, level=logging.INFO)
        logging.getLogger("x").info("last line")
        atexit.register(lambda: print("atexit ran", flush=True))
        print("buffered", end="")
        exit_now(3)
        print("never")
    """)
    assert run.returncode == 3, run.stderr
    assert run.stdout == "bufferedatexit ran\n"
    assert log_file.read_text().strip().endswith("last line")

    message = _run("from ddp_exp.cli.signals import exit_now; exit_now('error: bad')")
    assert message.returncode == 1 and message.stderr == "error: bad\n"
    assert _run("from ddp_exp.cli.signals import exit_now; exit_now(None)").returncode == 0


def test_exit_now_leaves_a_process_with_work_left_to_python():
    """A live non-daemon thread (a sweep launcher's pool) is Python's to wait for."""
    run = _run("""
        import threading, time
        from ddp_exp.cli.signals import exit_now
        t = threading.Thread(target=lambda: (time.sleep(0.5), print("thread done", flush=True)))
        t.start()
        exit_now(0)
        print("returned", flush=True)
    """)
    assert run.returncode == 0
    assert run.stdout.splitlines() == ["returned", "thread done"]


def test_a_signal_outside_a_job_still_writes_the_sweeps_summary(tmp_path):
    """Ctrl-C while Hydra sets up a sweep's next job reaches __main__, not the job's task: the
    summary of the jobs that finished is written there too (fresh-user finding, session 5)."""
    import json

    import ddp_exp.cli.signals as entry
    from ddp_exp.job import sweep

    done = tmp_path / "0"
    (done / ".hydra").mkdir(parents=True)
    (done / "metrics.json").write_text(json.dumps({"val/loss": 0.5, "train/epoch_loss": 0.4}))
    (done / ".hydra" / "overrides.yaml").write_text("- data.batch_size=64\n")
    started = tmp_path / "1"
    (started / ".hydra").mkdir(parents=True)  # Hydra made its folder; the signal came first
    entry.summarize_if_sweep()  # no multirun job ran in this process: nothing to write
    assert not (tmp_path / "summary.md").exists()
    sweep.active_sweep_dir = str(tmp_path)  # what job 0's task noted
    try:
        entry.summarize_if_sweep()
    finally:
        sweep.active_sweep_dir = None
    table = (tmp_path / "summary.md").read_text()
    assert "data.batch_size=64" in table and "completed" in table and "incomplete" in table
    assert (tmp_path / "summary.csv").is_file()


def test_a_sweep_job_lost_by_submitit_is_one_line():
    """launcher=slurm_local, Ctrl-C reaching the jobs but not the sweep's process: submitit's
    UncompletedJobError was a 55-line traceback (fresh-user finding); now one line, exit 1."""
    submitit_utils = pytest.importorskip("submitit.core.utils")
    import ddp_exp.cli.errors as entry

    exc = submitit_utils.UncompletedJobError(
        "Job 123_0 (task: 0) with path /x/123_0_result.pkl\nhas not produced any output "
        "(state: FINISHED)\nError stream produced:\n----\n" + "Traceback ...\n" * 50)
    line = entry._lost_job_line(exc)
    assert line is not None and "\n" not in line
    assert "Job 123_0 (task: 0)" in line and "has not produced any output" in line
    assert entry._lost_job_line(RuntimeError("other")) is None


def test_a_sweep_whose_jobs_run_elsewhere_is_summarized_on_ctrl_c(tmp_path):
    """launcher=slurm_local: the jobs' tasks are other processes, so this process never ran a
    job; a Ctrl-C while it waited for their results wrote no summary (fresh-user finding: both
    jobs completed). The multirun's start notes the folder (SummaryCallback)."""
    import json

    from hydra import compose, initialize_config_module

    import ddp_exp.cli.main  # noqa: F401  (registers ddp_exp's configs with Hydra)
    import ddp_exp.cli.signals as entry
    from ddp_exp.job import sweep

    done = tmp_path / "0"
    (done / ".hydra").mkdir(parents=True)
    (done / "metrics.json").write_text(json.dumps({"val/loss": 0.5, "train/epoch_loss": 0.4}))
    (done / ".hydra" / "overrides.yaml").write_text("- data.batch_size=32\n")
    with initialize_config_module(config_module="ddp_exp.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra.sweep.dir={tmp_path}"],
                      return_hydra_config=True)
    assert sweep.active_sweep_dir is None
    sweep.SummaryCallback().on_multirun_start(config=cfg)
    try:
        entry.summarize_if_sweep()
    finally:
        sweep.active_sweep_dir = None
    table = (tmp_path / "summary.md").read_text()
    assert "data.batch_size=32" in table and "completed" in table


@pytest.mark.parametrize("arg", ["hydra.run.dir=", "hydra.run.dir=''", 'hydra.sweep.dir=""',
                                 "+hydra.run.dir= "])
def test_an_empty_output_folder_is_refused_before_hydra_makes_anything(arg):
    import ddp_exp.cli.errors as entry

    line = entry.empty_output_folder(["trainer.epochs=1", arg])
    assert line is not None and "is empty" in line and "hydra." in line
    assert entry.empty_output_folder(["hydra.run.dir=.", "hydra.run.dir=out"]) is None


def test_a_failed_rank_is_named_by_the_last_line_of_its_error():
    """A DataLoader worker's error starts "Caught ValueError in DataLoader worker process 0."
    and ends with the error itself: both launchers name the rank by that last line."""
    from ddp_exp.rank.failures import failure_detail

    wrapped = ("ValueError: Caught ValueError in DataLoader worker process 0.\n"
               "Original Traceback (most recent call last):\n  File ...\n"
               "ValueError: boom at index 7\n")
    assert failure_detail(wrapped) == "ValueError: boom at index 7"
    assert failure_detail("RuntimeError: injected") == "RuntimeError: injected"


def test_ctrl_c_of_a_local_submitit_sweep_waits_for_its_jobs(monkeypatch):
    """After a Ctrl-C the sweep's process waits for submitit's local jobs (its children) to end,
    up to a limit, so that none outlives it (fresh-user finding: it exited first)."""
    import subprocess
    import sys
    import types

    import ddp_exp.cli.signals as entry

    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    fake = types.SimpleNamespace(_PROCESSES={"1": job})
    monkeypatch.setitem(sys.modules, "submitit.local.local", fake)
    try:
        entry._wait_for_local_jobs(timeout_s=20)
        assert job.poll() == 0  # waited for it to end
        fake._PROCESSES["2"] = stuck
        entry._wait_for_local_jobs(timeout_s=0.5)  # a job that does not end: the limit holds
        assert stuck.poll() is None  # not waited for (it sleeps 30 s)
    finally:
        stuck.kill()
        stuck.wait()


def test_a_hung_cli_run_fails_with_the_stack_of_every_process(tmp_path):
    """The tests' harness (conftest.run_tagged): a run that outlives its timeout fails the test
    with the Python stack of each of its processes, a forked child's too, and leaves none."""
    import uuid

    from helpers import run_tagged, tagged_processes

    tag = uuid.uuid4().hex
    code = ("import os, time\n"
            "def wait_in_child():\n    time.sleep(60)\n"
            "def wait_in_parent():\n    time.sleep(60)\n"
            "wait_in_child() if os.fork() == 0 else wait_in_parent()\n")
    with pytest.raises(pytest.fail.Exception) as info:
        run_tagged([sys.executable, "-c", code], tmp_path, tag, timeout=3)
    text = str(info.value)
    assert "still ran after 3 s" in text and "wait_in_child" in text, text
    assert "wait_in_parent" in text, text
    assert tagged_processes(tag) == []


@pytest.mark.parametrize("signal_while_forking", [False, True], ids=["quiet", "sigterm"])
def test_forked_ranks_pass_the_gate_only_once_every_rank_is_forked(monkeypatch,
                                                                   signal_while_forking):
    """agent.start_ranks_safely: a rank forked first waits in pass_fork_gate until the agent's
    start of its ranks has forked the last one (a rank that connected to the agent's store
    earlier made a later fork inherit glibc's resolver lock held: a hung rank). A SIGTERM that
    comes while the agent forks is held back and raised once every rank is started (torch's
    handler raised it inside Python's after-fork hooks, which dropped it: the run trained on);
    the ranks forked meanwhile end by it."""
    import os
    import signal
    import time

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

    from ddp_exp.compat import elastic_agent as agent

    class Stop(Exception):
        pass

    def raise_stop(signum, frame):  # as torch's agent handler raises SignalException
        raise Stop(signum)

    read_fd, write_fd = os.pipe()
    forked_all, pids = [], []

    def start_three_ranks(self):  # torch's forks, 0.3 s apart
        if signal_while_forking:
            os.kill(os.getpid(), signal.SIGTERM)  # a user's signal while the agent forks
        for _ in range(3):
            pid = os.fork()
            if pid == 0:  # a rank
                os.close(read_fd)
                agent.pass_fork_gate()
                os.write(write_fd, f"{time.monotonic()}\n".encode())
                os._exit(0)
            pids.append(pid)
            time.sleep(0.3)
        forked_all.append(time.monotonic())

    monkeypatch.setattr(MultiprocessContext, "_start", start_three_ranks)
    monkeypatch.setattr(LocalElasticAgent, "_start_workers",
                        lambda self, worker_group: MultiprocessContext._start(None))
    before = signal.signal(signal.SIGTERM, raise_stop)
    try:
        with (agent.start_ranks_safely(fork=True),
              pytest.raises(Stop) if signal_while_forking else contextlib.nullcontext()):
            LocalElasticAgent._start_workers(None, None)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert forked_all, "the signal was raised before every rank was forked"
    assert agent.FORK_GATE_ENV not in os.environ
    os.close(write_fd)
    with os.fdopen(read_fd) as fh:
        passed = [float(line) for line in fh]
    ends = [os.waitpid(pid, 0)[1] for pid in pids]
    if signal_while_forking:
        assert passed == [] and all(os.WTERMSIG(e) == signal.SIGTERM for e in ends), ends
    else:
        assert len(passed) == 3 and min(passed) >= forked_all[0], (passed, forked_all)


def test_oversubscription_warning_promises_this_worlds_results(monkeypatch):
    """3 ranks on 2 cores: the warning said "slower than with 2 rank(s) (same results)", but 2
    ranks at the same per-rank batch train another global batch; the results are those of the
    same world on enough cores (a fresh user's finding)."""
    from ddp_exp.distributed import process_group

    monkeypatch.setattr(process_group.os, "sched_getaffinity", lambda pid: {0, 1})
    line = process_group.oversubscription_warning(3)
    assert line is not None and "\n" not in line
    assert "slower than on 3 cores (the same results as there)" in line
    assert "2 rank(s)" not in line
    assert process_group.oversubscription_warning(2) is None


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
