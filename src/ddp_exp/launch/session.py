"""The launch's setup, written once for both launch paths: the ordered steps between a composed
config and the ranks' start.

Both :func:`ddp_exp.launch.elastic.run_job` (this process starts the node's ranks through the
elastic agent) and :func:`ddp_exp.launch.torchrun.run_under_torchrun` (torchrun or srun started
every rank; this process is one) run the same two phases, in this order:

1. :func:`check` (each launching process, before anything is built or joined):
   settle the config (paths relative to the command's folder, a replaced ``_target_``'s keys,
   :func:`ddp_exp.launch.user_input.settle`), validate it
   (:func:`ddp_exp.config.checks.validate`), refuse a trial's link copied into a plain run
   (:mod:`ddp_exp.launch.trial_link`), resolve device and backend for this node's ranks, check
   the precision on that device, warn once when the machine's cores are oversubscribed.
2. :func:`build` (with the config the world runs: under torchrun, rank 0's, broadcast):
   every ``_target_`` imports (:func:`ddp_exp.config.targets.check_targets`: its line alone,
   before the config is printed), the config printed (``print_config``: before the data and
   the model, so the first line comes at once), then the data, model and the rest built once
   (:func:`ddp_exp.launch.build.prepare`).

After the ranks ran, :func:`raise_if_preempted` turns a preempted world into
:class:`ddp_exp.rank.preemption.JobPreempted`. What differs between the paths stays with them:
the elastic path's cluster layout, forwarded signals and the agent; torchrun's world from the
environment, its process group and the broadcast of rank 0's config between the two phases.
A step both paths take is added here, once.

May use: :mod:`ddp_exp.config` (validation, precision, ``_target_`` imports),
:mod:`ddp_exp.distributed.process_group` (placement, oversubscription),
:mod:`ddp_exp.job.sweep` (the config's printout), :mod:`ddp_exp.launch.build`,
:mod:`ddp_exp.launch.trial_link`, :mod:`ddp_exp.launch.user_input`,
:mod:`ddp_exp.rank.preemption`, :mod:`ddp_exp.rank.worker` (:class:`RankInputs`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from ddp_exp.config.checks import check_precision, validate
from ddp_exp.config.targets import check_targets
from ddp_exp.distributed.process_group import oversubscription_warning, resolve_placement
from ddp_exp.job.sweep import log_config
from ddp_exp.launch.build import config_as_run, prepare
from ddp_exp.launch.trial_link import refuse_trial_link_in_a_plain_run
from ddp_exp.launch.user_input import settle
from ddp_exp.rank import preemption
from ddp_exp.rank.worker import RankInputs

log = logging.getLogger("ddp_exp")


@dataclass(frozen=True)
class Placement:
    """Where this node's ranks run, resolved by :func:`check`.

    Attributes:
        nproc: ranks on this node (the elastic agent starts them; under torchrun, its
            ``LOCAL_WORLD_SIZE``).
        device: ``cpu`` | ``cuda`` (``device=auto`` resolved).
        backend: the process group's backend, ``gloo`` | ``nccl`` (``auto`` resolved).
    """

    nproc: int
    device: str
    backend: str


def check(cfg: DictConfig, nproc: int | None = None, tasks_on_host: int = 1, jobs: int = 1,
          warn: bool = True) -> Placement:
    """Phase 1, in order: settle, validate, refuse a copied trial link, resolve device and
    backend, check the precision, the oversubscription warning. ``cfg`` is changed in place
    (settled).

    Args:
        nproc: this node's ranks; None: ``world_size // launcher.nnodes`` (read once the
            config is valid).
        tasks_on_host: launching tasks on this machine (a scheduler's tasks standing for
            nodes), each with ``nproc`` ranks; with ``jobs`` (a sweep's jobs running at once)
            they count the ranks sharing the cores.
        warn: log the oversubscription warning (one process per machine says it).

    Raises:
        ConfigError: invalid config, a trial's link in a plain run, a device or precision this
            machine lacks (one line naming the key).
    """
    settle(cfg)  # paths relative to the command's folder, a replaced _target_'s keys
    validate(cfg)
    if HydraConfig.initialized():  # a trial's link copied into a plain run: refused here
        hc = HydraConfig.get()
        hydra_overrides = [str(o) for o in hc.overrides.hydra]  # hydra.job.env_set.* among them
        refuse_trial_link_in_a_plain_run(hc.mode == RunMode.MULTIRUN, hydra_overrides)
    if nproc is None:
        nproc = cfg.world_size // cfg.launcher.nnodes
    device, backend = resolve_placement(cfg.device, cfg.distributed.backend, nproc)
    check_precision(cfg.trainer.precision, device)
    warning = oversubscription_warning(nproc * tasks_on_host, jobs)
    if warning and warn:
        log.warning("%s", warning)
    return Placement(nproc, device, backend)


def build(cfg: DictConfig, job_dir: str, placement: Placement, owner: bool = True
          ) -> RankInputs:
    """Phase 2, in order: every ``_target_`` imports, the config printed (``print_config``,
    by the ``owner``), then what every rank needs, built once in ``job_dir`` for a world of
    ``cfg.world_size`` ranks (:func:`ddp_exp.launch.build.prepare`).

    Args:
        owner: this process owns the job folder and speaks for the world: rank 0's under
            torchrun, task 0's in a cluster job (``launcher.cluster``), the launcher's
            otherwise. Only it prints the config and changes the folder.

    Raises:
        ConfigError: a ``_target_`` that cannot be imported, bad data, model or optimizer.
        FolderHoldsRun, AlreadyComplete: see :func:`ddp_exp.launch.build.prepare`.
    """
    check_targets(cfg)  # a _target_ that cannot be imported: its line alone, no config first
    if owner and cfg.print_config:  # before the data and the model: the first line at once
        # a sweep's later jobs: their overrides
        log_config(config_as_run(cfg, cfg.world_size, placement.device))
    return prepare(cfg, job_dir, cfg.world_size, placement.device, placement.backend, owner)


def raise_if_preempted(results: dict[int, Any]) -> None:
    """Raise :class:`ddp_exp.rank.preemption.JobPreempted` when the ranks of ``results``
    (global rank -> what it returned) stopped for a preemption: every rank stopped after the
    same step and rank 0 checkpointed."""
    stop = preemption.preempted_in(results)
    if stop is not None:
        raise stop
