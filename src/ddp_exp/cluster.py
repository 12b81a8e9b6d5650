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

from ddp_exp.config import CLUSTERS, ConfigError

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
    """

    nnodes: int
    node_rank: int
    rdzv_endpoint: str
    job_id: str
    tasks_on_host: int = 1


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


def apply_layout(cfg: DictConfig) -> ClusterLayout | None:
    """Fill ``launcher.nnodes``, ``node_rank``, ``rdzv_endpoint``, ``rdzv_id`` and
    ``rdzv_backend=static`` from the scheduler, for ``launcher.cluster=submitit``; None (and
    ``cfg`` unchanged) otherwise.

    Raises:
        ConfigError: an unknown ``launcher.cluster``, or as :func:`submitit_layout`.
    """
    la = cfg.launcher
    if la.cluster is None:
        return None
    if la.cluster not in CLUSTERS:
        raise ConfigError(f"launcher.cluster={la.cluster!r}: use null (nodes from the config) "
                          f"or one of {', '.join(CLUSTERS)}")
    port = la.rdzv_endpoint.rpartition(":")[2]
    layout = submitit_layout(int(port) if port.isdigit() else 0)
    if layout.nnodes != la.nnodes:
        raise ConfigError(f"launcher.nnodes={la.nnodes} but the job has {layout.nnodes} "
                          "task(s), one per node: Hydra reads hydra.launcher (nodes, "
                          "tasks_per_node) once per sweep, from the config without the sweep's "
                          "values, so launcher.nnodes cannot be swept under launcher=slurm or "
                          "slurm_local; run one sweep per node count")
    gpus = os.environ.get("SLURM_GPUS_ON_NODE", "")
    ranks_here = cfg.world_size // la.nnodes
    if gpus.isdigit() and 0 < int(gpus) < ranks_here and cfg.device != "cpu":
        raise ConfigError(f"world_size={cfg.world_size}: {ranks_here} rank(s) per node but SLURM "
                          f"gave this node {gpus} GPU(s); hydra.launcher.gpus_per_node is read "
                          "once per sweep, from the config without the sweep's values: run one "
                          "sweep per world_size")
    la.node_rank = layout.node_rank
    la.rdzv_endpoint = layout.rdzv_endpoint
    la.rdzv_id = layout.job_id
    la.rdzv_backend = "static"
    return layout


def owns_folder(cfg: DictConfig) -> bool:
    """False for the tasks of a ``launcher.cluster`` job other than task 0: they share task
    0's job folder, and only task 0 takes its lock and writes ``status.json``."""
    if cfg.launcher.get("cluster") != "submitit":
        return True
    try:
        import submitit

        return submitit.JobEnvironment().global_rank == 0
    except (ImportError, RuntimeError):
        return True  # apply_layout reports the error
