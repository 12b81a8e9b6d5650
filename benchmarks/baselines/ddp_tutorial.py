r"""Tutorial-style DDP training, as in PyTorch's "Getting Started with DDP" (issue 5).

Same model (seeded MLP), data (ddp_exp's arrays, see ``benchmarks/workloads.py``), optimizer
(SGD lr 0.05, momentum 0.9), per-rank batch and epochs as ddp_exp, written the way the tutorials
do it: ``mp.spawn``; every rank loads the data itself; ``TensorDataset`` + ``DataLoader`` with a
``DistributedSampler`` (per-sample ``__getitem__`` and default collate); ``loss.item()`` every
step; torch's default intra-op threads (one per core in every rank). ``--threads-per-rank 1``
is the variant with one thread per rank.

    python -m benchmarks.baselines.ddp_tutorial --workload digits --world-size 2
    python -m benchmarks.baselines.ddp_tutorial --workload digits --world-size 2 \
        --threads-per-rank 1

Prints one line ``BENCH_RESULT {json}``: training samples/s of the loop only (all ranks, rank 0's
loop time), wall seconds of this process, peak RSS per rank (max over ranks), losses.
"""

import time

T0 = time.time()  # wall time from the first line, imports included

import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from benchmarks import common, workloads  # noqa: E402
from benchmarks.workloads import LR, MOMENTUM, SEED  # noqa: E402


class MLP(nn.Module):
    def __init__(self, in_features, hidden, num_classes):
        super().__init__()
        self.net = common.mlp(in_features, hidden, num_classes)

    def forward(self, x):
        return self.net(x)


def train(rank, world_size, port, args, cfg, result_path):
    common.init_rank(rank, world_size, port, args.threads_per_rank)
    xtr, ytr, xva, yva, num_classes = workloads.load(args.workload, args.num_train)
    dataset = TensorDataset(torch.from_numpy(xtr), torch.from_numpy(ytr))
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=SEED)
    loader = DataLoader(dataset, batch_size=cfg["batch_size"], sampler=sampler)

    torch.manual_seed(SEED)
    model = MLP(int(xtr[0].size), cfg["hidden"], num_classes)
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=LR, momentum=MOMENTUM)

    loop_s, samples = 0.0, 0
    train_loss = val_loss = val_acc = None
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        t = time.perf_counter()
        running_loss, seen = 0.0, 0
        for xb, yb in loader:
            optimizer.zero_grad()
            outputs = ddp_model(xb)
            loss = F.cross_entropy(outputs, yb)
            loss.backward()
            optimizer.step()
            running_loss += loss.item() * len(xb)
            seen += len(xb)
        loop_s += time.perf_counter() - t
        samples += seen
        train_loss = running_loss / seen  # this rank's, as tutorials print it
        val_loss, val_acc = common.evaluate(model, common.val_shard(
            torch.from_numpy(xva), torch.from_numpy(yva), rank, world_size))
    world_samples = torch.tensor([float(samples)], dtype=torch.float64)
    dist.all_reduce(world_samples)
    common.write_result(rank, result_path, int(world_samples.item()), loop_s, train_loss,
                        val_loss, val_acc, threads_per_rank=torch.get_num_threads())
    dist.destroy_process_group()
    # The result is written. Leave without interpreter teardown: 1 run in ~15 aborted there
    # ("terminate called without an active exception", a native thread still joinable when
    # the DDP reducer is freed), which is a fault of the teardown, not of what is measured.
    sys.stdout.flush()
    os._exit(0)


def main():
    p = common.parser(__doc__.splitlines()[0], start_method="spawn")
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="default: not set (torch's default, one thread per core in every rank)")
    args = p.parse_args()
    cfg = common.job_config(args, args.workload)
    result = common.run_world(train, (args.world_size, common.free_port(), args, cfg),
                              args.world_size, args.start_method, "ddp_tutorial")
    common.finish(result, T0, args, cfg, "ddp_tutorial")


if __name__ == "__main__":
    main()
