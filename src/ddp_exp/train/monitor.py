"""The monitored validation metric: best epoch, ``checkpoints/best.pt`` and early stopping.

``trainer.monitor`` names a reduced validation metric (``val/loss``, ``val/accuracy`` or
``val/<metric>``); ``trainer.monitor_mode`` says whether lower (``min``) or higher (``max``) is
better (default: ``max`` for ``val/accuracy``, ``min`` for everything else). After each epoch's
validation every rank calls :meth:`Monitor.update` with the same all-reduced value (an
all-reduce hands every rank the same bits), so every rank takes the same decisions: whether the
epoch is the new best (rank 0 then writes ``best.pt``), and whether ``trainer.
early_stopping_patience`` epochs have passed without improvement, after which every rank stops
after the same epoch. A strict improvement counts; a non-finite value never does. In a
``hydra/sweeper=ddp_optuna`` trial, :attr:`Monitor.trial` (:mod:`ddp_exp.job.pruning`) reports the
value to the study after each validation, and a prune decision stops every rank the same way
(``pruned_at_epoch`` in metrics.json).

Uses :mod:`ddp_exp.config` (errors); the launcher's checks and the loop use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from ddp_exp.config.errors import ConfigError


def default_mode(metric: str) -> str:
    """``max`` for ``val/accuracy``, ``min`` otherwise (losses, errors)."""
    return "max" if metric == "val/accuracy" else "min"


def resolve(cfg: dict[str, Any], metric_names: Iterable[str], val_size: int) -> str | None:
    """Check ``trainer.monitor`` against this run's validation metrics and fill in
    ``trainer.monitor_mode`` and ``trainer.test_weights`` in the resolved config ``cfg`` (the
    config records what ran). With no validation samples monitoring is off (``monitor``
    becomes null) unless a key needs it. Returns a line to log, or None.

    Args:
        cfg: the resolved config as plain data (changed in place).
        metric_names: the run's validation metrics without ``val/`` (``accuracy``, user ones).
        val_size: validation samples.

    Raises:
        ConfigError: an unknown metric, or early stopping / ``test_weights=best`` without
            validation samples.
    """
    t = cfg["trainer"]
    note = None
    if t["monitor"] is not None and val_size == 0:
        if t["early_stopping_patience"] is not None or t["test_weights"] == "best":
            key = ("trainer.early_stopping_patience" if t["early_stopping_patience"] is not None
                   else "trainer.test_weights")
            value = t["early_stopping_patience"] if key.endswith("patience") else "best"
            raise ConfigError(f"{key}={value!r} is invalid with data.val_size=0: it watches "
                              f"trainer.monitor={t['monitor']} (set data.val_size > 0)")
        note = (f"no validation set (data.val_size=0): no val/ metrics, no best.pt, "
                f"trainer.monitor={t['monitor']} is off; set data.val_size=N to hold out N "
                "samples")
        t["monitor"] = None
    if t["monitor"] is not None:
        valid = ["val/loss", *(f"val/{name}" for name in metric_names)]
        if t["monitor"] not in valid:
            raise ConfigError(f"trainer.monitor={t['monitor']!r} is invalid: one of "
                              f"{', '.join(valid)} (this run's validation metrics), or null")
        t["monitor_mode"] = t["monitor_mode"] or default_mode(t["monitor"])
    if t["test_weights"] is None:
        t["test_weights"] = "best" if t["monitor"] is not None else "last"
    return note


class Monitor:
    """Best value, best epoch and epochs without improvement of ``trainer.monitor``.

    Args:
        metric: the monitored key of the validation results, or None (off).
        mode: ``min`` or ``max`` (a str, or a :class:`ddp_exp.config.choices.MonitorMode`).
        patience: epochs without improvement before stopping, or None (never).
    """

    def __init__(self, metric: str | None, mode: str | None, patience: int | None):
        # the plain value (trainer.monitor_mode is an Enum): it goes into checkpoints, which
        # load with weights_only=True, and into the log
        self.metric, self.mode, self.patience = metric, str(mode or "min"), patience
        self.best: float | None = None
        self.best_epoch: int | None = None  # 0-based
        self.best_step: int | None = None  # the global step of the best validation
        self.bad_epochs = 0
        self.stopped_early = False
        self.trial: Any = None  # a ddp_exp.job.pruning.TrialLink in a ddp_optuna sweep's trial
        self.pruned_at_epoch: int | None = None  # 1-based

    def update(self, val: dict[str, Any], epoch: int, final: bool = False,
               step: int | None = None) -> bool:
        """Record a validation's reduced results, in (0-based) ``epoch`` (at global ``step``
        when validation is by steps, ``trainer.val_every_n_steps``); True if it is the new
        best. Patience counts validations. ``final``: the run's last validation
        (``trainer.epochs`` or ``trainer.max_steps`` reached), after which a sweep's pruner is
        not asked (nothing is left to save); it is told the value at the epoch's number, or at
        ``step`` by steps."""
        if self.metric is None:
            return False
        value = val.get(self.metric)
        finite = value is not None and math.isfinite(value)
        better = finite and (self.best is None or (value < self.best if self.mode == "min"
                                                   else value > self.best))
        if better:
            self.best, self.best_epoch, self.bad_epochs = float(value), epoch, 0
            self.best_step = step
        else:
            self.bad_epochs += 1
        if self.patience is not None and self.bad_epochs >= self.patience:
            self.stopped_early = True
        report_at = epoch if step is None else step - 1  # should_prune reports at +1
        if self.trial is not None and self.trial.should_prune(value, report_at, final):
            self.stopped_early, self.pruned_at_epoch = True, epoch + 1
        return better

    def stop_line(self, epochs: int) -> str:
        """Why the run stops (for the log)."""
        best = "none" if self.best is None else f"{self.best:.6g}"
        epoch = "-" if self.best_epoch is None else self.best_epoch + 1
        if self.best_step is not None:  # validation by steps: patience counts validations
            return (f"early stopping: {self.metric} has not improved ({self.mode}) for "
                    f"{self.bad_epochs} validation(s), trainer.early_stopping_patience="
                    f"{self.patience}; best {best} at step {self.best_step} (epoch {epoch}); "
                    "every rank stops here") if self.pruned_at_epoch is None else (
                f"pruned: the sweep's pruner stops this trial in epoch {self.pruned_at_epoch} "
                f"({self.metric} best {best} at step {self.best_step}); every rank stops here")
        if self.pruned_at_epoch is not None:
            return (f"pruned: the sweep's pruner stops this trial after epoch "
                    f"{self.pruned_at_epoch}/{epochs} ({self.metric} best {best} at epoch "
                    f"{epoch}); every rank stops here")
        return (f"early stopping: {self.metric} has not improved ({self.mode}) for "
                f"{self.bad_epochs} epoch(s), trainer.early_stopping_patience={self.patience}; "
                f"best {best} at epoch {epoch}/{epochs}; every rank stops here")

    def results(self) -> dict[str, Any]:
        """``best/<monitor>``, ``best/epoch`` (1-based, as in the log and metrics.json's
        ``epoch``) and ``stopped_early``, for metrics.json."""
        out: dict[str, Any] = {"stopped_early": self.stopped_early}
        if self.trial is not None:  # a ddp_optuna trial: pruned or not (null)
            out["pruned_at_epoch"] = self.pruned_at_epoch
        if self.metric is not None:
            out[f"best/{self.metric}"] = self.best
            out["best/epoch"] = None if self.best_epoch is None else self.best_epoch + 1
            if self.best_step is not None:  # validation by steps
                out["best/step"] = self.best_step
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "mode": self.mode, "best": self.best,
                "best_epoch": self.best_epoch, "best_step": self.best_step,
                "bad_epochs": self.bad_epochs,
                "stopped_early": self.stopped_early, "pruned_at_epoch": self.pruned_at_epoch}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Continue counting from a checkpoint's state (kept only if it watched the same
        metric the same way)."""
        if not state or (state.get("metric"), state.get("mode")) != (self.metric, self.mode):
            return
        self.best, self.best_epoch = state["best"], state["best_epoch"]
        self.bad_epochs, self.stopped_early = state["bad_epochs"], state["stopped_early"]
        self.pruned_at_epoch = state.get("pruned_at_epoch")
        self.best_step = state.get("best_step")
