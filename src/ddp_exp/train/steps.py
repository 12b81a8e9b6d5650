"""One optimizer step of the loop on one rank (:mod:`ddp_exp.train.loop`'s step 2): the
micro-batches' forward and backward through the DDP wrapper (all but the last inside
``no_sync()``), each loss weighted by its share of the step's samples (or, per-element targets,
of the world's count of counted elements), DistributedSampler's repeats counted zero, then
clipping or the logging step's norm, ``optimizer.step()`` and a per-step schedule's step. The hot
path: no device sync, and nothing done per step that can be done once.

Each function takes the loop, a :class:`ddp_exp.train.loop.Trainer`, read through its
attributes (``optimizer``, ``ddp``, ``forward``, ``objective``, ``autocast``, ``scaler``,
``optim_step``, ``perf``, ``move_batches``, ``plain_batches``, ``device``, ``world``, ``data``,
``loader``, ``log_every``, ``step_scheduler``); a step advances its ``global_step`` and sets
``grad_norm`` and ``step_lr``. This module does not import the loop.

May use: :mod:`ddp_exp.data.batches`, :mod:`ddp_exp.metrics.train_loss` (the window a step adds
its loss to), :mod:`ddp_exp.train.optimizer`, torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from ddp_exp.data.batches import call_model, to_device
from ddp_exp.metrics.train_loss import LossWindow
from ddp_exp.train.optimizer import NO_CONTEXT

if TYPE_CHECKING:
    from ddp_exp.train.training_loop import TrainingLoop

log = logging.getLogger("ddp_exp.train")


def groups(batches: Iterable, size: int) -> Iterator[list]:
    """Consecutive groups of ``size`` items (the last one may be shorter)."""
    group: list = []
    for item in batches:
        group.append(item)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def duplicate_ignored(loop: TrainingLoop, batches: Iterable, first: int = 0) -> Iterator:
    """The epoch's batches (from its ``first``-th), the last one's last sample
    (DistributedSampler's duplicate) made to count nowhere for per-element targets: its
    labels become ``ignore_index``."""
    last = len(loop.loader) - 1
    for i, (xb, yb) in enumerate(batches, start=first):
        if i == last and loop.objective.elementwise(yb):
            yb = yb.clone()
            yb[-1] = loop.objective.ignore_index
        yield xb, yb


def train_step(loop: TrainingLoop, group: list, window: LossWindow) -> None:
    """One optimizer step over a group of micro-batches (see the module docstring). The
    hot path: no device sync, and nothing done per step that can be done once."""
    if loop.objective.elementwise(group[0][1]):
        return element_step(loop, group, window)
    last = len(group) - 1
    # shape[0], not len(): Tensor.__len__ is Python (0.54 us a call against 0.17 us)
    step_samples = (group[0][1].shape[0] if last == 0
                    else sum(yb.shape[0] for _, yb in group))
    perf = loop.perf  # None unless trainer.perf_metrics
    plain = loop.plain_batches
    loop.optimizer.zero_grad(set_to_none=True)
    for i, (xb, yb) in enumerate(group):
        if loop.move_batches:  # host batches (DataLoader workers) to the device
            xb = to_device(xb, loop.device)
            yb = yb.to(loop.device, non_blocking=True)
        with loop.strategy.no_sync() if i < last else NO_CONTEXT:
            with loop.autocast:
                out = loop.forward(xb) if plain else call_model(loop.forward, xb)
                if type(out) is not torch.Tensor:  # a tuple or a mapping
                    out = loop.objective.output(out)
                loss = loop.objective.batch_loss(out, yb)
            scaled = loss if last == 0 else loss * (yb.shape[0] / step_samples)
            (scaled if loop.scaler is None else loop.scaler.scale(scaled)).backward()
        window.add(loss, yb.shape[0], loop.global_step + 1)
    finish_step(loop, perf)


def element_step(loop: TrainingLoop, group: list, window: LossWindow) -> None:
    """An optimizer step on per-element targets (tokens, pixels): the gradient of the
    world's element mean. The labels say how many elements count before any forward, so the
    world's count N of the step is all-reduced asynchronously while the first micro-batch's
    forward runs; each backward takes the rank's loss *sum* times ``world_size / N`` (DDP
    averages over ranks), so the gradients are those of the global mean before clipping
    and the step. A step whose world counts no element changes no weight (a warning says
    so); every rank still runs its backward, which DDP waits for."""
    import torch.distributed as dist

    last = len(group) - 1
    ws = loop.world.world_size
    ignore = loop.objective.ignore_index
    targets = [yb.to(loop.device, non_blocking=True) if loop.move_batches else yb
               for _, yb in group]
    counts = [int((yb != ignore).sum()) for yb in targets]
    n, work = float(sum(counts)), None
    if ws > 1 and dist.is_initialized():
        world_count = torch.tensor([n], dtype=torch.float64, device=loop.device)
        work = dist.all_reduce(world_count, async_op=True)
    loop.optimizer.zero_grad(set_to_none=True)
    for i, ((xb, _), yb) in enumerate(zip(group, targets, strict=True)):
        if loop.move_batches:
            xb = to_device(xb, loop.device)
        with loop.strategy.no_sync() if i < last else NO_CONTEXT:
            with loop.autocast:
                out = loop.objective.output(call_model(loop.forward, xb))
                total, _ = loop.objective.element_terms(out, yb)
            if work is not None:  # the count has travelled during the forward
                work.wait()
                n, work = float(world_count), None
            scaled = total * (ws / n if n else 0.0)
            (scaled if loop.scaler is None else loop.scaler.scale(scaled)).backward()
        window.add(total, counts[i], loop.global_step + 1, summed=True)
    if n == 0:
        if loop.world.is_main:  # the world's count: the same on every rank, said once
            log.warning("step %d: no counted element on any rank (every target is "
                        "data.ignore_index): the step is skipped", loop.global_step + 1)
        loop.optimizer.zero_grad(set_to_none=True)
        loop.global_step += 1
        return
    finish_step(loop, loop.perf)


def padded_step(loop: TrainingLoop, group: list, window: LossWindow) -> None:
    """The epoch's last step when DistributedSampler repeated samples to fill the world
    (a training set ``world_size`` does not divide): each repeated sample (the last of its
    rank) counts zero, so the step's gradient is the mean over the world's real samples
    ``N``, known on every rank without communication (every rank's step holds as many
    samples; N is their world total minus the repeats). Per-element targets: the repeat's
    labels are ignored already (:func:`duplicate_ignored`)."""
    if loop.objective.elementwise(group[0][1]):
        return element_step(loop, group, window)
    ws, last = loop.world.world_size, len(group) - 1
    step_samples = sum(yb.shape[0] for _, yb in group)
    world_n = ws * step_samples - loop.data.padded
    loop.optimizer.zero_grad(set_to_none=True)
    for i, (xb, yb) in enumerate(group):
        if loop.move_batches:
            xb, yb = to_device(xb, loop.device), yb.to(loop.device, non_blocking=True)
        with loop.strategy.no_sync() if i < last else NO_CONTEXT:
            with loop.autocast:
                out = loop.objective.output(call_model(loop.forward, xb))
                values = loop.objective.per_sample_loss(out, yb)
                if i == last and loop.data.duplicate_last:
                    values = values[:-1]
                total = values.sum()
            scaled = total * (ws / world_n)
            (scaled if loop.scaler is None else loop.scaler.scale(scaled)).backward()
        window.add(total, values.shape[0], loop.global_step + 1, summed=True)
    finish_step(loop, loop.perf)


def finish_step(loop: TrainingLoop, perf) -> None:
    """Clipping or the logging step's norm, ``optimizer.step()``, the step's scheduler; first,
    after a checkpoint, its snapshot of the weights on the writer's thread is waited for
    (``loop.snapshot_gate``: :func:`ddp_exp.train.checkpointing.take`)."""
    if perf is not None:
        perf.backward_done()
    if loop.snapshot_gate is not None:  # the parameters change below
        loop.snapshot_gate.acquire()
        loop.snapshot_gate = None
    # Clipped, or measured at logging steps only (train/grad_norm); then optimizer.step().
    loop.grad_norm = loop.optim_step.step((loop.global_step + 1) % loop.log_every == 0)
    if perf is not None:
        perf.step_done()
    loop.global_step += 1
    if loop.step_scheduler is not None:
        loop.step_lr = loop.optimizer.param_groups[0]["lr"]
        loop.step_scheduler.step()
