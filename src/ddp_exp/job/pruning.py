"""The trial side of ``hydra/sweeper=ddp_optuna``: per-epoch reports and the prune decision.

The sweeper (``hydra_plugins.ddp_optuna_sweeper``) asks Optuna for a trial and hands the job
its link in three environment variables (Hydra's ``hydra.job.env_set``, so it reaches the job
under any launcher and the job's ranks inherit it): :data:`ENV` (the trial id),
:data:`ENV_STORAGE` (the storage: a journal file path or an RDB URL) and :data:`ENV_STUDY` (the
study's name). The pruner's config travels in the study's user attributes (:data:`PRUNER_ATTR`):
Optuna does not store the pruner with the study (``load_study`` without one falls back to a
MedianPruner), so both sides build it from the same config (:func:`build_pruner`).
In the job, every rank builds a :class:`TrialLink` (:func:`link_trial`); after each epoch's
validation, :meth:`ddp_exp.train.monitor.Monitor.update` calls :meth:`TrialLink.should_prune` with
the
world-reduced monitored value: rank 0 reports it to the trial (step = the 1-based epoch) and asks
the pruner, and broadcasts the answer, so every rank stops after the same epoch, as for early
stopping.

May use: :mod:`ddp_exp.distributed.process_group` (the broadcast). Optuna is imported only where a
trial is
linked (the ``optuna`` extra).
"""

from __future__ import annotations

import math
import os
from typing import Any

ENV = "DDP_EXP_OPTUNA_TRIAL"
ENV_STORAGE = "DDP_EXP_OPTUNA_STORAGE"
ENV_STUDY = "DDP_EXP_OPTUNA_STUDY"
PRUNER_ATTR = "ddp_exp_pruner"  # the study's user attribute: {"spec": ..., "epochs": ...}
PRUNERS = ("none", "median", "successive_halving", "hyperband")


def build_pruner(spec: dict[str, Any], epochs: int | None = None) -> Any:
    """The Optuna pruner of ``hydra.sweeper.pruner`` (a dict with ``name`` and options).

    Args:
        spec: ``name`` (one of :data:`PRUNERS`) and the options of ``PrunerConf``.
        epochs: ``trainer.epochs``, hyperband's ``max_resource`` when that is null.

    Raises:
        ValueError: an unknown pruner name (the line names the valid ones).
    """
    import optuna

    name = spec.get("name") or "none"
    if name == "none":
        return optuna.pruners.NopPruner()
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=spec.get("n_startup_trials", 5),
                                           n_warmup_steps=spec.get("n_warmup_steps", 0))
    if name == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=spec.get("min_resource") or 1,
            reduction_factor=spec.get("reduction_factor") or 4,
            min_early_stopping_rate=spec.get("min_early_stopping_rate", 0))
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=spec.get("min_resource") or 1,
            max_resource=spec.get("max_resource") or epochs or "auto",
            reduction_factor=spec.get("reduction_factor") or 3)
    raise ValueError(f"hydra.sweeper.pruner.name={name!r} is invalid: one of "
                     f"{', '.join(PRUNERS)}")


def storage_of(url: str) -> Any:
    """The Optuna storage (an ``optuna.storages.BaseStorage``) for ``url``: a path without
    ``://`` is a journal file (no server; on a cluster it must be on a file system every node
    sees), anything else an RDB URL (``RDBStorage``, as ``create_study`` builds from a URL)."""
    from optuna.storages import JournalStorage, RDBStorage
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    if "://" in url:
        return RDBStorage(url)
    return JournalStorage(JournalFileBackend(url, lock_obj=JournalFileOpenLock(url)))


def trial_id(storage: Any, study_name: str, number: int) -> int:
    """The id that ``storage`` (:func:`storage_of`'s) gives trial ``number`` of the study
    ``study_name``: what :data:`ENV` carries and ``optuna.trial.Trial`` takes. Read through the
    storage's public methods (Optuna has no public trial id on a trial)."""
    return storage.get_trial_id_from_study_id_trial_number(
        storage.get_study_id_from_name(study_name), number)


class TrialLink:
    """A running trial as one rank sees it: rank 0 holds the Optuna trial, others only vote.

    Args:
        storage: the study's storage (:func:`storage_of`'s argument).
        study: the study's name.
        trial_id: the trial's id in the storage.
        is_main: True on rank 0 (the only rank that talks to the storage).
        device: the device of the broadcast tensor (the world's: CPU for gloo).
    """

    def __init__(self, storage: str, study: str, trial_id: int, is_main: bool, device: Any):
        self.is_main, self.device = is_main, device
        self.trial = None
        if is_main:
            import optuna

            loaded = optuna.load_study(study_name=study, storage=storage_of(storage))
            pruner = loaded.user_attrs.get(PRUNER_ATTR) or {}
            loaded.pruner = build_pruner(pruner.get("spec") or {}, pruner.get("epochs"))
            self.trial = optuna.trial.Trial(loaded, trial_id)

    def should_prune(self, value: float | None, epoch: int, final: bool = False) -> bool:
        """Report ``epoch``'s (0-based) reduced monitored ``value`` (rank 0) and return the
        pruner's decision, the same on every rank (a broadcast from rank 0). A non-finite
        value is not reported (the run's own checks fail such a run). After the run's
        ``final`` epoch the value is reported and the pruner not asked: a trial that trained
        all its epochs is COMPLETE, whatever the pruner would say (successive halving has a
        rung at every ``min_resource * reduction_factor**k``, the last epoch's included)."""
        import torch

        from ddp_exp.distributed.process_group import broadcast_from_main

        decision = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.trial is not None and value is not None and math.isfinite(value):
            self.trial.report(float(value), epoch + 1)
            decision.fill_(0 if final else int(self.trial.should_prune()))
        broadcast_from_main([decision])
        return bool(decision.item())


def link_trial(is_main: bool, device: Any) -> TrialLink | None:
    """The trial this job runs for the ddp_optuna sweeper (named by :data:`ENV`,
    :data:`ENV_STORAGE` and :data:`ENV_STUDY`), or None outside such a sweep."""
    trial_id = os.environ.get(ENV)
    if not trial_id:
        return None
    return TrialLink(os.environ[ENV_STORAGE], os.environ[ENV_STUDY], int(trial_id), is_main,
                     device)


# The sweeper's record of its trials, read by the sweep summary (ddp_exp.job.sweep): per job
# folder name, the trial's state, pruned_at_epoch and per-epoch curve of the monitored metric.
TRIALS_RECORD = "optuna_trials.json"


def trial_states(sweep_dir: str) -> dict[str, dict[str, Any]] | None:
    """``{job folder name: {"number", "state", "pruned_at_epoch", "metric", "curve"}}`` from a
    ddp_optuna sweep's record, or None for other sweeps (no record)."""
    from ddp_exp.io.files import read_json

    return read_json(os.path.join(sweep_dir, TRIALS_RECORD))


def plot_curves(ax: Any, record: dict[str, dict[str, Any]]) -> None:
    """Each trial's per-epoch monitored value on ``ax`` (a matplotlib Axes): COMPLETE trials as
    lines, PRUNED ones dashed and ending in an x at the epoch they stopped."""
    metric = next((r.get("metric") for r in record.values() if r.get("metric")), "")
    for name, trial in sorted(record.items(), key=lambda kv: kv[1].get("number", 0)):
        curve = trial.get("curve") or []
        if not curve:
            continue
        xs, ys = zip(*curve, strict=True)
        pruned = trial.get("state") == "PRUNED"
        (line,) = ax.plot(xs, ys, linestyle="--" if pruned else "-", marker=".",
                          label=f"{name} {trial.get('state', '').lower()}")
        if pruned:
            ax.plot(xs[-1], ys[-1], marker="x", markersize=9, color=line.get_color())
    ax.set_title(f"{metric} per epoch (x: pruned)")
    ax.set_xlabel("epoch")
    if ax.get_legend_handles_labels()[0]:  # no trial reported an epoch: no legend to draw
        ax.legend(fontsize=6)
