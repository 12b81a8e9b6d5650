"""Tutorial-style DDP training, as in PyTorch's "Getting Started with DDP" (issue 5).

Same model (seeded MLP), data (ddp_exp's arrays, see workloads.py), optimizer (SGD lr 0.05,
momentum 0.9), per-rank batch and epochs as ddp_exp, written the way the tutorials do it:
``mp.spawn``; every rank loads the data itself; ``TensorDataset`` + ``DataLoader`` with a
``DistributedSampler`` (per-sample ``__getitem__`` and default collate); ``loss.item()`` every
step; torch's default intra-op threads (one per core in every rank). ``--threads-per-rank 1``
is the variant with one thread per rank.

    python benchmarks/ddp_tutorial.py --workload digits --world-size 2 [--threads-per-rank 1]

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
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import workloads  # noqa: E402
from workloads import LR, MOMENTUM, SEED  # noqa: E402

EVAL_BATCH = 512


class MLP(nn.Module):
    def __init__(self, in_features, hidden, num_classes):
        super().__init__()
        layers = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def setup(rank, world_size, port):
    common.set_rendezvous(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


@torch.no_grad()
def evaluate(model, x, y, rank, world_size):
    model.eval()
    xs, ys = x[rank::world_size], y[rank::world_size]
    totals = torch.zeros(3, dtype=torch.float64)
    for s in range(0, len(xs), EVAL_BATCH):
        out = model(xs[s:s + EVAL_BATCH])
        yb = ys[s:s + EVAL_BATCH]
        totals[0] += F.cross_entropy(out, yb, reduction="sum").double()
        totals[1] += (out.argmax(1) == yb).sum()
        totals[2] += len(yb)
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def train(rank, world_size, port, args, cfg, result_path):
    setup(rank, world_size, port)
    if args.threads_per_rank:
        torch.set_num_threads(args.threads_per_rank)
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
        val_loss, val_acc = evaluate(model, torch.from_numpy(xva), torch.from_numpy(yva), rank,
                                     world_size)
    totals = torch.tensor([float(samples), common.peak_rss_mib()], dtype=torch.float64)
    world_samples = totals[:1].clone()
    dist.all_reduce(world_samples)
    rss = totals[1:].clone()
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(result_path, "w") as fh:
            json.dump({"samples_per_sec": world_samples.item() / loop_s, "train_s": loop_s,
                       "train_samples": int(world_samples.item()), "train_loss": train_loss,
                       "val_loss": val_loss, "val_accuracy": val_acc,
                       "threads_per_rank": torch.get_num_threads(),
                       "peak_rss_mib_rank0": common.peak_rss_mib(),
                       "peak_rss_mib_per_rank": rss.item()}, fh)
    cleanup()
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
    cfg = workloads.spec(args.workload, args.num_train)
    cfg["epochs"] = args.epochs or cfg["epochs"]
    cfg["batch_size"] = args.batch_size or cfg["batch_size"]
    with tempfile.TemporaryDirectory(prefix="ddp_tutorial-") as tmp:
        path = os.path.join(tmp, "rank0.json")
        mp.start_processes(train, args=(args.world_size, common.free_port(), args, cfg, path),
                           nprocs=args.world_size, join=True, start_method=args.start_method)
        result = common.read_partial(path)
    result.update({"script": "ddp_tutorial", "workload": args.workload,
                   "world_size": args.world_size, "batch_size": cfg["batch_size"],
                   "epochs": cfg["epochs"], "start_method": args.start_method,
                   "wall_s": time.time() - T0})
    common.emit(result, args.out)


if __name__ == "__main__":
    main()
