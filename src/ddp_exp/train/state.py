"""The loop's state in a checkpoint: what ``last.pt`` and ``best.pt`` hold of a running loop
(the same: ``best.pt`` is the best epoch's checkpoint), when each is written, and how a loop
continues exactly from one.

A resumable checkpoint holds the unwrapped model, the optimizer, scheduler, grad-scaler and
monitor states, the last completed ``epoch`` (0-based), ``global_step``, the open ``train/loss``
interval, every rank's RNG states and the resolved config (the sampler's order is a function
of seed and epoch, so nothing of the data is stored). The files themselves (layout, atomic
writes, loading, the split check) are :mod:`ddp_exp.io.checkpoint`'s.

Each function takes the loop, a :class:`ddp_exp.train.loop.Trainer` (read through the attributes
named in its docstring; this module does not import the loop), but :func:`resume_optimizer`,
which the launcher's check shares. Taking and landing a checkpoint is
:mod:`ddp_exp.train.checkpointing`'s. Uses :mod:`ddp_exp.io.checkpoint`,
:mod:`ddp_exp.train.schedule` (a resumed run's schedule),
:mod:`ddp_exp.distributed.process_group` (the ranks' RNG states) and :mod:`ddp_exp.config`
(errors, the learning rate).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ddp_exp.config.checks import effective_lr
from ddp_exp.config.errors import ConfigError, described, first_line
from ddp_exp.config.view import RankConfig
from ddp_exp.distributed.process_group import gather_rng_states
from ddp_exp.io import checkpoint, sharded
from ddp_exp.train import schedule
from ddp_exp.train.strategy import held

if TYPE_CHECKING:
    from ddp_exp.train.training_loop import TrainingLoop

log = logging.getLogger("ddp_exp.train")  # the loop's lines, under one name


def state_dict(loop: TrainingLoop, rng: list[dict[str, Any]] | None = None, position: int = 0,
               epoch_sums: tuple[float, int, float] | None = None, weights: bool = True
               ) -> dict[str, Any]:
    """Everything needed to continue ``loop`` exactly; a collective (gathers every rank's RNG),
    unless ``rng`` gives the ranks' RNG states (or a placeholder the caller fills in:
    :func:`ddp_exp.train.checkpointing.take`, which every checkpoint goes through).

    Reads the loop's ``model``, ``optimizer``, ``scheduler``, ``monitor``, ``scaler``,
    ``epoch`` (the next one to run, or the one in progress), ``global_step``, ``window`` (the
    open ``train/loss`` interval), ``world``, ``device``, ``cfg``, ``steps_per_epoch``,
    ``run_steps``. A step checkpoint gives ``position`` (global samples the epoch in progress
    has consumed; 0 at an epoch's end) and ``epoch_sums`` (that epoch's world loss sum,
    samples and seconds so far). ``weights=False`` leaves out ``model`` and ``optimizer`` (a
    sharded checkpoint's ranks write them: :mod:`ddp_exp.io.sharded`).
    """
    ranks_rng = gather_rng_states(loop.device) if rng is None else rng  # a collective
    # The resolved config as JSON text encoded once per run (one object to pickle, not ~170
    # every checkpoint); the dict itself where JSON would change it. checkpoint.load gives
    # "config" back either way (weights_only=True loads both).
    text = loop.cfg.stored_json
    config = {checkpoint.CONFIG_JSON: text} if text is not None else {"config": loop.cfg.stored}
    # Full tensors in the plain layouts, whichever the strategy (ddp_exp.train.strategy):
    # FSDP gathers them (a collective; rank 0 holds them).
    tensors = {"model": held(loop).model_state(),
               "optimizer": held(loop).optimizer_state(loop.optimizer)} if weights else {}
    return {
        **tensors,
        "scheduler": loop.scheduler.state_dict() if loop.scheduler is not None else None,
        "monitor": loop.monitor.state_dict(),
        "scaler": loop.scaler.state_dict() if loop.scaler is not None else None,
        "epoch": loop.epoch - 1,  # the last completed epoch, 0-based
        "global_step": loop.global_step,
        "world_size": loop.world.world_size,
        # Inside epoch ``epoch + 1`` (a step checkpoint): the samples it has consumed, the same
        # number for any world size with this global batch (issue 30), and its sums so far.
        "position": position,
        "epoch_sums": list(epoch_sums) if epoch_sums is not None else None,
        "global_batch_size": loop.cfg.global_batch_size,
        # The run's length as its schedule saw it (a resume names what changed).
        "steps_per_epoch": loop.steps_per_epoch,
        "run_steps": loop.run_steps,
        # The open train/loss interval (world sums): a resumed run logs it like one never
        # interrupted.
        "train_interval": [loop.window.interval_sum, loop.window.interval_count,
                           loop.window.interval_s],
        "rng": ranks_rng,
        **config,
        # The last epoch's train loss and samples: metrics.json of a run resumed after its final
        # epoch (only the end left to do) reports them as the uninterrupted run does.
        "last_train": list(loop.last_train),
    }


def check_resumable(state: dict[str, Any], source: str) -> None:
    """Refuse to continue from a checkpoint written mid-epoch (a ``best.pt`` of an epoch that
    ``trainer.max_steps`` stopped part-way: ``resumable: False``).

    Raises:
        ConfigError: one line naming ``source`` and what to resume from instead.
    """
    if state.get("resumable") is False:
        raise ConfigError(f"trainer.resume={source!r}: written when trainer.max_steps stopped "
                          f"the epoch part-way, so continuing from it could not be exact; "
                          f"resume from that run's checkpoints/last.pt")


def resume_optimizer(cfg: RankConfig, state: dict[str, Any],
                     optimizer: torch.optim.Optimizer, per_epoch: int, resume: str,
                     load: Callable[[torch.optim.Optimizer, dict[str, Any]], None] | None = None
                     ) -> tuple[Any, str, int]:
    """Continue the checkpoint's optimizer under this run's config and enter this run's
    schedule where the checkpoint left off: the launcher's check before any rank starts and
    every rank's resume run this same function.

    Loads ``state["optimizer"]`` (its moments and step counts, and its param groups' other
    hyper-parameters), then gives every param group this run's learning rate
    (:func:`ddp_exp.config.checks.effective_lr`: ``optim.lr`` scaled by the global batch, which a
    world of another size changes) and rebuilds ``cfg.scheduler`` over this run's length,
    entered at :func:`ddp_exp.train.schedule.resume_steps`'s start
    (:func:`ddp_exp.train.schedule.enter`;
    the checkpoint's scheduler state is not loaded, so the new config's scheduler keys govern).
    ``ReduceLROnPlateau`` keeps the rate it had reduced to, times the ratio of this run's
    learning rate to the checkpoint's.

    Args:
        cfg: this run's typed config (:class:`ddp_exp.config.view.RankConfig`), its
            ``world_size`` the running world's.
        state: the checkpoint (:func:`state_dict`).
        optimizer: built from ``cfg`` over the model's parameters.
        per_epoch: this run's optimizer steps per epoch.
        resume: ``trainer.resume`` as given (named in messages).
        load: loads the plain state into ``optimizer`` (the strategy's: FSDP shards it);
            None: ``optimizer.load_state_dict``.

    Returns:
        ``(scheduler or None, interval, run_steps)``: ``run_steps`` is the schedule's length.

    Raises:
        ConfigError: the optimizer state does not fit (written by another optimizer), or the
            scheduler does not fit this run (:func:`ddp_exp.train.schedule.check`,
            :func:`ddp_exp.train.schedule.check_length`) or raises while it is entered.
    """
    try:
        if load is None:
            optimizer.load_state_dict(state["optimizer"])
        else:  # a sharded checkpoint's loader reads its folder (no "optimizer" entry)
            load(optimizer, state.get("optimizer"))
    except (RuntimeError, ValueError, KeyError) as exc:
        raise ConfigError(f"trainer.resume={resume!r}: the checkpoint's optimizer state does "
                          f"not fit optim ({cfg.optim._target_}; {described(exc, 200)})"
                          ) from None
    reached = [group["lr"] for group in optimizer.param_groups]
    base = cfg.effective_lr
    for group in optimizer.param_groups:  # a fresh scheduler takes its base from "lr"
        group.pop("initial_lr", None)
        group["lr"] = base
    trainer = cfg.trainer
    epochs_done = state["epoch"] + 1
    start, run_steps = schedule.resume_steps(epochs_done, state["global_step"],
                                             trainer.epochs, trainer.max_steps, per_epoch)
    inside = steps_into_epoch(cfg.global_batch_size, cfg.world_size, state, resume,
                              resume if resume != "auto" else None)
    if inside:  # a step checkpoint: this run's steps of the epoch in progress are done too
        start += inside
        if trainer.max_steps is not None:
            run_steps = schedule.total_steps(
                trainer.epochs, start + trainer.max_steps - state["global_step"],
                per_epoch)
    schedule.check(cfg, run_steps)
    scheduler, interval = schedule.build_scheduler(cfg.targets.scheduler, optimizer, run_steps,
                                                   per_epoch)
    if scheduler is None:
        return None, interval, run_steps
    try:
        schedule.enter(scheduler, start if interval == "step" else epochs_done,
                       state.get("scheduler"))
    except Exception as exc:  # a user's scheduler that cannot take that many steps
        raise ConfigError(f"trainer.resume={resume!r}: scheduler ({type(scheduler).__name__}) "
                          f"failed entering this run's schedule at step {start} of {run_steps}:"
                          f" {described(exc, 200)}") from None
    if schedule.is_plateau(scheduler):  # its rate is its state: the checkpoint's, rescaled
        saved_cfg = state.get("config")
        before = effective_lr(saved_cfg) if saved_cfg else base
        for group, lr in zip(optimizer.param_groups, reached, strict=True):
            group["lr"] = lr * (base / before) if before else lr
    return scheduler, interval, run_steps


def sharded_optimizer_loader(folder: str, module: torch.nn.Module, no_dist: bool = False
                             ) -> Callable[[torch.optim.Optimizer, Any], None]:
    """A ``load`` for :func:`resume_optimizer` that reads the optimizer state of the sharded
    checkpoint ``folder`` (:func:`ddp_exp.io.sharded.load_optimizer`) over ``module``."""
    return lambda optimizer, _: sharded.load_optimizer(folder, module, optimizer, no_dist)


def exact_batch_advice(saved: int | None, world_size: int) -> str:
    """How a run with global batch ``saved`` continues exactly in a world of ``world_size``
    ranks, as advice that is accepted: ``data.global_batch_size=<saved>`` when the world
    divides it (the per-rank batch and accumulation follow, whatever
    ``data.max_batch_size_per_rank``), else the world sizes that divide it."""
    if not saved:
        return "resume at the checkpoint's global batch"
    if saved % world_size == 0:
        return f"data.global_batch_size={saved}"
    sizes = [str(n) for n in range(1, saved + 1) if saved % n == 0]
    listed = sizes[0] if len(sizes) == 1 else f"{', '.join(sizes[:-1])} or {sizes[-1]}"
    return (f"{world_size} ranks cannot divide its global batch of {saved}: world_size="
            f"{listed} with data.global_batch_size={saved}")


def steps_into_epoch(global_batch: int, world_size: int, state: dict[str, Any], resume: str,
                     source: str | None = None) -> int:
    """The optimizer steps a step checkpoint's epoch has taken, in this run's global batch:
    ``position / global batch`` (0 for a checkpoint at an epoch's end). The position is
    global samples consumed, the same in a world of any size with the same global batch
    (issue 30): with another global batch the rest of the epoch could not be cut into the
    same batches, so it is refused.

    The refusal's advice is accepted advice: ``data.global_batch_size`` only where this
    world divides it, else the world sizes that can (:func:`exact_batch_advice`), and a
    checkpoint at an epoch's end only where one exists beside ``source`` (the checkpoint's
    path; None: none named).

    Args:
        global_batch: this run's global batch (samples per optimizer step over the world).
        world_size: this run's world size.

    Raises:
        ConfigError: this run's global batch differs from the step checkpoint's.
    """
    position = state.get("position") or 0
    if not position:
        return 0
    now, saved = global_batch, state.get("global_batch_size")
    if saved != now:
        epoch_file = checkpoint.newest_epoch_file(source) if source else None
        advice = exact_batch_advice(saved, world_size)
        advice = (f"resume with {advice}" if advice.startswith("data.") else advice)
        if epoch_file:
            advice += f"; or resume from a checkpoint at an epoch's end ({epoch_file})"
        raise ConfigError(f"trainer.resume={resume!r}: a step checkpoint inside epoch "
                          f"{state['epoch'] + 2} (global batch {saved}); this run's global "
                          f"batch is {now}: {advice}")
    return position // now


def load_state_dict(loop: TrainingLoop, state: dict[str, Any], source: str) -> None:
    """Continue ``loop`` from a checkpoint written by :func:`state_dict` (same model and
    optimizer; ``source``: its path, for messages). Every rank's RNG streams continue when the
    world has the checkpoint's size. The optimizer and the schedule continue under this run's
    config and length (:func:`resume_optimizer`): the loop's ``scheduler``,
    ``step_scheduler`` and ``run_steps`` are replaced.

    Raises:
        ConfigError: the checkpoint's model or optimizer does not fit this run. (A checkpoint
            that is not resumable was refused before any rank: :func:`check_resumable`.)
    """
    folder = state.get("shards")  # a sharded checkpoint: every rank reads its slices
    module = held(loop).module
    try:
        if folder:
            sharded.load_model(folder, module)
        else:
            held(loop).load_model_state(state["model"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise ConfigError(f"trainer.resume={source!r}: the checkpoint does not fit this "
                          f"model ({first_line(exc, 200, type(exc).__name__)})") from None
    loop.scheduler, interval, loop.run_steps = resume_optimizer(
        loop.cfg, state, loop.optimizer, loop.steps_per_epoch, source,
        sharded_optimizer_loader(folder, module) if folder
        else held(loop).load_optimizer_state)
    loop.step_scheduler = loop.scheduler if interval == "step" else None
    loop.step_lr = loop.optimizer.param_groups[0]["lr"]
    if state.get("scaler") and loop.scaler is not None:
        loop.scaler.load_state_dict(state["scaler"])
    loop.monitor.load_state_dict(state.get("monitor"))
    loop.epoch = state["epoch"] + 1
    loop.global_step = state["global_step"]
    # Inside that epoch (a step checkpoint): the loop starts it at the position.
    loop.position = state.get("position") or 0
    loop.epoch_sums = tuple(state["epoch_sums"]) if state.get("epoch_sums") else None
    if state.get("train_interval"):
        total, count, seconds = state["train_interval"]
        loop.window.interval_sum, loop.window.interval_count = float(total), int(count)
        loop.window.interval_s = float(seconds)
    if state.get("last_train"):
        loss, samples = state["last_train"]
        loop.last_train = (None if loss is None else float(loss), int(samples))
    ranks_rng = state.get("rng") or []
    if len(ranks_rng) == loop.world.world_size:  # same world: continue every rank's stream
        mine = ranks_rng[loop.world.rank]
        # RNG states are CPU byte tensors, whatever map_location moved them to.
        torch.set_rng_state(mine["torch"].cpu())
        if mine.get("cuda") is not None and loop.device.type == "cuda":
            torch.cuda.set_rng_state(mine["cuda"].cpu(), loop.device)
    if loop.position:
        log.info("resumed from %s: step %d, inside epoch %d (%d samples of it consumed)",
                 source, loop.global_step, loop.epoch + 1, loop.position)
    else:
        log.info("resumed from %s: epoch %d done, step %d", source, state["epoch"] + 1,
                 loop.global_step)
