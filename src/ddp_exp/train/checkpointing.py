"""Taking a checkpoint: the one path every checkpoint of the loop goes through (end of epoch,
every N steps or minutes, a preemption, ``trainer.max_steps``' stop, the final one).

1. :func:`take`, on every rank at the same point of its collectives: each rank reads its RNG
   states and rank 0 snapshots the loop's state (:func:`ddp_exp.train.state.state_dict`,
   tensors cloned: the loop trains on). No collective runs here (but FSDP's gather of a full
   checkpoint's tensors, and once per run the making of the side group, :func:`side`). A
   checkpoint with nothing between it and the next step (the epoch's) leaves the snapshot to
   rank 0's writer thread where nothing changes the model and optimizer before the next
   ``optimizer.step()``, which waits for it (``loop.snapshot_gate``).
2. :func:`land`: every rank hands its part to its background writer
   (:class:`ddp_exp.io.files.BackgroundWriter`), whose thread gathers the ranks' RNG states
   (one ``all_gather`` over the side group: every rank's writer runs the checkpoints' gathers
   in the order they land, the same on every rank); rank 0's then serializes the checkpoint
   and lands it atomically under every name it is due (:func:`ddp_exp.io.checkpoint.save`, the
   one place that decides what ``last.pt``, ``best.pt`` and ``epoch_NNNN.pt`` become). Which
   names are due is :func:`due_at_epoch_end`'s, or :data:`INSIDE_EPOCH` for a step checkpoint.
   The gather ran on the loop's thread before (issue 42: ~0.15 ms of the ~0.6 ms the epoch
   checkpoint cost that thread on digits, after an epoch's steps).

Between the two, a step checkpoint of the step cadence settles the logging check it started
(:func:`ddp_exp.train.step_checkpoint.complete`), so that its epoch sums are whole; the other
checkpoints land at once. The loop's ``fit`` drains every rank's writer before it returns or
raises (a preemption's ``Preempted`` included), so a status that says completed or preempted
comes after the files.

Sharded checkpoints (``strategy.checkpoint=sharded``, issue 40; :mod:`ddp_exp.io.sharded`) take
the same path: :func:`take` snapshots every rank's shard of the model and optimizer
(``get_state_dict``: local slices, no collective) and rank 0 the rest of the state; :func:`land`
has every rank's writer thread write its shard (``dcp.save`` over a gloo group of its own,
:func:`ddp_exp.distributed.process_group.side_group`, so that it runs beside the loop's
collectives), and rank 0's then seals the folder and lands the names as for a full checkpoint.

Each function takes the loop, a :class:`ddp_exp.train.loop.Trainer`, read through ``world``,
``device``, ``cfg``, ``writer`` (its ``job_dir``), ``checkpoint_files`` and what
:func:`ddp_exp.train.state.state_dict` reads; this module does not import the loop. Uses
:mod:`ddp_exp.io.checkpoint`, :mod:`ddp_exp.distributed.process_group` (the RNG gather) and
:mod:`ddp_exp.train.state`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from ddp_exp.distributed.process_group import RngGather, SideGroup, side_group, start_rng_gather
from ddp_exp.io import checkpoint, sharded
from ddp_exp.train import state as train_state
from ddp_exp.train.strategy import held

if TYPE_CHECKING:
    import _thread

    from ddp_exp.train.training_loop import TrainingLoop


class Due(NamedTuple):
    """The names a checkpoint is due under: its ``epoch_NNNN.pt`` file, ``last.pt``,
    ``best.pt``."""

    epoch_file: bool = False
    last: bool = False
    best: bool = False


INSIDE_EPOCH = Due(last=True)  # a step checkpoint: never an epoch file or best.pt


class Taken:
    """A checkpoint taken on every rank and not landed yet: rank 0's snapshot of the loop
    (``state``; None on the other ranks), every rank's RNG states on their way (``rng``),
    for a sharded checkpoint this rank's :class:`Shards`, and whether rank 0's model and
    optimizer are left for its writer's thread to snapshot (``deferred``: :func:`take`)."""

    def __init__(self, state: dict[str, Any] | None, rng: RngGather,
                 shards: Shards | None = None, deferred: bool = False):
        self.state, self.rng, self.shards, self.deferred = state, rng, shards, deferred


class Shards:
    """This rank's part of a sharded checkpoint: its snapshot of the model and optimizer
    shards (``tensors``), the temp folder every rank writes into (``temp``) and the group the
    write's collectives run on."""

    def __init__(self, tensors: dict[str, Any], temp: str, group: Any):
        self.tensors, self.temp, self.group = tensors, temp, group

    def write(self) -> None:
        """Write this rank's shard (:func:`ddp_exp.io.sharded.write_shards`; a collective)."""
        sharded.write_shards(self.tensors, self.temp, self.group)


def side(loop: TrainingLoop) -> SideGroup:
    """The loop's :class:`ddp_exp.distributed.process_group.SideGroup` for its writer thread's
    collectives (the RNG gather, a sharded checkpoint's shards), made at its first checkpoint
    (every rank, at the same point of its collectives: one ``new_group`` and one broadcast,
    once per run) and kept on the loop as ``checkpoint_group``."""
    group = loop.checkpoint_group
    if group is None:
        group = loop.checkpoint_group = side_group(loop.cfg.distributed.timeout_s)
    return group


def _take_shards(loop: TrainingLoop) -> Shards | None:
    """This rank's :class:`Shards` under ``strategy.checkpoint=sharded``, else None."""
    if loop.cfg.strategy.checkpoint != "sharded":
        return None
    group = side(loop)
    loop.sharded_taken += 1
    temp = sharded.temp_folder(checkpoint.checkpoint_dir(loop.writer.job_dir),
                               f"{group.tag}-{loop.sharded_taken}")
    tensors = sharded.state_tensors(held(loop).module, loop.optimizer)
    return Shards(checkpoint.snapshot(tensors), temp, group.group)


def take(loop: TrainingLoop, position: int = 0, epoch_sums: tuple[float, int, float] | None = None,
         lands_now: bool = False) -> Taken:
    """Take a checkpoint of ``loop`` as it is now (every rank, at the same point of its
    collectives), waiting for no collective but FSDP's gather of a full checkpoint's tensors
    (``strategy.checkpoint=full``) and, once per run, the side group (:func:`side`): read
    this rank's RNG states (its writer gathers them: :func:`land`), under
    ``strategy.checkpoint=sharded`` snapshot
    this rank's shards, and on rank 0 snapshot the state (:func:`ddp_exp.io.checkpoint.snapshot` of
    :func:`ddp_exp.train.state.state_dict`). ``position`` (global samples the epoch in
    progress has consumed) and ``epoch_sums`` (its world loss sum, samples, seconds) make it
    a step checkpoint; 0 and None: at an epoch's end.

    ``lands_now``: :func:`land` follows at once, and nothing changes the state before the
    loop's next optimizer step (the epoch's checkpoint: its validation, monitor and per-epoch
    schedule came before it; not ``trainer.max_steps``' stop, which they follow). Then, where
    the model and optimizer states stay still until that step
    (:attr:`ddp_exp.train.strategy.Strategy.states_still_until_step`) and rank 0's writer has
    nothing pending, the snapshot (the state's containers with the model and optimizer) is
    left to the writer's thread, which takes it while the loop goes on into the next step's
    forward and backward; the loop waits for it before that step's ``optimizer.step()``
    (``loop.snapshot_gate``, :func:`ddp_exp.train.steps.finish_step`), the first thing that
    changes the weights, the scheduler or the scaler (the monitor changes at the next
    validation, after it). Issue 42: ~0.2 ms of the ~0.33 ms the epoch checkpoint cost the
    loop's thread on digits. A writer still busy (a slow disk) gets the snapshot taken here,
    so that the loop never waits for an earlier checkpoint's file."""
    shards = _take_shards(loop)
    # A full checkpoint's model and optimizer on every rank: FSDP gathers them to rank 0 (a
    # collective every rank must join); DDP's are rank 0's own (references, snapshotted below).
    strategy = held(loop)
    full = shards is None and (loop.world.is_main or strategy.name == "fsdp")
    deferred = (full and lands_now and loop.world.is_main and strategy.states_still_until_step
                and loop.checkpoint_files.idle())
    weights = {} if deferred or not full else {
        "model": strategy.model_state(), "optimizer": strategy.optimizer_state(loop.optimizer)}
    # This rank's RNG states, read now; every rank's writer gathers them over the side group
    # (in the order the checkpoints land, the same on every rank), not the loop's thread.
    rng = start_rng_gather(loop.device, side(loop).group)
    state = None
    if loop.world.is_main:  # deferred: its containers snapshotted with the weights
        state = {**weights, **train_state.state_dict(loop, [], position, epoch_sums,
                                                     weights=False)}
        state = state if deferred else checkpoint.snapshot(state)
    return Taken(state, rng, shards, deferred)


def _snapshot_on_writer(loop: TrainingLoop, state: dict[str, Any]
                        ) -> tuple[Callable[[], dict[str, Any]], _thread.LockType]:
    """The snapshot of ``state`` (the loop's, taken but not snapshotted: references to the
    scheduler's, the monitor's and the scaler's own containers) with the model and optimizer
    states, as a job for the writer's thread, and the lock held until it is done (or failed),
    also set as ``loop.snapshot_gate``: what the loop acquires before its next optimizer step,
    the first thing that changes any of them (a lock: ~10 us less of the loop's thread than
    an Event, made after an epoch's steps)."""
    gate = threading.Lock()
    gate.acquire()
    strategy, optimizer = held(loop), loop.optimizer

    def snapshotted() -> dict[str, Any]:
        try:
            return checkpoint.snapshot({**state, "model": strategy.model_state(),
                                        "optimizer": strategy.optimizer_state(optimizer)})
        finally:
            gate.release()

    loop.snapshot_gate = gate
    return snapshotted, gate


def land(loop: TrainingLoop, taken: Taken, due: Due) -> None:
    """Hand ``taken`` to this rank's background writer (every rank, in the same order): its
    thread first takes a deferred snapshot (rank 0, :func:`take` with ``lands_now``), gathers
    the ranks' RNG states over the side group (a collective of the writers), then rank 0's
    writes the checkpoint under the names ``due`` (:func:`ddp_exp.io.checkpoint.save`) once
    the run's records up to now are written: the scalars the loop still queues are handed to
    TensorBoard here, and that thread waits for the event file and the trackers' rows
    (:meth:`ddp_exp.metrics.writer.MetricsWriter.records_on_disk`), not the loop (issue 30's
    cost). A resume keeps the records before its checkpoint's step and writes the rest again,
    so none before it may be missing (``metrics.csv`` lost its last row to a kill after a step
    checkpoint). The others' write nothing (but their shards, sharded)."""
    files = loop.checkpoint_files
    if not loop.world.is_main:
        shards = taken.shards
        files.submit(taken.rng.wait if shards is None else
                     lambda: (taken.rng.wait(), shards.write()))
        return
    snapshotted, gate = (_snapshot_on_writer(loop, taken.state) if taken.deferred
                         else (dict, None))

    def late() -> dict[str, Any]:  # the snapshot first: the loop may be waiting for it
        return {**snapshotted(), "rng": taken.rng.wait()}

    loop.writer.write_queued()
    try:
        checkpoint.save(loop.writer.job_dir, taken.state, due.epoch_file,
                        loop.cfg.trainer.keep_checkpoints, files, last=due.last, best=due.best,
                        before_write=loop.writer.records_on_disk, late=late, owned=True,
                        shards=taken.shards)
    except BaseException:
        if gate is not None and gate.locked():  # never submitted: nothing would release it
            gate.release()
        raise


def due_at_epoch_end(loop: TrainingLoop, best: bool, complete: bool, force_last: bool) -> Due:
    """The names an epoch's checkpoint is due under (``loop.epoch`` already counts the epoch):
    ``last.pt`` with ``trainer.save_last`` or ``force_last`` (a step checkpoint was due at
    the epoch's last step, or a preemption), the epoch's file every
    ``trainer.checkpoint_every_n_epochs`` epochs, ``best.pt`` when ``best`` (the monitor's new
    best). ``complete=False`` (``trainer.max_steps`` stopped the epoch part-way, and its
    ``last.pt`` is the step checkpoint of that step): ``best.pt`` only."""
    trainer = loop.cfg.trainer
    every = trainer.checkpoint_every_n_epochs
    epoch_file = complete and every > 0 and loop.epoch % every == 0
    return Due(epoch_file, complete and (trainer.save_last or force_last), best)


def at_epoch_end(loop: TrainingLoop, best: bool = False, complete: bool = True,
                 force_last: bool = False) -> None:
    """The epoch's checkpoint (every rank, after the epoch's validation and monitor):
    taken and landed under the names :func:`due_at_epoch_end` gives, if any; with
    ``complete=False`` it is marked ``resumable: False`` (continuing from it could not be
    exact)."""
    due = due_at_epoch_end(loop, best, complete, force_last)
    if not any(due):
        return
    taken = take(loop, lands_now=True)
    if taken.state is not None and not complete:
        taken.state["resumable"] = False
    land(loop, taken, due)
