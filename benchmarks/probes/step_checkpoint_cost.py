"""What a step checkpoint every 50 steps costs digits' training at world_size 2 (issue 30), in
one world: each rank holds two of ddp_exp's Trainers on the same data, one with
``trainer.checkpoint_every_n_steps=50`` and one without, and trains them in alternating blocks
of epochs (``Trainer.train_epoch``, as ``fit`` runs them). A block's time is rank 0's wall
seconds from its first step to the end of its last, the background writer's pending writes
included (``checkpoint_files.wait()``: a write that would overlap the next block's steps is
charged to the block that caused it).

Why not only the pairs of whole runs (``make bench``'s ``step_checkpoint`` group): on this
machine the same run's samples/s varies by +-20% from one run to the next (other virtual
machines on the host), so ten pairs cannot resolve a 3% bound. Blocks a few seconds long,
alternated in one pair of processes, see the same slow and fast stretches; the ratio of their
summed times is stable to a fraction of a percent.

    python -m benchmarks.probes.step_checkpoint_cost [--rounds 10] [--epochs-per-block 20]

Prints ``BENCH_RESULT {json}``: the seconds and samples/s of each variant, the ratio
(with / without: the throughput kept, target >= 0.97), the step checkpoints written and the
milliseconds each cost (the difference of the sums over the checkpoints).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.multiprocessing as mp

from benchmarks import common  # noqa: E402

EVERY = 50  # steps between step checkpoints (the bound's cadence)


def trainer_config(every: int | None, job_dir: str, *overrides: str):
    """The default digits run at world_size 2 as ddp_exp composes it (``conf/``), with step
    checkpoints every ``every`` steps (None: off) and ``overrides``, typed as a rank receives
    it."""
    import hydra
    from omegaconf import OmegaConf

    from ddp_exp.config.compose import register_configs
    from ddp_exp.config.view import rank_config

    register_configs()
    with hydra.initialize_config_module(config_module="ddp_exp.conf", version_base="1.3"):
        cfg = hydra.compose("config", overrides=[
            "world_size=2", "backend=gloo", "trainer.progress=off",
            f"trainer.checkpoint_every_n_steps={'null' if every is None else every}",
            *overrides])
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    return rank_config(plain)


def digits_world(rank: int, port: int):
    """Rank ``rank`` of a gloo world of 2 on ``127.0.0.1:port`` with ddp_exp's threads per
    rank, and digits' datasets as the default run splits them. Returns (world, datasets)."""
    from ddp_exp.data import build_datasets, load_digits
    from ddp_exp.distributed.process_group import World, init_process_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(max(1, common.cores() // 2))  # ddp_exp's rule
    world = World.from_env()
    init_process_group("gloo", world, 120)
    datasets = build_datasets(load_digits(), 297, 0, 2)
    return world, datasets


def rank_main(rank: int, port: int, args: argparse.Namespace, out) -> None:
    from ddp_exp.distributed.process_group import destroy_process_group
    from ddp_exp.metrics.writer import MetricsWriter
    from ddp_exp.train.loop import Trainer
    from ddp_exp.train.models import MLP
    from ddp_exp.train.objective import Objective

    world, datasets = digits_world(rank, port)
    spent = _time_checkpoint_work()
    tmp = tempfile.mkdtemp(prefix="step-checkpoint-cost-")
    trainers = {}
    for name, every in (("every-50", EVERY), ("none", None)):
        torch.manual_seed(0)
        trainers[name] = Trainer(trainer_config(every, tmp), world, datasets,
                                 MLP((1, 8, 8), 10, [128]), Objective(10), torch.device("cpu"),
                                 MetricsWriter(os.path.join(tmp, name), {},
                                               enabled=world.is_main))
    seconds = {name: 0.0 for name in trainers}
    blocks: dict[str, list[float]] = {name: [] for name in trainers}
    cpu: dict[str, list[float]] = {name: [] for name in trainers}
    steps = {name: 0 for name in trainers}
    written = 0
    spent.update(take=0.0, take_cpu=0.0, writer_cpu=0.0)  # the checkpoints of the blocks only
    for round_ in range(args.rounds):
        # alternate which variant goes first, so neither always follows the other's writes
        order = list(trainers) if round_ % 2 == 0 else list(reversed(trainers))
        for name in order:
            trainer = trainers[name]
            start_step = trainer.global_step
            torch.distributed.barrier()
            c = _cpu_seconds()
            t = time.perf_counter()
            for _ in range(args.epochs_per_block):
                trainer.train_epoch()
                trainer.epoch += 1
            trainer.checkpoint_files.wait()  # this block's writes, charged to it
            torch.distributed.barrier()
            seconds[name] += time.perf_counter() - t
            blocks[name].append(round(time.perf_counter() - t, 4))
            used = torch.tensor([_cpu_seconds() - c], dtype=torch.float64)
            torch.distributed.all_reduce(used)  # both ranks' processes, every thread
            cpu[name].append(round(float(used), 4))
            steps[name] += trainer.global_step - start_step
            if name == "every-50":
                written += sum(1 for s in range(start_step + 1, trainer.global_step + 1)
                               if s % EVERY == 0 and s % trainer.steps_per_epoch != 0)
    if world.is_main:
        samples = {n: steps[n] * trainers[n].cfg.global_batch_size for n in trainers}
        rate = {n: samples[n] / seconds[n] for n in trainers}
        out.put({"seconds": seconds, "samples_per_sec": rate,
                 "ratio": rate["every-50"] / rate["none"], "step_checkpoints": written,
                 "ms_per_checkpoint": 1000 * (seconds["every-50"] - seconds["none"])
                 / max(1, written), "steps": steps, "block_seconds": blocks,
                 # rank 0, every-50: wall (and CPU) seconds in the loop's step-checkpoint
                 # calls (the loop waits for them), CPU seconds of the writer's jobs
                 "take_s": spent["take"], "take_cpu_s": spent["take_cpu"],
                 "writer_cpu_s": spent["writer_cpu"],
                 "direct_cost": (spent["take"] + spent["writer_cpu"]) / seconds["every-50"],
                 "block_cpu_seconds": cpu})
    for trainer in trainers.values():
        trainer.writer.close()
    destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)  # the checkpoints and event files


def _time_checkpoint_work() -> dict[str, float]:
    """Wrap the loop's step-checkpoint calls (``step_checkpoint.begin`` and ``complete``, and
    ``take`` for the clock and preemption) and the background writer's jobs: see
    :func:`time_checkpoint_work`."""
    from ddp_exp.train import step_checkpoint

    return time_checkpoint_work(step_checkpoint, ("begin", "complete", "take"))


def time_checkpoint_work(module, names: tuple[str, ...]) -> dict[str, float]:
    """Wrap ``module``'s functions ``names`` (the loop's checkpoint calls: wall seconds, the loop
    waits for all of it, and this thread's CPU seconds) and the background writer's jobs (CPU
    seconds of its thread: serialization, TensorBoard's flush, the file) to add up what this
    process spends on checkpoints: a ratio within one run, which the machine's slow and fast
    stretches move together. Returns the running sums: ``take``, ``take_cpu``, ``writer_cpu``
    (seconds)."""
    from ddp_exp.io.files import BackgroundWriter

    spent = {"take": 0.0, "take_cpu": 0.0, "writer_cpu": 0.0}

    def timed(function):
        def wrapper(*args, **kwargs):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                spent["take"] += time.perf_counter() - t
                spent["take_cpu"] += time.thread_time() - c
        return wrapper

    for name in names:
        setattr(module, name, timed(getattr(module, name)))
    submit = BackgroundWriter.submit

    def timed_submit(self, job):
        def timed_job():
            t = time.thread_time()
            try:
                return job()
            finally:
                spent["writer_cpu"] += time.thread_time() - t
        return submit(self, timed_job)

    BackgroundWriter.submit = timed_submit
    return spent


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, all its threads (the background
    writer's included)."""
    import resource

    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10, help="blocks of each variant, alternating")
    p.add_argument("--epochs-per-block", type=int, default=20)
    args = p.parse_args()
    result = run_two_ranks(rank_main, args)
    result.update(rounds=args.rounds, epochs_per_block=args.epochs_per_block, every=EVERY)
    common.emit(result, None)


def run_two_ranks(rank_main, args: argparse.Namespace) -> dict:
    """A world of two spawned ranks, ``rank_main(rank, port, args, out)``; returns what rank 0
    put on ``out``."""
    # As ddp_exp's launcher does for its ranks: OpenMP sized before a rank imports torch (a
    # pool of one thread per core, later cut by set_num_threads, spins and halves the speed).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, common.cores() // 2)))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = common.free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, args, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    result = out.get(timeout=1800)
    for proc in procs:
        proc.join(timeout=120)
    return result


if __name__ == "__main__":
    main()
