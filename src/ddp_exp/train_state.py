"""The loop's state in a checkpoint: what ``last.pt`` and ``best.pt`` hold of a running loop
(the same: ``best.pt`` is the best epoch's checkpoint), when each is written, and how a loop
continues exactly from one.

A resumable checkpoint holds the unwrapped model, the optimizer, scheduler, grad-scaler and
monitor states, the last completed ``epoch`` (0-based), ``global_step``, the open ``train/loss``
interval, every rank's RNG states and the resolved config (the sampler's order is a function
of seed and epoch, so nothing of the data is stored). The files themselves (layout, atomic
writes, loading, the split check) are :mod:`ddp_exp.checkpoint`'s.

Each function takes the loop, a :class:`ddp_exp.train.Trainer` (read through the attributes
named in its docstring; this module does not import the loop). Uses :mod:`ddp_exp.checkpoint`
and :mod:`ddp_exp.config` (errors).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ddp_exp import checkpoint
from ddp_exp.config import ConfigError

log = logging.getLogger("ddp_exp.train")  # the loop's lines, under one name (as ddp_exp.progress)


def state_dict(loop: Any) -> dict[str, Any]:
    """Everything needed to continue ``loop`` exactly; a collective (gathers every rank's RNG).

    Reads the loop's ``model``, ``optimizer``, ``scheduler``, ``monitor``, ``scaler``,
    ``epoch`` (the next one to run), ``global_step``, ``window`` (the open ``train/loss``
    interval), ``world``, ``device`` and ``cfg``.
    """
    import torch.distributed as dist

    rng = {"torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state(loop.device) if loop.device.type == "cuda"
           else None}
    ranks_rng: list[Any] = [None] * loop.world.world_size
    if dist.is_initialized() and loop.world.world_size > 1:
        dist.all_gather_object(ranks_rng, rng)
    else:
        ranks_rng = [rng]
    return {
        "model": loop.model.state_dict(),
        "optimizer": loop.optimizer.state_dict(),
        "scheduler": loop.scheduler.state_dict() if loop.scheduler is not None else None,
        "monitor": loop.monitor.state_dict(),
        "scaler": loop.scaler.state_dict() if loop.scaler is not None else None,
        "epoch": loop.epoch - 1,  # the last completed epoch, 0-based
        "global_step": loop.global_step,
        "world_size": loop.world.world_size,
        # The open train/loss interval (world sums): a resumed run logs it like one never
        # interrupted.
        "train_interval": [loop.window.interval_sum, loop.window.interval_count,
                           loop.window.interval_s],
        "rng": ranks_rng,
        "config": loop.cfg,
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


def load_state_dict(loop: Any, state: dict[str, Any], source: str) -> None:
    """Continue ``loop`` from a checkpoint written by :func:`state_dict` (same model and
    optimizer; ``source``: its path, for messages). Every rank's RNG streams continue when the
    world has the checkpoint's size.

    Raises:
        ConfigError: the checkpoint's model or optimizer does not fit this run. (A checkpoint
            that is not resumable was refused before any rank: :func:`check_resumable`.)
    """
    try:
        loop.model.load_state_dict(state["model"])
        loop.optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise ConfigError(f"trainer.resume={source!r}: the checkpoint does not fit this "
                          f"model/optimizer ({str(exc).splitlines()[0][:200]})") from None
    if state.get("scaler") and loop.scaler is not None:
        loop.scaler.load_state_dict(state["scaler"])
    if state.get("scheduler") and loop.scheduler is not None:
        loop.scheduler.load_state_dict(state["scheduler"])
    loop.monitor.load_state_dict(state.get("monitor"))
    loop.epoch = state["epoch"] + 1
    loop.global_step = state["global_step"]
    if state.get("train_interval"):
        total, count, seconds = state["train_interval"]
        loop.window.interval_sum, loop.window.interval_count = float(total), int(count)
        loop.window.interval_s = float(seconds)
    ranks_rng = state.get("rng") or []
    if len(ranks_rng) == loop.world.world_size:  # same world: continue every rank's stream
        mine = ranks_rng[loop.world.rank]
        # RNG states are CPU byte tensors, whatever map_location moved them to.
        torch.set_rng_state(mine["torch"].cpu())
        if mine.get("cuda") is not None and loop.device.type == "cuda":
            torch.cuda.set_rng_state(mine["cuda"].cpu(), loop.device)
    log.info("resumed from %s: epoch %d done, step %d", source, state["epoch"] + 1,
             loop.global_step)


def save_checkpoint(loop: Any, best: bool = False, complete: bool = True) -> None:
    """Every rank calls it after an epoch (``loop.epoch`` already counts it); rank 0 writes
    the epoch's checkpoint once, under each name it is due (see
    :func:`ddp_exp.checkpoint.save`): ``last.pt`` (``trainer.save_last``), every
    ``trainer.checkpoint_every_n_epochs`` epochs the epoch's file, and ``best.pt`` when
    ``best`` (the epoch is the monitor's new best), on ``loop.checkpoint_files``'s thread (a
    :class:`ddp_exp.files.BackgroundWriter`).

    ``complete=False``: the epoch stopped at ``trainer.max_steps``; continuing from it could not
    be exact, so only ``best.pt`` is written (if due), marked ``resumable: False``.
    """
    trainer = loop.cfg["trainer"]
    every = trainer["checkpoint_every_n_epochs"]
    keep_epoch_file = complete and every > 0 and loop.epoch % every == 0
    last = complete and trainer["save_last"]
    if not (last or keep_epoch_file or best):
        return
    state = state_dict(loop)  # a collective: every rank
    if not complete:
        state["resumable"] = False
    if loop.world.is_main:
        checkpoint.save(loop.writer.job_dir, state, keep_epoch_file, trainer["keep_checkpoints"],
                        loop.checkpoint_files, last=last, best=best)
