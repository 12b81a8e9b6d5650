"""Learning-rate schedules: the ``scheduler`` config group, built from torch's scheduler classes.

Options (``conf/scheduler/``):

* ``none``: a constant learning rate; no scheduler object, no call per step.
* ``cosine``: linear warmup over ``scheduler.warmup_steps`` optimizer steps, then cosine decay to
  ``scheduler.min_lr`` at the last optimizer step of the run. With ``T`` steps in the run,
  ``W`` warmup steps and base learning rate ``lr`` (the effective one, see
  :func:`ddp_exp.config.checks.effective_lr`), optimizer step ``k = 1..T`` uses::

      lr_k = lr * k / W                                              for k <= W
      lr_k = min_lr + (lr - min_lr) * (1 + cos(pi * (k - W) / (T - W))) / 2   for k > W

  so step ``W`` is at the peak and step ``T`` is exactly at ``min_lr`` (the SGDR / "cosine
  with warmup" schedule of Loshchilov & Hutter 2017 and Goyal et al. 2017, warmup counted from
  1 so that no step runs at lr 0). It is one ``torch.optim.lr_scheduler.LambdaLR`` whose factor
  is computed from the step count, not chained ``LinearLR`` + ``CosineAnnealingLR`` through
  ``SequentialLR``: the chained form updates the lr recursively (rounding accumulates) and
  ``SequentialLR`` calls ``step(0)`` (deprecated), while the closed form resumes exactly from
  ``last_epoch`` alone.
* ``step``: ``torch.optim.lr_scheduler.StepLR``: lr times ``scheduler.gamma`` every
  ``scheduler.step_size_epochs`` epochs.
* any ``torch.optim.lr_scheduler`` class (or your own) through ``scheduler._target_``, with its
  options as ``+scheduler.<name>=...``; it receives the optimizer, and ``total_steps`` when it
  takes one and the config does not set it (``OneCycleLR``). ``ReduceLROnPlateau`` is stepped
  with the monitored validation value (``trainer.monitor``) once per epoch.

``scheduler.interval`` (``step`` | ``epoch``) says when the scheduler is stepped: once per
optimizer step (never per micro-batch: accumulation steps it once per group), or once per epoch
after validation. The run's step count ``T`` (:func:`total_steps`) knows ``trainer.max_steps``,
``trainer.accumulate_grad_batches`` and the world's steps per epoch.

**Resuming** (:func:`resume_steps`, :func:`enter`): a schedule is never loaded from a checkpoint.
It is rebuilt from the resumed run's config and length (its epochs, world size, batch size,
accumulation) and entered where the checkpoint's last epoch ended, ``start = epochs done x steps
per epoch`` optimizer steps in (``epochs done`` per-epoch steps for ``interval=epoch``): the
rest of the run follows the schedule of an uninterrupted run with the new settings, and ends
where it ends (``cosine`` at ``min_lr``), and a changed schedule key (``warmup_steps``,
``min_lr``, ``step_size_epochs``, ``max_lr`` ...) takes effect. A scheduler is entered by
stepping it ``start`` times (``LambdaLR``, whose rate is a closed form of its step count, by one
step), so any scheduler whose state is a function of its step count continues exactly, as every
``torch.optim.lr_scheduler`` class does; ``ReduceLROnPlateau``, whose state follows the
monitored values, keeps the checkpoint's progress (best value, bad epochs, cooldown, reduced
rate) under the new config's keys. A ``scheduler.total_steps`` set in the config that is
shorter than the run is refused before any rank starts (:func:`check_length`).

Uses :mod:`ddp_exp.config` (errors, building a ``_target_``) and :mod:`ddp_exp.train.models`
(locating
a class); the launcher's checks and the loop use it.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ddp_exp.config.errors import ConfigError
from ddp_exp.config.targets import instantiate_node, locate
from ddp_exp.config.view import RankConfig

OWN_KEYS = ("interval",)  # ours, not arguments of the scheduler


def steps_per_epoch(n_train: int, world_size: int, batch_size: int, accumulate: int) -> int:
    """Optimizer steps per epoch: every rank gets ``ceil(n_train / world_size)`` samples
    (DistributedSampler pads), in ``ceil(. / batch_size)`` batches, grouped by ``accumulate``."""
    batches = math.ceil(math.ceil(n_train / world_size) / batch_size)
    return math.ceil(batches / accumulate)


def total_steps(epochs: int, max_steps: int | None, per_epoch: int) -> int:
    """Optimizer steps of the whole run: ``epochs * per_epoch``, capped by ``max_steps``."""
    steps = epochs * per_epoch
    return steps if max_steps is None else min(steps, max_steps)


def resume_steps(epochs_done: int, global_step: int, epochs: int, max_steps: int | None,
                 per_epoch: int) -> tuple[int, int]:
    """Where a resumed run enters its schedule: ``(start, total)`` in this run's optimizer
    steps (see the module docstring).

    ``start = epochs_done * per_epoch``: the steps an uninterrupted run with this run's
    settings has taken when the checkpoint's last epoch ends. ``total`` is that run's
    :func:`total_steps`; ``trainer.max_steps`` counts the steps the resumed run has taken
    (``global_step``, the checkpoint's included), so a ``max_steps`` cap ends the schedule at
    ``start + max_steps - global_step``, the step where the loop stops. Without a change of
    steps per epoch, ``start == global_step`` and ``total`` is :func:`total_steps`.

    Args:
        epochs_done: the checkpoint's completed epochs (its ``epoch`` + 1).
        global_step: the checkpoint's optimizer steps.
        epochs, max_steps: ``trainer.epochs`` and ``trainer.max_steps`` of the resumed run.
        per_epoch: the resumed run's :func:`steps_per_epoch`.
    """
    start = epochs_done * per_epoch
    cap = None if max_steps is None else start + max_steps - global_step
    return start, total_steps(epochs, cap, per_epoch)


def cosine_factor(base_lr: float, warmup_steps: int, total: int, min_lr: float
                  ) -> Callable[[int], float]:
    """The factor ``lr_k / lr`` of the cosine schedule (module docstring) as LambdaLR calls
    it: with the number of steps already taken, ``i = k - 1``.

    A plain function (a closure) of the step count alone: LambdaLR's rate is then a closed
    form that :func:`enter` reaches in one step when a run resumes, over the resumed run's
    length (a run resumed with more epochs decays over its new length).
    """

    def factor(i: int) -> float:
        if base_lr == 0:
            return 0.0
        k = min(i + 1, total)
        if k <= warmup_steps:
            return k / warmup_steps
        progress = (k - warmup_steps) / (total - warmup_steps)
        return (min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))) / base_lr

    return factor


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                  min_lr: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """The ``cosine`` option: ``LambdaLR`` with one :func:`cosine_factor` per param group.

    Args:
        optimizer: the optimizer, at its base learning rate(s).
        total_steps: optimizer steps in the run (``T``).
        warmup_steps: ``W``, 0 <= W < T.
        min_lr: the learning rate of the last step (absolute, not a factor).
    """
    factors = [cosine_factor(group["lr"], warmup_steps, total_steps, min_lr)
               for group in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factors)


def step_decay(optimizer: torch.optim.Optimizer, step_size_epochs: int, gamma: float = 0.1,
               steps_per_epoch: int = 1, interval: str = "epoch"
               ) -> torch.optim.lr_scheduler.StepLR:
    """The ``step`` option: ``StepLR``, lr times ``gamma`` every ``step_size_epochs`` epochs
    (counted in optimizer steps when ``interval=step``)."""
    size = step_size_epochs * (steps_per_epoch if interval == "step" else 1)
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=size, gamma=gamma)


def build_scheduler(node: Mapping[str, Any] | None, optimizer: torch.optim.Optimizer,
                    run_steps: int, per_epoch: int) -> tuple[Any, str]:
    """Build ``cfg.scheduler`` for ``optimizer``; returns ``(scheduler or None, interval)``.

    Our builders and torch's classes get ``optimizer``; ``total_steps``, ``steps_per_epoch``
    and ``interval`` are passed to a target whose signature takes them (unless set in the
    config). A ``total_steps`` is in units of the interval: optimizer steps, or epochs.

    Raises:
        ConfigError: the target cannot be built, or does not make an LR scheduler.
    """
    if not node or node.get("_target_") is None:
        return None, "step"
    interval = node.get("interval", "step")
    args = {k: v for k, v in node.items() if k not in OWN_KEYS}
    target = locate(str(args["_target_"]), "scheduler._target_")
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        params = {}
    context = {"total_steps": run_steps if interval == "step" else math.ceil(
        run_steps / max(per_epoch, 1)), "steps_per_epoch": per_epoch, "interval": interval}
    extra = {k: v for k, v in context.items() if k in params and k not in args}
    scheduler = instantiate_node(args, "scheduler", optimizer=optimizer, **extra)
    if not hasattr(scheduler, "step") or not hasattr(scheduler, "state_dict"):
        raise ConfigError(f"scheduler._target_={args['_target_']!r} built a "
                          f"{type(scheduler).__name__}, not a torch LR scheduler")
    check_length(scheduler, context["total_steps"], interval)
    return scheduler, interval


def check_length(scheduler: Any, run_length: int, interval: str) -> None:
    """Refuse a scheduler built for fewer steps than the run takes (``OneCycleLR`` with a
    ``scheduler.total_steps`` of its own: torch raises "Tried to step N times" at the step
    after its last, inside the ranks).

    Args:
        run_length: the run's steps in units of ``interval``: optimizer steps, or epochs.

    Raises:
        ConfigError: naming ``scheduler.total_steps``, its value and the run's length.
    """
    own = getattr(scheduler, "total_steps", None)
    if isinstance(own, int) and own < run_length:
        unit = "optimizer step" if interval == "step" else "epoch"
        raise ConfigError(f"scheduler.total_steps={own} is shorter than this run's "
                          f"{run_length} {unit}(s) (scheduler.interval={interval}); remove it "
                          f"(the run's length is passed when it is not set) or set it to "
                          f">= {run_length}")


# What ReduceLROnPlateau has learnt from the monitored values (torch 2.13's attribute names);
# everything else in its state_dict is configuration, which the resumed run's config gives.
PLATEAU_PROGRESS = ("best", "num_bad_epochs", "cooldown_counter", "last_epoch")


def enter(scheduler: Any, steps: int, saved: Mapping[str, Any] | None = None) -> None:
    """Bring a scheduler built by :func:`build_scheduler` (step count 0) to ``steps`` steps
    taken, as a resumed run enters its schedule (module docstring; ``steps``: ``start`` of
    :func:`resume_steps`, or the epochs done for ``interval=epoch``). Sets the optimizer's
    learning rates as the scheduler does.

    ``ReduceLROnPlateau`` is not stepped: it takes :data:`PLATEAU_PROGRESS` from ``saved``
    (the checkpoint's scheduler state; ``best`` only when ``mode`` is the same); its reduced
    rate is the optimizer's, which the caller restores.

    Raises:
        Exception: whatever the scheduler's ``step()`` raises (the caller names it).
    """
    if is_plateau(scheduler):
        if saved:
            for name in PLATEAU_PROGRESS:
                if name in saved and (name != "best" or saved.get("mode") == scheduler.mode):
                    setattr(scheduler, name, saved[name])
        return
    if steps <= 0:
        return
    with warnings.catch_warnings():  # these steps come before this run's first optimizer.step()
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step",
                                category=UserWarning)
        if type(scheduler) is torch.optim.lr_scheduler.LambdaLR:
            # LambdaLR's rate is base_lr * factor(last_epoch), a closed form: one step
            # computes it at ``steps``, as ``steps`` steps would.
            scheduler.last_epoch += steps - 1
            scheduler.step()
        else:
            for _ in range(steps):
                scheduler.step()


def is_plateau(scheduler: Any) -> bool:
    """``ReduceLROnPlateau`` steps with a metric value, once per epoch."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def step_epoch(scheduler: Any, val: Mapping[str, Any], metric: str | None) -> None:
    """Step a per-epoch scheduler once, after the epoch's validation: ``ReduceLROnPlateau``
    with the monitored reduced value ``val[metric]`` (the same on every rank; not stepped when
    it is missing), any other without an argument."""
    if is_plateau(scheduler):
        value = val.get(metric)
        if value is not None:
            scheduler.step(value)
    else:
        scheduler.step()


def check(cfg: RankConfig, run_steps: int) -> None:
    """Relations of ``cfg.scheduler`` to the run that need the data's size (called by the
    launcher before any rank starts and by a resuming rank, each with its typed config).

    Raises:
        ConfigError: ``scheduler.warmup_steps`` not shorter than the run, ``interval=epoch``
            with ``cosine``, ``ReduceLROnPlateau`` per step or without a monitored metric.
    """
    target = cfg.scheduler._target_
    if target is None:
        return
    interval = cfg.scheduler.interval  # step | epoch: checked by ddp_exp.config.ranges
    if target == "ddp_exp.train.schedule.warmup_cosine":
        warmup = getattr(cfg.scheduler, "warmup_steps", 0)  # CosineSchedulerConfig's
        if interval != "step":
            raise ConfigError("scheduler.interval=epoch is invalid with scheduler=cosine: its "
                              "warmup and decay count optimizer steps (interval: step)")
        if not isinstance(warmup, int) or warmup < 0 or warmup >= run_steps:
            raise ConfigError(f"scheduler.warmup_steps={warmup!r} is invalid: this run has "
                              f"{run_steps} optimizer step(s), so 0..{run_steps - 1} (warmup "
                              "must end before the cosine decay's last step)")
    if target.endswith("ReduceLROnPlateau"):
        if interval != "epoch" or not cfg.trainer.monitor:
            raise ConfigError("scheduler._target_=ReduceLROnPlateau needs scheduler.interval="
                              "epoch and a trainer.monitor (it steps with the monitored value)")
