"""Hand-tuned DDP training, written the way someone who knows DDP on CPUs would (issue 5).

Same model (seeded MLP), data (ddp_exp's arrays, see ``benchmarks/workloads.py``), optimizer
(SGD lr 0.05, momentum 0.9), per-rank batch and epochs as ddp_exp. What makes it fast:

* ``torch.set_num_threads(cores // world_size)`` in each rank (no oversubscription);
* the data set is loaded once in the parent; ranks are forked and inherit it (the parent runs no
  torch compute, so fork is safe);
* batches are cut by ``index_select`` from the sampler's indices (no per-sample ``__getitem__``
  and collate);
* the loss is summed on the device and all-reduced once per 10 steps (no ``loss.item()`` per
  step).

    python -m benchmarks.baselines.ddp_tuned --workload digits --world-size 2

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
from benchmarks.workloads import LOG_EVERY_N_STEPS, LR, MOMENTUM, SEED  # noqa: E402


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
    batch = cfg["batch_size"]
    loop_s, world_samples, step = 0.0, 0, 0
    train_loss = val_loss = val_acc = None
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        t = time.perf_counter()
        order = torch.tensor(list(sampler), dtype=torch.long)
        n_batches = (len(order) + batch - 1) // batch
        loss_sum = torch.zeros((), dtype=torch.float64)
        count = 0
        epoch_loss, epoch_n = 0.0, 0
        for i in range(n_batches):
            idx = order[i * batch:(i + 1) * batch]
            xb, yb = x.index_select(0, idx), y.index_select(0, idx)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(xb), yb)
            loss.backward()
            opt.step()
            step += 1
            loss_sum += loss.detach().double() * len(idx)
            count += len(idx)
            if step % LOG_EVERY_N_STEPS == 0 or i == n_batches - 1:
                totals = torch.stack([loss_sum, torch.tensor(float(count), dtype=torch.float64)])
                dist.all_reduce(totals)  # the one host sync of the interval
                s, n = totals.tolist()
                epoch_loss, epoch_n = epoch_loss + s, epoch_n + int(n)
                loss_sum.zero_()
                count = 0
        loop_s += time.perf_counter() - t
        world_samples += epoch_n
        train_loss = epoch_loss / epoch_n
        val_loss, val_acc = common.evaluate(model, common.val_shard(xv, yv, rank, world_size))
    common.write_result(rank, result_path, world_samples, loop_s, train_loss, val_loss, val_acc)
    dist.destroy_process_group()


def main():
    p = common.parser(__doc__.splitlines()[0], start_method="fork")
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="default: cores // world_size (at least 1)")
    args = p.parse_args()
    cfg = common.job_config(args, args.workload)
    threads = args.threads_per_rank or max(1, common.cores() // args.world_size)
    arrays = workloads.load(args.workload, args.num_train)  # once, inherited by forked ranks
    result = common.run_world(rank_main, (args.world_size, common.free_port(), cfg, arrays,
                                          threads), args.world_size, args.start_method,
                              "ddp_tuned")
    common.finish(result, T0, args, cfg, "ddp_tuned", threads_per_rank=threads)


if __name__ == "__main__":
    main()
