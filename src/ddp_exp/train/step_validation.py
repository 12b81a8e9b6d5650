"""Validation every ``trainer.val_every_n_steps`` global steps, and what hangs on it.

On a real corpus an epoch is hours: nanoGPT (``eval_interval``), Lightning
(``val_check_interval``) and HF Trainer (``eval_steps``) validate by steps. With the key set,
every rank validates after each global step that is a multiple of it (a function of the
global step alone, so a run resumed from a step checkpoint at any world size validates at the
same steps) and, once more, at the run's last step if that is no multiple: the same exact
reduction as the per-epoch validation (:class:`ddp_exp.train.evaluation.Evaluator`, ``val/*``
at x = the global step), then, per validation: the log line, the monitor
(:mod:`ddp_exp.train.monitor`: best value and step, patience counted in validations, a sweep's
pruner told at the global step), ``checkpoints/best.pt`` at a new best (the loop's state at
that step, marked not resumable as a partial epoch's best is: it holds the weights), and
data=tokens' text sample. The epoch's end then validates nothing more.

Each function takes the loop, a :class:`ddp_exp.train.loop.Trainer` (``cfg``, ``epoch``,
``global_step``, ``evaluator``, ``monitor``, ``lm``, and ``last_val``, ``last_val_step``,
``validations``, which they set); this module does not import the loop.

May use: :mod:`ddp_exp.train.checkpointing` (``best.pt``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ddp_exp.train import checkpointing

if TYPE_CHECKING:
    from ddp_exp.train.training_loop import TrainingLoop

log = logging.getLogger("ddp_exp.train")


def every(loop: TrainingLoop) -> int | None:
    """``trainer.val_every_n_steps`` (None: validation after each epoch)."""
    return getattr(loop.cfg.trainer, "val_every_n_steps", None)


def due(loop: TrainingLoop) -> bool:
    """Whether the step just taken is a validation step."""
    n = every(loop)
    return bool(n) and loop.global_step % n == 0 and loop.last_val_step != loop.global_step


def validate(loop: TrainingLoop, final: bool = False) -> dict[str, Any]:
    """Validate at the current global step (every rank), then the monitor, ``best.pt`` and
    the sample (module docstring); returns the validation's results. ``final``: the run's
    last validation (a sweep's pruner is not asked after it)."""
    val = loop.evaluator.validate(loop.epoch, loop.global_step)
    loop.last_val, loop.last_val_step = val, loop.global_step
    shown = " | ".join(f"{k} {v:.4f}" for k, v in val.items()
                       if isinstance(v, float) and k != "val/num_samples")
    log.info("step %d (epoch %d) | %s", loop.global_step, loop.epoch + 1, shown or "no val")
    loop.lm.sample(loop.epoch, loop.global_step, validation=loop.validations)
    loop.validations += 1
    if loop.monitor.update(val, loop.epoch, final, step=loop.global_step):
        checkpointing.at_epoch_end(loop, best=True, complete=False)  # best.pt only
    return val


def at_epoch_end(loop: TrainingLoop, run_ends: bool) -> dict[str, Any]:
    """The validation results an epoch's end reports: the last validation's, validating
    first if the run ends here after steps no validation saw."""
    if run_ends and loop.last_val_step != loop.global_step:
        return validate(loop, final=True)
    return loop.last_val or {"val/loss": None, "val/accuracy": None, "val/num_samples": 0}
