"""Hand-written DDP training on an image folder (issue 11, point 6): what ddp_exp's
``data=image_folder`` path is measured against.

Written the way a DDP tutorial reads images: a plain ``torch.utils.data.Dataset`` that opens one
PNG per ``__getitem__`` with Pillow (grey, ``[1, H, W]`` float32 in [0, 1]), a
``DataLoader(num_workers=2, persistent_workers=True)`` with a ``DistributedSampler`` and torch's
default collate, ``DDP`` around the CNN. Same files, split, model, optimizer, batch and epochs as
ddp_exp's job (``benchmarks/workloads.py``, checked by the runner before it measures):

* files: ``workloads.image_folder_split`` (ddp_exp's sorted file list, 297 held out by seed 0);
* model: ddp_exp's ``model=cnn`` built layer by layer in the same order under
  ``torch.manual_seed(0)``, so the initial weights are equal (the runner compares them);
* SGD lr 0.05, momentum 0.9; 32 per rank; ``DistributedSampler(seed=0)``;
* one intra-op thread per rank at world_size 2 (``cores // world_size``, ddp_exp's rule); torch
  sets its DataLoader workers to one thread;
* ranks forked by ``torch.multiprocessing`` (the parent runs no torch compute); the loss is
  all-reduced once per 10 steps (ddp_exp's ``trainer.log_every_n_steps``), no ``.item()`` per
  step;
* validation: the unpadded strided shard of the validation files per rank, through the same kind
  of loader, one all-reduce (not timed).

    python -m benchmarks.baselines.ddp_image_folder --data-path /tmp/digits_png --world-size 2

Prints one line ``BENCH_RESULT {json}``: training samples/s of the loop only (all ranks, rank 0's
loop time, first iteration of the loader and its workers' start included, as in ddp_exp), wall
seconds of this process, peak RSS per rank (max over ranks), losses.
"""

import time

T0 = time.time()  # wall time from the first line, imports included

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from PIL import Image  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, Dataset, DistributedSampler  # noqa: E402

from benchmarks import common, workloads  # noqa: E402
from benchmarks.workloads import LOG_EVERY_N_STEPS, LR, MOMENTUM, SEED  # noqa: E402


class PngFiles(Dataset):
    """``(path, label)`` pairs -> ``(float32 [1, H, W] in [0, 1], label)``, one file per item."""

    def __init__(self, files):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        path, label = self.files[i]
        with Image.open(path) as img:
            pixels = np.array(img.convert("L"), dtype=np.uint8)
        return torch.from_numpy(pixels)[None].to(torch.float32).div_(255.0), label


def build_cnn(in_channels, side, num_classes, channels=(32, 64), hidden=128):
    """ddp_exp's ``model=cnn`` (``ddp_exp.train.models.CNN``): conv3x3 + ReLU per channel count, 2x2
    max-pool while the image is at least 4 wide, then Linear + ReLU + Linear; seeded with
    ``SEED`` so that the parameters are created from the same draws in the same order."""
    torch.manual_seed(SEED)
    layers, c = [], in_channels
    for out in channels:
        layers += [nn.Conv2d(c, out, kernel_size=3, padding=1), nn.ReLU()]
        if side >= 4:
            layers.append(nn.MaxPool2d(2))
            side //= 2
        c = out
    layers += [nn.Flatten(), nn.Linear(c * side * side, hidden), nn.ReLU(),
               nn.Linear(hidden, num_classes)]
    return nn.Sequential(*layers)


def loader(files, sampler, batch_size, num_workers):
    return DataLoader(PngFiles(files), batch_size=batch_size, sampler=sampler,
                      num_workers=num_workers, persistent_workers=num_workers > 0)


def rank_main(rank, world_size, port, cfg, split, threads, result_path):
    common.init_rank(rank, world_size, port, threads)
    train_files, val_files = split
    num_classes = 1 + max(label for _, label in train_files)
    side = PngFiles(train_files)[0][0].shape[-1]
    model = build_cnn(1, side, num_classes, cfg["channels"], cfg["hidden"][0])
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    batch, workers = cfg["batch_size"], cfg["num_workers"]
    sampler = DistributedSampler(range(len(train_files)), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=SEED)
    train_loader = loader(train_files, sampler, batch, workers)
    val_loader = loader(val_files[rank::world_size], None, batch, workers)
    loop_s, world_samples, step = 0.0, 0, 0
    train_loss = val_loss = val_acc = None
    n_batches = len(train_loader)
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        t = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float64)
        count = 0
        epoch_loss, epoch_n = 0.0, 0
        for i, (xb, yb) in enumerate(train_loader):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(xb), yb)
            loss.backward()
            opt.step()
            step += 1
            loss_sum += loss.detach().double() * len(yb)
            count += len(yb)
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
        val_loss, val_acc = common.evaluate(model, val_loader)
    common.write_result(rank, result_path, world_samples, loop_s, train_loss, val_loss, val_acc)
    dist.destroy_process_group()


def main():
    p = common.parser(__doc__.splitlines()[0], start_method="fork")
    p.add_argument("--data-path", required=True,
                   help="the digits image folder (workloads.write_digits_pngs)")
    p.add_argument("--num-workers", type=int, default=None,
                   help="DataLoader workers per rank; default: the workload's (2)")
    args = p.parse_args()
    cfg = common.job_config(args, "image_folder")
    if args.num_workers is not None:
        cfg["num_workers"] = args.num_workers
    threads = max(1, common.cores() // args.world_size)
    split = workloads.image_folder_split(args.data_path)  # file names only, inherited by ranks
    result = common.run_world(rank_main, (args.world_size, common.free_port(), cfg, split,
                                          threads), args.world_size, args.start_method,
                              "ddp_image_folder")
    common.finish(result, T0, args, cfg, "ddp_image_folder", workload="image_folder",
                  num_workers=cfg["num_workers"], threads_per_rank=threads)


if __name__ == "__main__":
    main()
