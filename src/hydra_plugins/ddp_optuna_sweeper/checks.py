"""The ddp_optuna sweeper's settings checks: each refusal is one line naming the key and what
would be valid (:class:`SweepRefused`; the sweeper prints it and exits 2 before any trial)."""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, OmegaConf


class SweepRefused(ValueError):
    """A ddp_optuna setting that cannot run (one line naming the key and what is valid)."""


def direction_of(direction: str | None, task: DictConfig) -> str:
    """``minimize`` or ``maximize``: ``direction`` if given, else from ``trainer.monitor`` and
    ``trainer.monitor_mode`` (``max`` for ``val/accuracy``).

    Raises:
        SweepRefused: no monitored metric, an unknown direction, or one that contradicts the
            monitored metric's mode.
    """
    from ddp_exp.train.monitor import default_mode

    monitor = OmegaConf.select(task, "trainer.monitor")
    if monitor is None:
        raise SweepRefused("hydra/sweeper=ddp_optuna needs trainer.monitor (the metric it "
                           "optimises and prunes on), e.g. trainer.monitor=val/loss")
    mode = OmegaConf.select(task, "trainer.monitor_mode") or default_mode(monitor)
    implied = "maximize" if mode == "max" else "minimize"
    if direction is None:
        return implied
    if direction not in ("minimize", "maximize"):
        raise SweepRefused(f"hydra.sweeper.direction={direction!r} is invalid: minimize, "
                           "maximize or null (from trainer.monitor_mode)")
    if direction != implied:
        raise SweepRefused(f"hydra.sweeper.direction={direction} contradicts "
                           f"trainer.monitor={monitor} with monitor_mode={mode} (which "
                           f"{implied}s it): drop the direction or set trainer.monitor_mode")
    return direction


def check_counts(n_trials: Any, n_jobs: Any) -> None:
    """Raises SweepRefused for ``hydra.sweeper.n_trials`` or ``n_jobs`` below 1."""
    for key, value in (("n_trials", n_trials), ("n_jobs", n_jobs)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SweepRefused(f"hydra.sweeper.{key}={value!r} is invalid: a whole number >= 1")


def check_storage(storage: str | None) -> None:
    """Raises SweepRefused for a journal-file ``hydra.sweeper.storage`` (no ``://``) whose
    folder does not exist or is not a folder; an RDB URL is Optuna's to check."""
    if not storage or "://" in storage:
        return
    folder = os.path.dirname(os.path.abspath(storage))
    if not os.path.isdir(folder):
        raise SweepRefused(f"hydra.sweeper.storage={storage!r}: its folder {folder} does not "
                           "exist (a journal file's folder must exist; or an RDB URL such as "
                           "sqlite:///study.db)")
    if os.path.isdir(storage):
        raise SweepRefused(f"hydra.sweeper.storage={storage!r} is a folder: name a journal "
                           "file in it, e.g. .../optuna_journal.log")
