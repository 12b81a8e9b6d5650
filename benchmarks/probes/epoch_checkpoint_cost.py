"""What the epoch checkpoint (``checkpoints/last.pt`` after every epoch, ``trainer.save_last``'s
default) costs digits' training at world_size 2 (issue 42 item 2: < 1% of the loop), in one
world, as :mod:`benchmarks.probes.step_checkpoint_cost` measures the step checkpoints: each
rank holds two of ddp_exp's Trainers on the same data, the default keys and one with
``trainer.save_last=false``, and trains them in alternating blocks of epochs, each epoch
followed by the end-of-epoch checkpoint as ``Trainer.fit`` takes it
(:func:`ddp_exp.train.checkpointing.at_epoch_end`: ``take`` on the loop's thread, the RNG
gather started and rank 0's state read, which its writer snapshots with the weights while the
next step's forward and backward run; serialised and written on the background writer). A
block's time is rank 0's wall seconds from its first step to the end of its last, the
writer's pending writes included (``checkpoint_files.wait()``).

Three shares, rank 0's (the rank that snapshots and writes), CPU seconds being what the load of
a shared machine inflates least:

* *loop thread* (what the loop pays, and what the bound < 1% judges): the CPU seconds of
  ``at_epoch_end`` on the loop's thread, and of its wait at the next optimizer step for the
  writer's snapshot of the weights (``loop.snapshot_gate``), over the block's CPU seconds of
  that thread;
* *whole process*: the same plus the writer thread's CPU seconds (serialising, the file), over
  the block's CPU seconds of both threads: the writer's work charged in full, as if it could
  not overlap the steps (on a core of its own it does; it holds the GIL while it pickles);
* *direct* (wall): the seconds the loop waits in ``at_epoch_end`` and at that gate plus the
  writer thread's CPU seconds, over the block's wall seconds.

The blocks' ratio is printed too; on a shared machine it resolves a few percent, not one.

    python -m benchmarks.probes.epoch_checkpoint_cost [--rounds 10] [--epochs-per-block 10]

Prints the three shares and the costs per checkpoint as labelled lines, then ``BENCH_RESULT
{json}``: the seconds and samples/s of each variant, their ratio, the epoch checkpoints
written, the loop's wait and CPU and the writer's CPU (seconds), ``loop_thread_cost``,
``cpu_cost`` (the whole process's share) and ``direct_cost``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

from benchmarks import common  # noqa: E402
from benchmarks.probes.step_checkpoint_cost import (  # noqa: E402
    digits_world,
    run_two_ranks,
    time_checkpoint_work,
    trainer_config,
)

VARIANTS = {"save_last": (), "none": ("trainer.save_last=false",)}


def rank_main(rank: int, port: int, args: argparse.Namespace, out) -> None:
    from ddp_exp.distributed.process_group import destroy_process_group
    from ddp_exp.metrics.writer import MetricsWriter
    from ddp_exp.train import checkpointing
    from ddp_exp.train.loop import Trainer
    from ddp_exp.train.models import MLP
    from ddp_exp.train.objective import Objective

    world, datasets = digits_world(rank, port)
    spent = time_checkpoint_work(checkpointing, ("at_epoch_end",))
    time_snapshot_gate(checkpointing, spent)
    tmp = tempfile.mkdtemp(prefix="epoch-checkpoint-cost-")
    trainers = {}
    for name, overrides in VARIANTS.items():
        torch.manual_seed(0)
        trainers[name] = Trainer(trainer_config(None, tmp, *overrides), world, datasets,
                                 MLP((1, 8, 8), 10, [128]), Objective(10), torch.device("cpu"),
                                 MetricsWriter(os.path.join(tmp, name), {},
                                               enabled=world.is_main))
    seconds = {name: 0.0 for name in trainers}
    steps = {name: 0 for name in trainers}
    cpu = {name: 0.0 for name in trainers}  # rank 0's loop thread
    kept = {"take": 0.0, "take_cpu": 0.0, "writer_cpu": 0.0}  # save_last's blocks only
    written = 0
    for round_ in range(args.rounds):
        order = list(trainers) if round_ % 2 == 0 else list(reversed(trainers))
        for name in order:
            trainer = trainers[name]
            start_step = trainer.global_step
            before = dict(spent)
            torch.distributed.barrier()
            t, c = time.perf_counter(), time.thread_time()
            for _ in range(args.epochs_per_block):
                trainer.train_epoch()
                trainer.epoch += 1
                checkpointing.at_epoch_end(trainer)  # as Trainer.fit after each epoch
            trainer.checkpoint_files.wait()  # this block's writes, charged to it
            torch.distributed.barrier()
            seconds[name] += time.perf_counter() - t
            cpu[name] += time.thread_time() - c
            steps[name] += trainer.global_step - start_step
            if name == "save_last":
                written += args.epochs_per_block
                for key in kept:
                    kept[key] += spent[key] - before[key]
    if world.is_main:
        samples = {n: steps[n] * trainers[n].cfg.global_batch_size for n in trainers}
        rate = {n: samples[n] / seconds[n] for n in trainers}
        out.put({"seconds": seconds, "samples_per_sec": rate,
                 "ratio": rate["save_last"] / rate["none"], "epoch_checkpoints": written,
                 "steps": steps, "take_s": kept["take"], "take_cpu_s": kept["take_cpu"],
                 "writer_cpu_s": kept["writer_cpu"],
                 "direct_cost": (kept["take"] + kept["writer_cpu"]) / seconds["save_last"],
                 # CPU only (what the machine's load cannot inflate): the checkpoint's CPU on
                 # both threads over the block's (the loop thread's and the writer's).
                 "loop_cpu_s": cpu, "cpu_cost": (kept["take_cpu"] + kept["writer_cpu"])
                 / (cpu["save_last"] + kept["writer_cpu"]),
                 # What the loop itself pays: its own thread's CPU in at_epoch_end.
                 "loop_thread_cost": kept["take_cpu"] / cpu["save_last"]})
    for trainer in trainers.values():
        trainer.writer.close()
    destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)  # the checkpoints and event files


def time_snapshot_gate(checkpointing, spent: dict[str, float]) -> None:
    """Charge to ``spent`` (``take``: wall, ``take_cpu``: this thread's CPU seconds) the
    loop's wait at its next optimizer step for a checkpoint's snapshot of the weights that
    rank 0's writer takes (``loop.snapshot_gate``: the lock
    :func:`ddp_exp.train.checkpointing.take` makes through ``checkpointing.threading``)."""
    import threading
    import types

    class TimedLock:
        def __init__(self):
            self._lock = threading.Lock()
            self.release, self.locked = self._lock.release, self._lock.locked

        def acquire(self):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return self._lock.acquire()
            finally:
                spent["take"] += time.perf_counter() - t
                spent["take_cpu"] += time.thread_time() - c

    checkpointing.threading = types.SimpleNamespace(Lock=TimedLock)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10, help="blocks of each variant, alternating")
    p.add_argument("--epochs-per-block", type=int, default=10)
    args = p.parse_args()
    result = run_two_ranks(rank_main, args)
    result.update(rounds=args.rounds, epochs_per_block=args.epochs_per_block)
    for line in report(result):
        print(line)
    common.emit(result, None)


def report(r: dict) -> list[str]:
    """The probe's result ``r`` as labelled lines: the three shares (percent) and the costs per
    checkpoint and per epoch (microseconds, rank 0)."""
    n = max(1, r["epoch_checkpoints"])
    per = {k: 1e6 * r[k] / n for k in ("take_s", "take_cpu_s", "writer_cpu_s")}
    epoch_cpu = 1e6 * r["loop_cpu_s"]["save_last"] / n
    return [
        f"loop thread share (CPU of at_epoch_end on the loop's thread / that thread's CPU): "
        f"{100 * r['loop_thread_cost']:.2f}%",
        f"whole process share (+ the writer thread's CPU, over both threads' CPU): "
        f"{100 * r['cpu_cost']:.2f}%",
        f"direct share (the loop's wait + the writer's CPU, over the blocks' wall seconds): "
        f"{100 * r['direct_cost']:.2f}%",
        f"per checkpoint ({n}): loop thread CPU {per['take_cpu_s']:.0f} us (wait "
        f"{per['take_s']:.0f} us), writer thread CPU {per['writer_cpu_s']:.0f} us; the loop "
        f"thread's CPU per epoch {epoch_cpu:.0f} us; blocks' ratio (save_last / none) "
        f"{r['ratio']:.3f}"]

if __name__ == "__main__":
    main()
