"""Start a world: from one composed Hydra job to ``world_size`` running ranks.

:func:`run_job` validates the config, resolves device and backend, has the data and the seeded
model built **once** in this process (the launch session's steps, shared with the torchrun path:
:mod:`ddp_exp.launch.session`), and starts ``world_size`` ranks through PyTorch's elastic
launcher (``torch.distributed.launcher.api.elastic_launch``, the machinery behind torchrun),
every field of its ``LaunchConfig`` set explicitly: on one node the agent's own rendezvous
(:mod:`ddp_exp.launch.rendezvous`: a fresh store on a free loopback port, so parallel jobs
cannot collide or merge), across nodes c10d (or static, whose nodes first meet at
:mod:`ddp_exp.launch.node_gate` and hear of a node that failed) on
``launcher.rdzv_endpoint``; a fresh ``run_id``, restarts from ``launcher.max_restarts``; the
agent checks its ranks every ``launcher.monitor_interval_s``.

When the entry itself was started by ``torchrun``, or srun started one task per rank, this
process is one rank instead (:func:`ddp_exp.launch.torchrun.run_under_torchrun`).

Fork safety: the default start method is fork (fast start; ranks inherit imports, data and
model). A forked child hangs in OpenMP if the parent ever ran a parallel torch operation, so this
process pins itself to one intra-op thread before any torch compute (docs/scaling-out.md).

May use: :mod:`ddp_exp.launch.cluster` (a scheduler's layout), :mod:`ddp_exp.launch.session`
(the checks and the build), :mod:`ddp_exp.job.folder` (``errors/``, partial files, the job
log), :mod:`ddp_exp.rank.failures` (a build that fails), :mod:`ddp_exp.io.files`,
:mod:`ddp_exp.launch.rendezvous` (one node's), :mod:`ddp_exp.launch.node_gate` (nodes meeting
before their ranks start), :mod:`ddp_exp.compat.elastic_agent` (the start
of the ranks), :mod:`ddp_exp.rank.worker` (what each rank runs), :mod:`ddp_exp.rank.parent` (a
rank ends with its launcher), :mod:`ddp_exp.launch.torchrun` (a world torchrun or srun started).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import tempfile
import threading
import uuid
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ddp_exp.compat import elastic_agent as agent
from ddp_exp.compat import messages
from ddp_exp.io.files import atomic_write
from ddp_exp.job import folder as jobdir
from ddp_exp.job.earlier_run import run_status
from ddp_exp.launch import cluster, node_gate, session
from ddp_exp.launch.parallel_jobs import parallel_jobs
from ddp_exp.launch.torchrun import run_under_torchrun
from ddp_exp.launch.torchrun_env import under_torchrun
from ddp_exp.rank import parent, preemption, stacks
from ddp_exp.rank.failures import FAILURES_ENV, build_failure_recorded
from ddp_exp.rank.worker import RankInputs, run_rank

log = logging.getLogger("ddp_exp")

_FRESH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def run_job(cfg: DictConfig) -> dict[str, Any] | None:
    """Run one Hydra job as one training world; returns rank 0's final metrics.

    Raises:
        ConfigError: invalid config or data, before any rank starts.
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a rank failed.
    """
    if under_torchrun():  # this process is a rank: it ends with torchrun's agent
        parent.end_with_launcher(None)
        return run_under_torchrun(cfg)
    torch.set_num_threads(1)  # before any torch compute here: keeps forked ranks safe
    layout = cluster.apply_layout(cfg)
    if layout is not None and layout.ranks is not None:  # srun started one task per rank
        parent.end_with_launcher(None)  # with slurmstepd
        os.environ.update({**layout.ranks, "TORCHELASTIC_RUN_ID": layout.job_id or "srun"})
        return run_under_torchrun(cfg)
    if layout is not None:
        _log_as_task(cfg.launcher.cluster, layout)
    owner = layout is None or layout.node_rank == 0  # other tasks share task 0's folder
    job_dir = HydraConfig.get().runtime.output_dir
    # The scheduler's warning before it stops the job, held from here (issue 30; the data may
    # take long to load): noted, passed on to the ranks.
    signum = preemption.signal_number(cfg.trainer.preempt_signal, cfg.launcher.cluster)
    gate = node_gate.gate_for(cfg.launcher)  # nodes meet before their ranks start
    try:
        with preemption.forwarded(signum, agent.rank_pids) as held:
            return _build_and_launch(cfg, job_dir, layout, owner, held, signum, gate)
    finally:
        if gate is not None:
            gate.close()


def _build_and_launch(cfg: DictConfig, job_dir: str, layout: cluster.ClusterLayout | None,
                      owner: bool, held: preemption.Forwarder | None, signum: int | None,
                      gate: node_gate.NodeGate | None) -> dict[str, Any] | None:
    """:func:`run_job` from the world's build on: build it, meet the other nodes at the
    ``gate`` (telling them if this node failed first), launch the ranks."""
    try:
        preemption.continue_stopped(cfg, job_dir, run_status(job_dir))
        # Worlds sharing this machine's cores: tasks standing for nodes, a sweep's parallel jobs.
        jobs = parallel_jobs()
        sharing = (layout.tasks_on_host if layout is not None else 1) * jobs
        with build_failure_recorded(job_dir, owner):
            nproc, inputs = prepare_world(cfg, job_dir, sharing, jobs, owner)
        env = {}
        if sharing > 1 and "OMP_NUM_THREADS" not in os.environ:
            # threads_per_rank's rule, over every rank on the machine.
            cores = len(os.sched_getaffinity(0))
            env["OMP_NUM_THREADS"] = str(max(1, cores // (nproc * sharing)))
        if cfg.launcher.start_method == "fork":
            _preload_for_ranks()
        if held is not None and held.requested:  # came while the data loaded: no rank ran
            raise preemption.JobPreempted(preemption.preempted_line(signum, None, None), None,
                                          signum)
        la = cfg.launcher
        if la.nnodes > 1:
            log.info("waiting for %d node(s) at %s (%s rendezvous, up to launcher.rdzv_timeout_s="
                     "%d s)", la.nnodes, la.rdzv_endpoint, la.rdzv_backend, la.rdzv_timeout_s)
        if gate is not None:
            gate.wait_for_every_node()
    except BaseException as exc:
        if gate is not None and not isinstance(exc, node_gate.NodeFailed):
            gate.announce_failure(node_gate.failure_line(exc))
        raise
    if owner:  # an earlier attempt's errors/ would contradict this run's status
        jobdir.clear_errors(inputs.job_dir)
    with _environ(env):
        results = _elastic_launch(cfg, nproc, inputs, owner, held)
    session.raise_if_preempted(results)
    if 0 not in results:
        log.info("this node's ranks %s finished; rank 0, on another node, wrote the outputs",
                 sorted(results))
    return results.get(0)


def prepare_world(cfg: DictConfig, job_dir: str, tasks_on_host: int = 1, jobs: int = 1,
                  owner: bool = True) -> tuple[int, RankInputs]:
    """Everything this launcher checks and builds before its ranks start, in the launch
    session's order (:mod:`ddp_exp.launch.session`): the config checked, device and backend
    placed for this node's ranks, the oversubscription warning (over the ranks of
    ``tasks_on_host`` tasks on this machine, ``jobs`` of them a sweep's jobs running at once),
    then the config printed and the data, model and the rest built in ``job_dir`` (changed by
    the ``owner`` alone: a task of a cluster job other than task 0 is not). Returns (ranks on
    this node, inputs).

    Raises:
        ConfigError: invalid config or data (one line naming the key).
        FolderHoldsRun, AlreadyComplete: see :func:`ddp_exp.launch.build.prepare`.
    """
    placement = session.check(cfg, tasks_on_host=tasks_on_host, jobs=jobs)
    return placement.nproc, session.build(cfg, job_dir, placement, owner)


def _log_as_task(scheduler: str, layout: cluster.ClusterLayout) -> None:
    """Say where this task sits; then a task other than 0 logs only warnings and errors
    (every task's handlers append to the one job log, which task 0 keeps)."""
    log.info("%s job %s: node %d of %d, static rendezvous at %s", scheduler, layout.job_id,
             layout.node_rank, layout.nnodes, layout.rdzv_endpoint)
    if layout.node_rank > 0:
        for handler in logging.getLogger().handlers:
            handler.setLevel(logging.WARNING)


def _preload_for_ranks() -> None:
    """Import, once and here, what every rank would import at its first ``DDP(model)``
    (torch._dynamo, :mod:`ddp_exp.compat.preload`) and in rank 0's writer; forked ranks
    inherit the modules. Imports before a fork are safe; torch compute is not."""
    import torch.utils.tensorboard  # noqa: F401

    from ddp_exp.compat.preload import preload_for_forked_ranks

    preload_for_forked_ranks()


class _AgentLogFilter(logging.Filter):
    """Filter of the elastic agent's process-context logger, for one launch.

    * The agent logs a failed rank's traceback, then raises it again in ChildFailedError, which
      the entry point prints: the error is shown once. The failure (local rank, exit code) is
      appended to ``failures_file`` (JSON list, one entry per failed attempt), where rank 0 of
      the restarted world reads it (:func:`ddp_exp.rank.failures.restart_line`).
    * "Closing process <pid> via signal SIGTERM", once per rank on every Ctrl-C and restart, and
      torch.multiprocessing's "Terminating process <pid> via signal SIGTERM" when a rank fails,
      show only when their logger is set to DEBUG (``hydra.verbose=torch``); so does the
      agent's "Received 2 death signal, shutting down workers" on a Ctrl-C or SIGTERM, which
      the entry point's ``interrupted (SIGINT)`` says.
    """

    def __init__(self, failures_file: str, first_rank: int | None) -> None:
        super().__init__()
        self.failures_file, self.first_rank, self.failures = failures_file, first_rank, []

    def filter(self, record: logging.LogRecord) -> bool:
        if messages.agent_closing_process(str(record.msg)):
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        failure = messages.agent_rank_failure(record)
        if failure is None:
            return True
        exitcode, local_rank = failure
        rank = None if self.first_rank is None else self.first_rank + int(local_rank)
        self.failures.append({"local_rank": local_rank, "rank": rank, "exitcode": exitcode})
        text = json.dumps(self.failures)
        atomic_write(self.failures_file, lambda fh: fh.write(text.encode()))
        return False


AGENT_SERVER_LOGGER = "torch.distributed.elastic.agent.server.api"


def _elastic_launch(cfg: DictConfig, nproc: int, inputs: RankInputs, owns_folder: bool = True,
                    held: preemption.Forwarder | None = None) -> dict[int, Any]:
    """Start this node's ``nproc`` ranks and wait for the world; returns this node's ranks'
    results by global rank. ``owns_folder``: this launcher may clean the job folder afterwards
    (False for a task sharing another task's folder, which may still be writing there).
    ``held``: the preemption signal held by this launcher, passed on to each start's ranks."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    la = cfg.launcher
    # The agent's per-attempt error files go to a folder removed afterwards; the failure
    # summary (rank, exit code, traceback) is raised as ChildFailedError.
    # A restarted world must not read the previous attempt's keys: by default torch's c10d
    # rendezvous hands every attempt the same shared TCPStore, and the new ranks connect to the
    # dead ones' gloo addresses ("Connection refused"; 10 of 17 restarts failed here). Opting out
    # gives every attempt's ranks a fresh store on a new free port.
    # Forked ranks must not resolve host names: a rank forked while another thread of this
    # process held glibc's resolver lock blocked for ever in getaddrinfo (seen once, a rank stuck
    # in __resolv_context_get inside TCPStore's connect). Numeric addresses and a named gloo
    # interface keep getaddrinfo's resolver out of the ranks and of the agent's threads.
    # Each rank ends when this process dies, whatever kills it (ddp_exp.rank.parent).
    env = {parent.LAUNCHER_PID_ENV: str(os.getpid())}
    if la.max_restarts > 0:
        env[_FRESH_STORE_ENV] = "1"
    # One node, or "nodes" meeting on this machine: every rank is reached over loopback.
    on_loopback = la.nnodes == 1 or la.rdzv_endpoint.rpartition(":")[0] in LOOPBACK_HOSTS
    if on_loopback and inputs.backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        # Gloo would resolve this host's name to pick an interface; on one node it is loopback.
        env["GLOO_SOCKET_IFNAME"] = _loopback_interface()
    # static reads "timeout"; c10d reads "join_timeout" (default 600 s) and ignores "timeout".
    rdzv_configs: dict[str, Any] = {"timeout": la.rdzv_timeout_s,
                                    "join_timeout": la.rdzv_timeout_s}
    if la.rdzv_backend == "static":  # torchrun --node-rank: ranks numbered node by node
        rdzv_configs["rank"] = la.node_rank
    rdzv_backend = la.rdzv_backend
    if la.nnodes == 1 and rdzv_backend == "c10d" and la.rdzv_endpoint.endswith(":0"):
        # One node on a free port: nobody to meet, so no c10d join (ddp_exp.launch.rendezvous).
        from ddp_exp.launch import rendezvous

        rdzv_backend = rendezvous.BACKEND
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")  # "Terminating process" lines
    agent_server_log = logging.getLogger(AGENT_SERVER_LOGGER)  # "Received 2 death signal"
    # Global rank of this node's local rank 0: known on one node and with static node ranks.
    first_rank = (0 if la.nnodes == 1 else
                  la.node_rank * nproc if la.rdzv_backend == "static" else None)
    with tempfile.TemporaryDirectory(prefix="ddp_exp-launch-") as agent_dir:
        failures = _AgentLogFilter(os.path.join(agent_dir, "failures.json"), first_rank)
        env[FAILURES_ENV] = failures.failures_file
        config = LaunchConfig(
            min_nodes=la.nnodes, max_nodes=la.nnodes, nproc_per_node=nproc,
            run_id=la.rdzv_id or _default_run_id(la.rdzv_backend), role="ddp_exp",
            rdzv_backend=rdzv_backend, rdzv_endpoint=la.rdzv_endpoint,
            rdzv_configs=rdzv_configs,
            # The agent checks its ranks every launcher.monitor_interval_s.
            max_restarts=la.max_restarts, monitor_interval=la.monitor_interval_s,
            start_method=la.start_method, logs_specs=DefaultLogsSpecs(log_dir=agent_dir),
            # A preemption signal among torch's (TERM) is held by ddp_exp instead.
            signals_to_handle=preemption.torch_signals(held.signum if held else None),
            # On loopback, ranks reach the store at a numeric address (MASTER_ADDR=127.0.0.1).
            local_addr="127.0.0.1" if on_loopback else None,
        )
        agent_log.addFilter(failures)
        spawn_log.addFilter(failures)
        agent_server_log.addFilter(failures)
        try:
            with (_environ(env), _own_signal_handlers(),
                  agent.start_ranks_safely(fork=la.start_method == "fork",
                                           after_start=held.forward if held else None,
                                           before_stop=stacks.on_rank_failure)):
                stacks.forget()
                return elastic_launch(config, run_rank)(inputs)
        except ChildFailedError as exc:
            jobdir.keep_error_files(exc, inputs.job_dir)
            # A collective's timeout: where the ranks still running were (ddp_exp.rank.stacks).
            exc.ddp_exp_stacks_note = stacks.keep(inputs.job_dir, first_rank)
            raise
        finally:  # every rank has ended: a rank killed mid-write leaves no partial file
            agent_log.removeFilter(failures)
            spawn_log.removeFilter(failures)
            agent_server_log.removeFilter(failures)
            if owns_folder:
                jobdir.remove_partial_files(inputs.job_dir)


@contextlib.contextmanager
def _own_signal_handlers():
    """Put this process's signal handlers back after the launch. The agent installs torch's
    (SIGINT, SIGTERM, SIGHUP, SIGQUIT, and SIGUSR1/SIGUSR2 where they stop the job as SIGTERM
    does, :func:`ddp_exp.rank.preemption.torch_signals`, raise ``SignalException``) and leaves
    them: a Ctrl-C
    while Hydra composed a sweep's next job then raised it inside OmegaConf, which rebuilt it
    with one argument and printed a ``TypeError`` traceback instead of the interrupt."""
    names = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", *preemption.STOP_SIGNALS)
    saved = {sig: signal.getsignal(sig) for sig in (getattr(signal, n, None) for n in names)
             if sig is not None}
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in saved.items():
                if handler is not None:
                    signal.signal(sig, handler)


def _default_run_id(rdzv_backend: str) -> str:
    """A fresh id for c10d (a world of its own on its free port); for the static rendezvous one
    id that every node derives alike, as torchrun's default ``none`` (the store's keys are
    prefixed with it, so nodes with different ids would never meet)."""
    return "none" if rdzv_backend == "static" else uuid.uuid4().hex


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """Set environment variables for the launch (the ranks inherit them), then restore."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _loopback_interface() -> str:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS)."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else "lo"


