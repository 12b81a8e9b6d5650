"""The tightest hand-written DDP loop (issue 13): the second hand-written baseline.

Same model (seeded MLP), data (ddp_exp's arrays, see ``benchmarks/workloads.py``), optimizer (SGD lr
0.05, momentum 0.9), sampler (``DistributedSampler``, seed 0), per-rank batch and epochs as ddp_exp
and ``ddp_tuned.py``; it trains the same steps on the same batches. What it does, and nothing else:

* ``torch.set_num_threads(cores // world_size)`` per rank, ranks forked from a parent that loaded
  the data once (as ``ddp_tuned.py``);
* per epoch, the rank's whole shard is gathered once (one ``index_select`` of the epoch's
  sampler order), and each step's batch is a slice of it (a view: no copy, no gather per step);
* the loss sum stays on the device (``loss_sum += loss.detach() * B`` per step, no host sync)
  and is all-reduced once per epoch with the sample count;
* per step: ``zero_grad``, forward, ``backward`` (DDP's all-reduce), ``step``. No logging, no
  timer, no progress, no checkpoint.

    python -m benchmarks.baselines.ddp_tight --workload digits --world-size 2

Prints one line ``BENCH_RESULT {json}``: training samples/s of the loop only (all ranks, rank 0's
loop time), wall seconds of this process, peak RSS per rank (max over ranks), losses.
"""

import time

T0 = time.time()  # wall time from the first line, imports included

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

from benchmarks import common, workloads  # noqa: E402
from benchmarks.workloads import LR, MOMENTUM, SEED  # noqa: E402


def train_epoch(ddp, opt, x, y, order, batch):
    """One epoch of the tight loop over the rank's samples ``order`` ([n] indices of ``x`` [N,
    ...] and ``y`` [N]) in batches of ``batch``. Returns the rank's loss sum (float64 scalar
    tensor, still on the device: no host sync in the loop)."""
    xs, ys = x.index_select(0, order), y.index_select(0, order)  # the epoch's shard, once
    loss_sum = torch.zeros((), dtype=torch.float64)
    for start in range(0, len(order), batch):
        xb, yb = xs[start:start + batch], ys[start:start + batch]
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(xb), yb)
        loss.backward()
        opt.step()
        loss_sum += loss.detach().double() * len(xb)
    return loss_sum


def rank_main(rank, world_size, port, cfg, arrays, threads, result_path):
    common.init_rank(rank, world_size, port, threads)
    xtr, ytr, xva, yva, num_classes = arrays
    x, y = torch.from_numpy(xtr), torch.from_numpy(ytr)
    xv, yv = torch.from_numpy(xva), torch.from_numpy(yva)
    torch.manual_seed(SEED)
    model = common.mlp(x[0].numel(), cfg["hidden"], num_classes)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    sampler = DistributedSampler(range(len(x)), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=SEED)
    loop_s, world_samples = 0.0, 0
    train_loss = val_loss = val_acc = None
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        t = time.perf_counter()
        order = torch.tensor(list(sampler), dtype=torch.long)
        loss_sum = train_epoch(ddp, opt, x, y, order, cfg["batch_size"])
        totals = torch.stack([loss_sum, torch.tensor(float(len(order)), dtype=torch.float64)])
        dist.all_reduce(totals)  # the epoch's one host sync
        loop_s += time.perf_counter() - t
        s, count = totals.tolist()
        world_samples += int(count)
        train_loss = s / count
        val_loss, val_acc = common.evaluate(model, common.val_shard(xv, yv, rank, world_size))
    common.write_result(rank, result_path, world_samples, loop_s, train_loss, val_loss, val_acc)
    dist.destroy_process_group()


def main():
    p = common.parser(__doc__.splitlines()[0], start_method="fork")
    args = p.parse_args()
    cfg = common.job_config(args, args.workload)
    threads = max(1, common.cores() // args.world_size)
    arrays = workloads.load(args.workload, args.num_train)  # once, inherited by forked ranks
    result = common.run_world(rank_main, (args.world_size, common.free_port(), cfg, arrays,
                                          threads), args.world_size, args.start_method,
                              "ddp_tight")
    common.finish(result, T0, args, cfg, "ddp_tight", threads_per_rank=threads)


if __name__ == "__main__":
    main()
