"""What the loop's helpers may read and write of the loop: :class:`TrainingLoop`.

The loop of one rank (:class:`ddp_exp.train.loop.Trainer`) hands itself to its helpers
(:mod:`ddp_exp.train.steps`, :mod:`ddp_exp.train.epochs`, :mod:`ddp_exp.train.log_interval`,
:mod:`ddp_exp.train.step_validation`, :mod:`ddp_exp.train.state`, ...). Their signatures name
this protocol instead of ``Any``, so what a helper may touch is written down, typed, in one
place; ``tests/test_training_loop.py`` holds every ``loop.<name>`` a helper reads or writes to
a member declared here and every member to one the ``Trainer`` has. A structural type (PEP 544),
not the class itself: the helpers cannot import :mod:`ddp_exp.train.loop`, which imports them
(``tests/test_layers.py`` refuses the circle, typing-only imports included). The step
checkpoints' cadence is declared beside its class
(:class:`ddp_exp.train.step_checkpoint.CheckpointedLoop`), for the same reason.

May use (for types only): :mod:`ddp_exp.config.view`, :mod:`ddp_exp.data.loaders`,
:mod:`ddp_exp.distributed.process_group`, :mod:`ddp_exp.io.files`, :mod:`ddp_exp.metrics`,
:mod:`ddp_exp.train.evaluation`, :mod:`ddp_exp.train.monitor`, :mod:`ddp_exp.train.objective`,
:mod:`ddp_exp.train.optimizer`, :mod:`ddp_exp.train.strategy`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import _thread
    import contextlib

    import torch
    from torch import nn

    from ddp_exp.config.view import RankConfig
    from ddp_exp.data.loaders import RankData
    from ddp_exp.distributed.process_group import SideGroup, World
    from ddp_exp.io.files import BackgroundWriter
    from ddp_exp.metrics.lm import LanguageModelReport
    from ddp_exp.metrics.perf import StepTimer
    from ddp_exp.metrics.train_loss import LossWindow
    from ddp_exp.metrics.warmup import Warmup
    from ddp_exp.metrics.writer import MetricsWriter
    from ddp_exp.train.evaluation import Evaluator
    from ddp_exp.train.monitor import Monitor
    from ddp_exp.train.objective import Objective
    from ddp_exp.train.optimizer import OptimizerStep
    from ddp_exp.train.strategy import Strategy


class TrainingLoop(Protocol):
    """One rank's training state as its helpers see it (built by
    :class:`ddp_exp.train.loop.Trainer`, whose comments say how each member is made)."""

    # The run: config, place in the world, device, rank 0's writer.
    cfg: RankConfig
    world: World
    device: torch.device
    writer: MetricsWriter
    # Data: the rank's batches (ddp_exp.data.loaders), whether host batches move to the device,
    # whether batches are in-memory tensors (the fast path).
    data: RankData
    loader: Any  # data.train: TrainLoader or KeyedLoader, with set_epoch and len
    move_batches: bool
    plain_batches: bool
    # Model, strategy and objective: the unwrapped module, the forward the step calls (the
    # wrapped module, compiled with trainer.compile).
    model: nn.Module
    strategy: Strategy
    forward: Callable[..., Any]
    objective: Objective
    # Optimizer step: precision, the optimizer, the schedule (a step-interval scheduler in
    # step_scheduler, else None), the last step's learning rate and gradient norm.
    autocast: contextlib.AbstractContextManager
    scaler: torch.amp.GradScaler | None
    optimizer: torch.optim.Optimizer
    optim_step: OptimizerStep
    scheduler: Any  # an LRScheduler, or None
    step_scheduler: Any  # scheduler when it steps per optimizer step, else None
    step_lr: float
    grad_norm: torch.Tensor | None
    run_steps: int
    # Where the run is: the next epoch, optimizer steps taken, samples consumed in the epoch in
    # progress with its (loss sum, samples, seconds), the last epoch's (train loss, samples).
    epoch: int
    global_step: int
    position: int
    epoch_sums: tuple[float, int, float] | None
    last_train: tuple[float | None, int]
    # Decided at an epoch's last logging check: a preemption, a checkpoint due by the clock.
    preempted: bool
    checkpoint_due: bool
    # Logging: trainer.log_every_n_steps, the train/loss window, the first and compiling
    # steps, the step timer (trainer.perf_metrics, else None), the dashboard's layout written.
    log_every: int
    window: LossWindow
    warmup: Warmup
    perf: StepTimer | None
    layout_written: bool
    lm: LanguageModelReport
    # Validation: the evaluator, best epoch and early stopping, trainer.val_every_n_steps'
    # last results, their global step and the validations run.
    evaluator: Evaluator
    monitor: Monitor
    last_val: dict[str, Any] | None
    last_val_step: int | None
    validations: int
    # Rank 0's checkpoint files, written on a background thread; under
    # strategy.checkpoint=sharded, the side group shards are saved over (None before the first)
    # and the sharded checkpoints taken.
    checkpoint_files: BackgroundWriter
    checkpoint_group: SideGroup | None
    sharded_taken: int
    # Held while rank 0's writer snapshots a checkpoint's model and optimizer (released once
    # done): the next optimizer step acquires it first (ddp_exp.train.checkpointing.take).
    snapshot_gate: _thread.LockType | None

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch."""
        ...

    def train_epoch(self) -> tuple[float, int, float]:
        """Run one epoch; the world's (loss sum, samples, seconds in the loop)."""
        ...
