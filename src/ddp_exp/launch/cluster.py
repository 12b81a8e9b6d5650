"""A world's shape read from the scheduler that started this job (``launcher.cluster``).

With ``launcher.cluster=submitit`` (the ``launcher=slurm`` and ``launcher=slurm_local``
presets), Hydra's submitit launcher starts every job as ``nodes x tasks_per_node`` tasks, each
running the Hydra job. Each task is one node's elastic agent (what ``torchrun`` is on a node),
starting ``world_size / launcher.nnodes`` ranks; the agents meet through the static rendezvous
of the launcher (torchrun's ``--node-rank``), so ranks are numbered node by node and global rank
0 runs on task 0, which owns the job folder. Nothing here schedules or rendezvouses by itself:
the numbers come from submitit's ``JobEnvironment`` (``SLURM_*`` variables on SLURM, parsed
node list included), and torch's launcher does the rest.

* SLURM: one task per node (``hydra.launcher.tasks_per_node=1``); the rendezvous listens on the
  allocation's first host, which hosts task 0.
* submitit's local executor: the tasks stand for nodes on this machine and meet on loopback.
* Plain ``srun`` (``launcher.cluster=slurm``, :func:`slurm_layout`): the same layout read from
  the ``SLURM_*`` variables without submitit, with one task per node (each an agent, as
  above), or one task per rank joining as under ``torchrun``. Every task derives the job
  folder from ``SLURM_JOB_ID`` (``outputs/runs/slurm-<id>``, the ``ddp_exp.run_stamp``
  resolver in ``conf/config.yaml``); task 0 owns it.
* Port: ``launcher.rdzv_endpoint``'s port if it is not 0, else ``10000 + job id mod 20000``
  (unique per SLURM job, the job id of each array task included; below Linux's ephemeral
  range; the rule Lightning's SLURM environment uses too), so that jobs sharing a node do not
  collide.
"""

from __future__ import annotations

import logging
import os
import zlib
from dataclasses import dataclass

from omegaconf import DictConfig

from ddp_exp.config.compose import task_overrides
from ddp_exp.config.errors import ConfigError
from ddp_exp.config.schema import CLUSTERS

log = logging.getLogger("ddp_exp")

PORT_BASE, PORT_SPAN = 10000, 20000


@dataclass(frozen=True)
class ClusterLayout:
    """Where this task sits in its job: ``node_rank`` in ``[0, nnodes)``.

    Attributes:
        nnodes: agents (tasks) in the job, one per node.
        node_rank: this task's index (SLURM's ``SLURM_PROCID``).
        rdzv_endpoint: ``HOST:PORT`` of the static rendezvous, hosted by node 0.
        job_id: the scheduler's job id (the rendezvous's run id).
        tasks_on_host: tasks sharing this machine's cores (1 on SLURM; all of them with the
            local executor).
        ranks: with one ``srun`` task per rank (:func:`slurm_layout`), this task's rank
            environment (torchrun's variables); None when the task is its node's agent.
    """

    nnodes: int
    node_rank: int
    rdzv_endpoint: str
    job_id: str
    tasks_on_host: int = 1
    ranks: dict[str, str] | None = None


def rendezvous_port(job_id: str) -> int:
    """``10000 + (numeric job id mod 20000)``; a non-numeric id is hashed (CRC-32) first."""
    number = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return PORT_BASE + number % PORT_SPAN


def submitit_layout(configured_port: int = 0) -> ClusterLayout:
    """This task's place, read from submitit's job environment.

    Args:
        configured_port: the port of ``launcher.rdzv_endpoint``; 0 derives it from the job id.

    Raises:
        ConfigError: not inside a submitit job, the submitit extra missing, or SLURM tasks
            that are not one per node.
    """
    try:
        import submitit
    except ImportError:
        raise ConfigError("launcher.cluster=submitit needs submitit: pip install "
                          "'ddp_exp[slurm]'") from None
    try:
        env = submitit.JobEnvironment()
    except RuntimeError:
        raise ConfigError("launcher.cluster=submitit: this job was not started by submitit; "
                          "submit it with -m and launcher=slurm (or launcher=slurm_local)"
                          ) from None
    nnodes, node_rank, tasks_on_host = env.num_tasks, env.global_rank, 1
    if env.name() == "local" or env.num_nodes == 1:
        host, tasks_on_host = "127.0.0.1", env.num_tasks  # every task on this machine
    else:
        if env.num_tasks != env.num_nodes:
            raise ConfigError(f"hydra.launcher.tasks_per_node: launcher.cluster=submitit runs "
                              f"one task per node, each starting world_size / nnodes ranks; "
                              f"this job has {env.num_tasks} tasks on {env.num_nodes} nodes "
                              "(set hydra.launcher.tasks_per_node=1)")
        host = env.hostnames[0]  # SLURM_NODEID 0, where task 0 runs
    port = configured_port or rendezvous_port(str(env.raw_job_id))
    return ClusterLayout(nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=f"{host}:{port}",
                         job_id=str(env.job_id), tasks_on_host=tasks_on_host)


def slurm_hostnames(nodelist: str) -> list[str]:
    """Expand SLURM's compressed node list (``gpu[07-08],cpu3``) into host names, with
    ``scontrol show hostnames`` (on every SLURM node), else submitit's parser when the
    ``slurm`` extra is installed; a plain ``host1,host2`` list needs neither.

    Raises:
        ConfigError: a bracketed list and neither tool here.
    """
    import shutil
    import subprocess

    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=30, check=False)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()
    from ddp_exp.compat.submitit import parse_node_list

    parsed = parse_node_list(nodelist)
    if parsed is not None:
        return parsed
    if "[" not in nodelist:
        return [h for h in nodelist.split(",") if h]
    raise ConfigError(f"launcher.cluster=slurm: cannot expand SLURM_JOB_NODELIST={nodelist!r} "
                      "here (no scontrol on PATH): pip install 'ddp_exp[slurm]' for submitit's "
                      "parser")


def slurm_layout(configured_port: int = 0) -> ClusterLayout:
    """This task's place in a plain ``srun`` job (``launcher.cluster=slurm``), from SLURM's
    variables: ``SLURM_JOB_ID``, ``SLURM_NTASKS``, ``SLURM_JOB_NUM_NODES``, ``SLURM_PROCID``,
    ``SLURM_LOCALID``, ``SLURM_JOB_NODELIST``.

    Two layouts, told apart by tasks per node:

    * one task per node (``--ntasks-per-node=1``): each task is its node's elastic agent, as
      under ``launcher=slurm``; ``node_rank`` is ``SLURM_PROCID``;
    * several tasks per node (``--ntasks-per-node=<ranks>``): each task is one rank, as under
      ``torchrun``; ``ranks`` holds ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
      ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` for it.

    The rendezvous (or rank 0's store) is on the first host of the node list, at
    ``configured_port`` or :func:`rendezvous_port` of the job id.

    Raises:
        ConfigError: not inside a SLURM job, or tasks that do not divide over the nodes.
    """
    env = os.environ
    job_id = env.get("SLURM_JOB_ID")
    if not job_id or "SLURM_PROCID" not in env:
        raise ConfigError("launcher.cluster=slurm: this process is not a SLURM task "
                          "(SLURM_JOB_ID / SLURM_PROCID unset): start it with srun inside "
                          "sbatch or salloc (docs/scaling-out.md)")
    ntasks = int(env.get("SLURM_NTASKS", "1"))
    nodes = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")))
    procid = int(env["SLURM_PROCID"])
    if ntasks % nodes:
        raise ConfigError(f"launcher.cluster=slurm: {ntasks} tasks on {nodes} nodes; use the "
                          "same --ntasks-per-node on every node (1: one agent per node, or one "
                          "task per rank)")
    hosts = slurm_hostnames(env.get("SLURM_JOB_NODELIST", "localhost"))
    host = "127.0.0.1" if nodes == 1 else hosts[0]
    port = configured_port or rendezvous_port(job_id)
    ranks = None
    per_node = ntasks // nodes
    if per_node > 1:  # one task per rank
        ranks = {"RANK": str(procid), "LOCAL_RANK": env.get("SLURM_LOCALID", str(procid)),
                 "WORLD_SIZE": str(ntasks), "LOCAL_WORLD_SIZE": str(per_node),
                 "MASTER_ADDR": host, "MASTER_PORT": str(port)}
    return ClusterLayout(nnodes=nodes if ranks else ntasks, node_rank=procid,
                         rdzv_endpoint=f"{host}:{port}", job_id=job_id, ranks=ranks)


def apply_layout(cfg: DictConfig) -> ClusterLayout | None:
    """Fill ``launcher.node_rank``, ``rdzv_endpoint``, ``rdzv_id`` and ``rdzv_backend=static``
    from the scheduler (``launcher.cluster=submitit`` or ``slurm``; with ``slurm`` also
    ``launcher.nnodes`` and, see :func:`_apply_slurm`, ``world_size``); None (and ``cfg``
    unchanged) without ``launcher.cluster``. A layout with ``ranks`` (one ``srun`` task per
    rank) leaves ``cfg`` to the torchrun path.

    Raises:
        ConfigError: an unknown ``launcher.cluster``, or as :func:`submitit_layout` /
            :func:`slurm_layout`.
    """
    la = cfg.launcher
    if la.cluster is None:
        return None
    if la.cluster not in CLUSTERS:
        raise ConfigError(f"launcher.cluster={la.cluster!r}: use null (nodes from the config) "
                          f"or one of {', '.join(CLUSTERS)}")
    port = la.rdzv_endpoint.rpartition(":")[2]
    port = int(port) if port.isdigit() else 0
    if la.cluster == "slurm":
        return _apply_slurm(cfg, slurm_layout(port))
    layout = submitit_layout(port)
    if layout.nnodes != la.nnodes:
        raise ConfigError(f"launcher.nnodes={la.nnodes} but the job has {layout.nnodes} "
                          "task(s), one per node: Hydra reads hydra.launcher (nodes, "
                          "tasks_per_node) once per sweep, from the config without the sweep's "
                          "values, so launcher.nnodes cannot be swept under launcher=slurm or "
                          "slurm_local; run one sweep per node count")
    _check_gpus(cfg, "hydra.launcher.gpus_per_node is read once per sweep, from the config "
                     "without the sweep's values: run one sweep per world_size")
    _fill_static(la, layout)
    return layout


def _apply_slurm(cfg: DictConfig, layout: ClusterLayout) -> ClusterLayout:
    """``launcher.cluster=slurm``: the job's tasks decide the nodes (and, one task per rank,
    the world); with one agent per node and no explicit ``world_size``, a node's ranks are its
    GPUs (``SLURM_GPUS_ON_NODE``) unless ``device=cpu``."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        raise ConfigError("launcher.cluster=slurm runs the one job of this srun; sweep with "
                          "launcher=slurm (Hydra's submitit launcher), or one srun per job")
    if layout.ranks is not None:  # one task per rank: joins as under torchrun
        return layout
    explicit = any(o.split("=", 1)[0].lstrip("+~") == "world_size" for o in task_overrides(hc))
    gpus = os.environ.get("SLURM_GPUS_ON_NODE", "")
    cfg.launcher.nnodes = layout.nnodes
    if not explicit and gpus.isdigit() and int(gpus) > 0 and cfg.device != "cpu":
        cfg.world_size = layout.nnodes * int(gpus)
    _check_gpus(cfg, "ask for a GPU per rank (#SBATCH --gpus-per-node), or leave world_size "
                     "out to use the node's GPUs")
    _fill_static(cfg.launcher, layout)
    return layout


def _check_gpus(cfg: DictConfig, hint: str) -> None:
    """A node's ranks must not outnumber the GPUs SLURM gave it (unless ``device=cpu``)."""
    la = cfg.launcher
    gpus = os.environ.get("SLURM_GPUS_ON_NODE", "")
    ranks_here = cfg.world_size // la.nnodes
    if gpus.isdigit() and 0 < int(gpus) < ranks_here and cfg.device != "cpu":
        raise ConfigError(f"world_size={cfg.world_size}: {ranks_here} rank(s) per node but SLURM "
                          f"gave this node {gpus} GPU(s); {hint}")


def _fill_static(la: DictConfig, layout: ClusterLayout) -> None:
    """The static rendezvous of one agent per node: ``node_rank`` = the task's index."""
    la.node_rank = layout.node_rank
    la.rdzv_endpoint = layout.rdzv_endpoint
    la.rdzv_id = layout.job_id
    la.rdzv_backend = "static"


def requeue(cfg: DictConfig, signum: int | None) -> str | None:
    """Put this job back in the scheduler's queue after a preemption (issue 30; called once, by
    the task that owns the job folder, after ``status.json`` says ``preempted``). Returns the
    line that says what happened, None where no scheduler runs the job.

    * ``launcher.cluster=slurm``: ``scontrol requeue $SLURM_JOB_ID`` (as Lightning's SLURM
      environment does); the job keeps its id, and so its folder (``slurm-<id>``).
    * ``launcher.cluster=submitit``: submitit's own protocol, the handler it installed for
      ``signum`` (put back after the launch): it pickles the submission again, runs
      ``scontrol requeue`` and ends the process.
    """
    import signal
    import subprocess

    scheduler = cfg.launcher.get("cluster")
    if scheduler == "submitit" and signum is not None:
        handler = signal.getsignal(signum)
        if callable(handler):
            handler(signum, None)
            return "requeued by submitit"
        return f"not requeued: no submitit handler for {signal.Signals(signum).name}"
    if scheduler != "slurm":
        return None
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return "not requeued: SLURM_JOB_ID is not set"
    try:
        out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True,
                             timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"not requeued: scontrol requeue {job_id}: {exc}"
    if out.returncode:
        why = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[0][:300]
        return f"not requeued: scontrol requeue {job_id}: {why}"
    return f"requeued: scontrol requeue {job_id}"


def owns_folder(cfg: DictConfig) -> bool:
    """False for the tasks of a ``launcher.cluster`` job other than task 0: they share task
    0's job folder, and only task 0 takes its lock and writes ``status.json``."""
    cluster = cfg.launcher.get("cluster")
    if cluster == "slurm":
        return os.environ.get("SLURM_PROCID", "0") == "0"
    if cluster != "submitit":
        return True
    try:
        import submitit

        return submitit.JobEnvironment().global_rank == 0
    except (ImportError, RuntimeError):
        return True  # apply_layout reports the error
