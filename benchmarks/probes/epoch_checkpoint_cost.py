"""What the epoch checkpoint (``checkpoints/last.pt`` after every epoch, ``trainer.save_last``'s
default) costs digits' training at world_size 2 (issue 42 item 2: < 1% of the loop), in one
world, as :mod:`benchmarks.probes.step_checkpoint_cost` measures the step checkpoints: each
rank holds two of ddp_exp's Trainers on the same data, the default keys and one with
``trainer.save_last=false``, and trains them in alternating blocks of epochs, each epoch
followed by the end-of-epoch checkpoint as ``Trainer.fit`` takes it
(:func:`ddp_exp.train.checkpointing.at_epoch_end`: ``take`` on the loop's thread, the RNG
gather started and rank 0's state snapshotted; serialised and written on the background
writer). A block's time is rank 0's wall seconds from its first step
to the end of its last, the writer's pending writes included (``checkpoint_files.wait()``).

Two measures. The *CPU* share, which the load of a shared machine cannot inflate: the CPU
seconds of ``at_epoch_end`` on the loop's thread plus the writer thread's, over the block's
CPU seconds of both threads (rank 0). The *direct* share: the seconds the loop waits in
``at_epoch_end`` plus the writer thread's CPU seconds, over the block's seconds (the
writer's CPU is charged in full, although on an idle core it would overlap the steps).
The blocks' ratio is printed too; on a
shared machine it resolves a few percent, not one.

    python -m benchmarks.probes.epoch_checkpoint_cost [--rounds 10] [--epochs-per-block 10]

Prints ``BENCH_RESULT {json}``: the seconds and samples/s of each variant, their ratio, the
epoch checkpoints written, the loop's wait and the writer's CPU (seconds), ``cpu_cost`` and
``direct_cost``.
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
    run_two_ranks,
    time_checkpoint_work,
    trainer_config,
)

VARIANTS = {"save_last": (), "none": ("trainer.save_last=false",)}


def rank_main(rank: int, port: int, args: argparse.Namespace, out) -> None:
    from ddp_exp.data import build_datasets, load_digits
    from ddp_exp.distributed.process_group import World, destroy_process_group, init_process_group
    from ddp_exp.metrics.writer import MetricsWriter
    from ddp_exp.train import checkpointing
    from ddp_exp.train.loop import Trainer
    from ddp_exp.train.models import MLP
    from ddp_exp.train.objective import Objective

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(max(1, common.cores() // 2))  # ddp_exp's rule
    world = World.from_env()
    init_process_group("gloo", world, 120)
    datasets = build_datasets(load_digits(), 297, 0, 2)
    spent = time_checkpoint_work(checkpointing, ("at_epoch_end",))
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
                 / (cpu["save_last"] + kept["writer_cpu"])})
    for trainer in trainers.values():
        trainer.writer.close()
    destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)  # the checkpoints and event files


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10, help="blocks of each variant, alternating")
    p.add_argument("--epochs-per-block", type=int, default=10)
    args = p.parse_args()
    result = run_two_ranks(rank_main, args)
    result.update(rounds=args.rounds, epochs_per_block=args.epochs_per_block)
    common.emit(result, None)

if __name__ == "__main__":
    main()
