"""The tightest hand-written DDP loop (issue 13): the second hand-written baseline.

Same model (seeded MLP), data (ddp_exp's arrays, see workloads.py), optimizer (SGD lr 0.05,
momentum 0.9), sampler (``DistributedSampler``, seed 0), per-rank batch and epochs as ddp_exp and
``ddp_tuned.py``; it trains the same steps on the same batches. What it does, and nothing else:

* ``torch.set_num_threads(cores // world_size)`` per rank, ranks forked from a parent that loaded
  the data once (as ``ddp_tuned.py``);
* per epoch, the rank's whole shard is gathered once (one ``index_select`` of the epoch's
  sampler order), and each step's batch is a slice of it (a view: no copy, no gather per step);
* the loss sum stays on the device (``loss_sum += loss.detach() * B`` per step, no host sync)
  and is all-reduced once per epoch with the sample count;
* per step: ``zero_grad``, forward, ``backward`` (DDP's all-reduce), ``step``. No logging, no
  timer, no progress, no checkpoint.

    python benchmarks/ddp_tight.py --workload digits --world-size 2

Prints one line ``BENCH_RESULT {json}``: training samples/s of the loop only (all ranks, rank 0's
loop time), wall seconds of this process, peak RSS per rank (max over ranks), losses.
"""

import time

T0 = time.time()  # wall time from the first line, imports included

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import workloads  # noqa: E402
from ddp_tuned import build_model, evaluate  # noqa: E402
from workloads import LR, MOMENTUM, SEED  # noqa: E402


def rank_main(rank, world_size, port, cfg, arrays, threads, result_path):
    common.set_rendezvous(port)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    xtr, ytr, xva, yva, num_classes = arrays
    x, y = torch.from_numpy(xtr), torch.from_numpy(ytr)
    xv, yv = torch.from_numpy(xva), torch.from_numpy(yva)
    model = build_model(x[0].numel(), cfg["hidden"], num_classes)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    sampler = DistributedSampler(range(len(x)), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=SEED)
    batch = cfg["batch_size"]
    loop_s, world_samples = 0.0, 0
    train_loss = val_loss = val_acc = None
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        t = time.perf_counter()
        order = torch.tensor(list(sampler), dtype=torch.long)
        xs, ys = x.index_select(0, order), y.index_select(0, order)  # the epoch's shard, once
        n = len(order)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for start in range(0, n, batch):
            xb, yb = xs[start:start + batch], ys[start:start + batch]
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(xb), yb)
            loss.backward()
            opt.step()
            loss_sum += loss.detach().double() * len(xb)
        totals = torch.stack([loss_sum, torch.tensor(float(n), dtype=torch.float64)])
        dist.all_reduce(totals)  # the epoch's one host sync
        loop_s += time.perf_counter() - t
        s, count = totals.tolist()
        world_samples += int(count)
        train_loss = s / count
        val_loss, val_acc = evaluate(model, xv, yv, rank, world_size)
    rss = torch.tensor([common.peak_rss_mib()], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(result_path, "w") as fh:
            json.dump({"samples_per_sec": world_samples / loop_s, "train_s": loop_s,
                       "train_samples": world_samples, "train_loss": train_loss,
                       "val_loss": val_loss, "val_accuracy": val_acc,
                       "peak_rss_mib_rank0": common.peak_rss_mib(),
                       "peak_rss_mib_per_rank": rss.item()}, fh)
    dist.destroy_process_group()


def main():
    p = common.parser(__doc__.splitlines()[0], start_method="fork")
    args = p.parse_args()
    cfg = workloads.spec(args.workload, args.num_train)
    cfg["epochs"] = args.epochs or cfg["epochs"]
    cfg["batch_size"] = args.batch_size or cfg["batch_size"]
    threads = max(1, common.cores() // args.world_size)
    arrays = workloads.load(args.workload, args.num_train)  # once, inherited by forked ranks
    with tempfile.TemporaryDirectory(prefix="ddp_tight-") as tmp:
        path = os.path.join(tmp, "rank0.json")
        mp.start_processes(rank_main, args=(args.world_size, common.free_port(), cfg, arrays,
                                            threads, path),
                           nprocs=args.world_size, join=True, start_method=args.start_method)
        result = common.read_partial(path)
    result.update({"script": "ddp_tight", "workload": args.workload,
                   "world_size": args.world_size, "batch_size": cfg["batch_size"],
                   "epochs": cfg["epochs"], "threads_per_rank": threads,
                   "start_method": args.start_method, "wall_s": time.time() - T0})
    common.emit(result, args.out)


if __name__ == "__main__":
    main()
