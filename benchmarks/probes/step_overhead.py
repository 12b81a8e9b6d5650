"""Per-step overhead of ddp_exp's training loop against the tight loop (issue 13), in one process.

A world of one rank (gloo, 1 intra-op thread, so no OpenMP wait and little noise from other
processes), digits, the default trainer keys (perf timer, progress, logging every 10 steps,
TensorBoard writer on). Alternates epochs of ``Trainer.train_epoch`` with epochs of the tight loop
(``ddp_tight.train_epoch``: same model and optimizer types, same batch), and prints the median
CPU seconds per step of each (``time.thread_time``: the time other processes take on the shared
cores is not counted) and their difference: what ddp_exp adds per step. With ``--profile`` it
also prints cProfile's top functions of ddp_exp's epochs (cumulative). With ``--calls CSV`` it
profiles both loops' epochs and writes every function ddp_exp's step calls more often than the
tight loop's (the calls the tight loop does not make), with its calls and cProfile's own time
per step (:mod:`benchmarks.probes.step_calls`): counts, which the machine's load cannot move.

    python -m benchmarks.probes.step_overhead [--epochs 30] [--profile] [--calls CSV]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from benchmarks import common  # noqa: E402
from benchmarks.baselines import ddp_tight  # noqa: E402


def trainer_cfg(overrides: list[str]):
    """The typed config a rank's Trainer takes (``ddp_exp.config.view.RankConfig``)."""
    import hydra
    from omegaconf import OmegaConf

    from ddp_exp.config.compose import register_configs
    from ddp_exp.config.view import rank_config

    register_configs()
    with hydra.initialize_config_module(config_module="ddp_exp.conf", version_base="1.3"):
        cfg = hydra.compose("config", overrides=["world_size=1", "optim=sgd", "optim.lr=0.05",
                                                 "optim.momentum=0.9", "trainer.progress=log",
                                                 *overrides])
    return rank_config(OmegaConf.to_container(cfg, resolve=True))


def _after_loop(method, seconds: list[float], clock):
    """``method``, adding its ``clock()`` time to ``seconds[0]``."""
    def timed(*args, **kwargs):
        t = clock()
        try:
            return method(*args, **kwargs)
        finally:
            seconds[0] += clock() - t
    return timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=30, help="epochs of each loop, alternating")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (a world_size=1 rank gets 2 on 2 cores); with more "
                        "than 1 the figures are wall seconds, since the other thread's work "
                        "is part of the step")
    p.add_argument("--epoch-outputs", nargs="?", const="val,best,last,flush", default="",
                   help="before each epoch, what a run does between epochs (not timed), a "
                        "comma list of val (validation, both loops), and ddp_exp's last "
                        "(last.pt), best (a new best epoch: last.pt and best.pt, one file) "
                        "and flush (TensorBoard), as Trainer.fit does; alone: all four")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--calls", default=None, metavar="CSV",
                   help="profile both loops and write the calls ddp_exp's step adds (per step) "
                        "to CSV, e.g. benchmarks/results/step_overhead/calls.csv")
    p.add_argument("--only", default=None,
                   help="with --profile: a regular expression of the files to list, e.g. ddp_exp")
    p.add_argument("overrides", nargs="*",
                   help="a second ddp_exp trainer with these overrides, e.g. "
                        "trainer.perf_metrics=false")
    args = p.parse_args()
    from ddp_exp.data import build_datasets, load_digits
    from ddp_exp.distributed.process_group import World, init_process_group
    from ddp_exp.metrics.writer import MetricsWriter
    from ddp_exp.train import checkpointing
    from ddp_exp.train.loop import Trainer
    from ddp_exp.train.models import MLP
    from ddp_exp.train.objective import Objective

    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    common.set_rendezvous(common.free_port())
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    world = World.from_env()
    init_process_group("gloo", world, 60)
    cfg = trainer_cfg([])
    datasets = build_datasets(load_digits(), 297, 0, 1)
    tmp = tempfile.mkdtemp(prefix="step-overhead-")

    after_loop = [0.0]  # thread seconds of the writes after each epoch's loop

    def make_trainer(overrides: list[str], name: str) -> Trainer:
        torch.manual_seed(0)
        trainer = Trainer(trainer_cfg(overrides), world, datasets, MLP((1, 8, 8), 10, [128]),
                          Objective(10), torch.device("cpu"),
                          MetricsWriter(os.path.join(tmp, name), {}, enabled=True))
        # The queued events and train/epoch_loss are written after the loop's clock stops
        # (train/samples_per_sec does not count them): leave them out here too.
        for method in ("write_queued", "scalars"):
            setattr(trainer.writer, method, _after_loop(getattr(trainer.writer, method),
                                                        after_loop, clock))
        return trainer

    trainers = {"ddp_exp": make_trainer([], "a")}
    if args.overrides:
        trainers["ddp_exp " + " ".join(args.overrides)] = make_trainer(args.overrides, "b")
    # The tight loop on its own copy of the model: benchmarks/baselines/ddp_tight.py's (a bare
    # nn.Sequential; ddp_exp's MLP holds the same layers, one module call deeper).
    torch.manual_seed(0)
    model = common.mlp(64, [128], 10)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    x = torch.from_numpy(datasets.train.features)
    y = torch.from_numpy(datasets.train.targets)
    sampler = DistributedSampler(range(len(x)), num_replicas=1, rank=0, shuffle=True, seed=0)
    batch = cfg.data.batch_size
    xv = torch.from_numpy(datasets.val.features)
    yv = torch.from_numpy(datasets.val.targets)

    def tight_epoch(epoch: int) -> float:
        sampler.set_epoch(epoch)
        t = clock()
        order = torch.tensor(list(sampler), dtype=torch.long)
        loss_sum = ddp_tight.train_epoch(ddp, opt, x, y, order, batch)
        totals = torch.stack([loss_sum, torch.tensor(float(len(order)), dtype=torch.float64)])
        dist.all_reduce(totals)
        totals.tolist()
        return clock() - t

    outputs = set(filter(None, args.epoch_outputs.split(",")))
    # This thread's CPU time, not wall time: the other processes on the cores do not count.
    prof = cProfile.Profile(time.thread_time_ns, 1e-9) if args.profile or args.calls else None
    tight_prof = cProfile.Profile(time.thread_time_ns, 1e-9) if args.calls else None
    steps = trainers["ddp_exp"].steps_per_epoch
    times: dict[str, list[float]] = {"tight": [], **{name: [] for name in trainers}}
    for epoch in range(args.epochs):
        # Each loop's epoch comes right after its own between-epoch work (of the epoch before).
        if "val" in outputs and epoch:
            common.evaluate(model, common.val_shard(xv, yv, 0, 1))
        if tight_prof:
            tight_prof.enable()
        times["tight"].append(tight_epoch(epoch) / steps)
        if tight_prof:
            tight_prof.disable()
        for name, trainer in trainers.items():
            if epoch:  # Trainer.fit's work between two epochs (--epoch-outputs), untimed
                if "val" in outputs:
                    trainer.evaluator.validate(trainer.epoch - 1, trainer.global_step)
                if outputs & {"best", "last"}:  # best: a new best epoch (best.pt too)
                    checkpointing.at_epoch_end(trainer, best="best" in outputs)
                if "flush" in outputs:
                    trainer.writer.flush()
            if prof and name == "ddp_exp":
                prof.enable()
            after_loop[0] = 0.0
            t = clock()
            trainer.train_epoch()
            times[name].append((clock() - t - after_loop[0]) / steps)
            if prof and name == "ddp_exp":
                prof.disable()
            trainer.epoch += 1
    tight = statistics.median(times["tight"])
    print(f"{steps} steps/epoch, {args.epochs} epochs each, interleaved; CPU time per step of "
          f"this thread (time.thread_time)" if args.threads == 1 else
          f"wall time per step, {args.threads} intra-op threads", "median (fastest epoch):")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"  {name:<40} {med * 1e6:7.1f} us ({min(values) * 1e6:7.1f})  "
              f"+{(med - tight) * 1e6:6.1f} us/step over tight; tight / it = {tight / med:.3f}")
    if tight_prof:
        from benchmarks.probes import step_calls

        rows = step_calls.added_calls(prof, tight_prof, steps * args.epochs)
        step_calls.write_csv(args.calls, rows)
        print(step_calls.table(rows, limit=40))
        print(f"function calls per step: ddp_exp "
              f"{step_calls.calls_per_step(prof, steps * args.epochs):.2f}, tight "
              f"{step_calls.calls_per_step(tight_prof, steps * args.epochs):.2f}")
    elif prof:
        stats = pstats.Stats(prof)
        if args.only:
            stats.sort_stats("cumtime").print_stats(args.only)
        else:
            stats.sort_stats("tottime").print_stats(25)
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)  # the writers' event files


if __name__ == "__main__":
    main()
