"""A world that torchrun (or srun) started: this process is one of its ranks.

When the entry itself was started by ``torchrun`` (``RANK``/``WORLD_SIZE`` and
``TORCHELASTIC_RUN_ID`` in the environment), or by srun with one task per rank
(:func:`ddp_exp.launch.elastic.run_job` sets those variables from the cluster's layout),
:func:`run_under_torchrun` runs this process as one rank instead of launching a world: rank 0
owns the output folder and broadcasts its resolved config, so every rank trains on the same
config. Before Hydra parses the command line, the entry point drops a shell's leftover rank
variables (:func:`ignore_leftover_torchrun_variables`), refuses a multirun under torchrun
(:func:`asks_for_multirun`), puts ``-m`` first (:func:`multirun_flag_first`) and keeps non-zero
ranks from creating folders (:func:`torchrun_overrides`).

May use: :mod:`ddp_exp.config` (validation), :mod:`ddp_exp.distributed.process_group` (the
world, placement, the process group), :mod:`ddp_exp.launch.build`,
:mod:`ddp_exp.launch.user_input`, :mod:`ddp_exp.job` (``errors/``, the job log, an earlier
run's status), :mod:`ddp_exp.rank` (what a rank runs, its failures, logs and preemption).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from ddp_exp.config.checks import check_precision, validate
from ddp_exp.config.compose import task_overrides
from ddp_exp.config.errors import ConfigError
from ddp_exp.config.view import rank_config
from ddp_exp.distributed.process_group import (
    World,
    destroy_process_group,
    init_process_group,
    oversubscription_warning,
    resolve_placement,
)
from ddp_exp.job import folder as jobdir
from ddp_exp.job.earlier_run import run_status
from ddp_exp.launch.build import config_as_run, prepare
from ddp_exp.launch.user_input import settle
from ddp_exp.rank import preemption
from ddp_exp.rank.failures import build_failure_recorded, record_rank_failure
from ddp_exp.rank.logs import configure_logging
from ddp_exp.rank.worker import set_threads, train_rank

log = logging.getLogger("ddp_exp")

MULTIRUN_UNDER_TORCHRUN = ("multirun (-m) cannot run under torchrun: start the sweep with "
                           "python -m ddp_exp -m ..., which launches one world per job")

# What torchrun's agent sets for each rank; ``TORCHELASTIC_RUN_ID`` says an agent started it.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
TORCHRUN_VARIABLES = (*RANK_VARIABLES, "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


def under_torchrun() -> bool:
    """True when this process is a rank started by torchrun (or any elastic agent): its rank
    variables and ``TORCHELASTIC_RUN_ID`` are set, torch's own test
    (``torch.distributed.is_torchelastic_launched``). ``RANK``/``WORLD_SIZE`` alone are often
    left in a shell by an earlier experiment (:func:`ignore_leftover_torchrun_variables`)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and all(k in os.environ for k in RANK_VARIABLES)


def is_rank0() -> bool:
    """True in the process that reports for the world: rank 0 under torchrun (every rank
    composes the same config and meets the same errors), the only process otherwise."""
    return os.environ.get("RANK", "0") == "0"


def ignore_leftover_torchrun_variables() -> list[str]:
    """Remove from this process's environment the variables of a torchrun rank
    (:data:`TORCHRUN_VARIABLES`) when no agent started it (no ``TORCHELASTIC_RUN_ID``), so that
    the command launches its own world instead of waiting ``distributed.timeout_s`` for the
    peers of a world that no longer exists (R12: Lightning-AI/pytorch-lightning #16313, #5651);
    its ranks get their own from the elastic agent. Returns the names removed, for a line that
    says so; empty under torchrun or when none is set."""
    if under_torchrun() or not any(k in os.environ for k in RANK_VARIABLES):
        return []
    found = [k for k in TORCHRUN_VARIABLES if k in os.environ]
    for key in found:
        del os.environ[key]
    return found


def asks_for_multirun(argv: list[str]) -> bool:
    """True when the command line asks Hydra for a multirun (``-m``, ``--multirun``,
    ``hydra.mode=MULTIRUN``); a preset that sets ``hydra.mode`` is seen only once composed."""
    return any(arg in ("-m", "--multirun") or arg.replace(" ", "").upper() == "HYDRA.MODE=MULTIRUN"
               for arg in argv)


def multirun_flag_first(argv: list[str]) -> list[str]:
    """``argv`` with a ``-m`` / ``--multirun`` that follows an override moved before the
    overrides, where Hydra's parser takes it (``python -m ddp_exp data.batch_size=16,32 -m``
    was an 8-line argparse usage ending in "unrecognized arguments"). ``argv[0]`` stays."""
    flags = [a for a in argv[1:] if a in ("-m", "--multirun")]
    if not flags:
        return argv
    return argv[:1] + flags[:1] + [a for a in argv[1:] if a not in ("-m", "--multirun")]


def torchrun_overrides(argv: list[str]) -> list[str]:
    """Overrides appended to ``argv`` on non-zero torchrun ranks before Hydra parses it, so that
    they create nothing: no run folder (the current one), no ``.hydra/``, no job log."""
    if not under_torchrun() or os.environ["RANK"] == "0":
        return []
    return ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none",
            "hydra/hydra_logging=none"]


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
    settle(cfg)
    validate(cfg)
    preemption.install(preemption.signal_number(cfg.trainer.preempt_signal, la.cluster))
    device, backend = resolve_placement(cfg.device, cfg.distributed.backend,
                                        world.local_world_size)
    check_precision(cfg.trainer.precision, device)
    threads = set_threads(world, cfg.data.num_workers)
    warning = oversubscription_warning(world.local_world_size)
    if warning and world.local_rank == 0:
        log.warning("%s", warning)
    init_process_group(backend, world, cfg.distributed.timeout_s, device)
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
        if world.is_main and cfg.print_config:  # before the data and the model
            log.info("config:\n%s", OmegaConf.to_yaml(config_as_run(cfg, world.world_size,
                                                                     device)))
        with build_failure_recorded(job_dir, world.is_main):
            inputs = prepare(cfg, job_dir, world.world_size, device, backend)
        try:
            result = train_rank(inputs, world, threads, rank_config(inputs.cfg))
        except Exception as exc:  # recorded as the built-in launcher records a failed rank
            raise record_rank_failure(exc, world.rank, job_dir) from None
        stop = preemption.preempted_in({world.rank: result})
        if stop is not None:  # every rank stopped after the same step, rank 0 checkpointed
            raise stop
        return result
    finally:
        destroy_process_group()
