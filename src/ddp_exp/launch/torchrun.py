"""A world that torchrun (or srun) started: this process is one of its ranks.

When the entry itself was started by ``torchrun`` (``RANK``/``WORLD_SIZE`` and
``TORCHELASTIC_RUN_ID`` in the environment), or by srun with one task per rank
(:func:`ddp_exp.launch.elastic.run_job` sets those variables from the cluster's layout),
:func:`run_under_torchrun` runs this process as one rank instead of launching a world: rank 0
owns the output folder and broadcasts its resolved config, so every rank trains on the same
config. Before Hydra parses the command line, the entry point drops a shell's leftover rank
variables (:func:`ignore_leftover_torchrun_variables`), refuses a multirun under torchrun
(:func:`asks_for_multirun`), puts ``-m`` first (:func:`multirun_flag_first`) and keeps non-zero
ranks from creating folders (:func:`torchrun_overrides`): those read the environment alone and
live in :mod:`ddp_exp.launch.torchrun_env`, which the entry imports without torch.

The checks and the build both paths share, in their order, are :mod:`ddp_exp.launch.session`'s.

May use: :mod:`ddp_exp.config` (the world size), :mod:`ddp_exp.distributed.process_group` (the
world, the process group), :mod:`ddp_exp.launch.session` (the checks and the build),
:mod:`ddp_exp.job` (``errors/``, the job log, an earlier run's status), :mod:`ddp_exp.rank`
(what a rank runs, its failures, logs and preemption).
"""

from __future__ import annotations

import os
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from ddp_exp.config.compose import task_overrides
from ddp_exp.config.errors import ConfigError
from ddp_exp.config.view import rank_config
from ddp_exp.distributed.process_group import World, destroy_process_group, init_process_group
from ddp_exp.job import folder as jobdir
from ddp_exp.job.earlier_run import run_status
from ddp_exp.launch import session
from ddp_exp.launch.torchrun_env import MULTIRUN_UNDER_TORCHRUN
from ddp_exp.rank import preemption, stacks
from ddp_exp.rank.failures import build_failure_recorded, exit_is_a_failure, record_rank_failure
from ddp_exp.rank.logs import configure_logging
from ddp_exp.rank.worker import set_threads, train_rank


def run_under_torchrun(cfg: DictConfig) -> dict[str, Any] | None:
    """This process is one rank of a torchrun world: validate, join, adopt rank 0's config.

    Raises:
        ConfigError: an explicit ``world_size=`` that is not torchrun's ``WORLD_SIZE``.
        ddp_exp.rank.failures.RankFailed: training failed on this rank (recorded by
            :func:`ddp_exp.rank.failures.record_rank_failure`).
    """
    import torch.distributed as dist

    world = World.from_env()
    hc = HydraConfig.get()
    if hc.mode is not None and hc.mode.name == "MULTIRUN":
        raise ConfigError(MULTIRUN_UNDER_TORCHRUN)
    explicit = [o for o in task_overrides(hc) if o.split("=", 1)[0].lstrip("+~") == "world_size"]
    if explicit and cfg.world_size != world.world_size:
        raise ConfigError(f"world_size={cfg.world_size} disagrees with torchrun's WORLD_SIZE="
                          f"{world.world_size}; drop world_size= or make them equal")
    cfg.world_size = world.world_size
    # The world torchrun (or srun) made: its nodes, this node's index, rank 0's store.
    la = cfg.launcher
    la.nnodes = world.world_size // world.local_world_size
    la.rdzv_backend, la.node_rank, la.rdzv_id = "static", world.rank // world.local_world_size, None
    la.rdzv_endpoint = ":".join(os.environ.get(k, d) for k, d in (("MASTER_ADDR", "127.0.0.1"),
                                                                   ("MASTER_PORT", "0")))
    # The launch session's first phase, on each rank (ddp_exp.launch.session); one rank of
    # each machine says the oversubscription warning.
    placement = session.check(cfg, world.local_world_size, warn=world.local_rank == 0)
    preemption.install(preemption.signal_number(cfg.trainer.preempt_signal, la.cluster))
    stacks.listen()  # where this rank is, asked by a peer whose collective timed out
    threads = set_threads(world, cfg.data.num_workers)
    init_process_group(placement.backend, world, cfg.distributed.timeout_s, placement.device)
    try:
        # Rank 0's composition wins: the same resolved config (${now:} included) and one
        # output folder for the whole world.
        if world.is_main:  # an earlier attempt's error files would contradict this run
            jobdir.clear_errors(hc.runtime.output_dir)
            # A restarted (elastic) or requeued world continues from the last checkpoint.
            preemption.continue_stopped(cfg, hc.runtime.output_dir,
                                        run_status(hc.runtime.output_dir),
                                        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        shared = [OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
                  hc.runtime.output_dir, jobdir.job_log_file()] if world.is_main else [None] * 3
        dist.broadcast_object_list(shared, src=0)
        plain, job_dir, log_file = shared
        cfg = OmegaConf.create(plain)
        configure_logging(world.rank, log_file)
        with build_failure_recorded(job_dir, world.is_main):  # the session's second phase
            inputs = session.build(cfg, job_dir, placement, owner=world.is_main)
        try:
            with exit_is_a_failure():  # sys.exit in the user's code: this rank failed
                result = train_rank(inputs, world, threads, rank_config(inputs.cfg))
        except Exception as exc:  # recorded as the built-in launcher records a failed rank
            raise record_rank_failure(exc, world.rank, job_dir) from None
        session.raise_if_preempted({world.rank: result})
        return result
    finally:
        destroy_process_group()
