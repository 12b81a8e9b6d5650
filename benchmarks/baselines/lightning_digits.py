"""The same MLP job through Lightning's Trainer (``strategy="ddp"``, CPU), issue 5's baseline.

Same model (seeded MLP), data (ddp_exp's arrays, see ``benchmarks/workloads.py``), optimizer (SGD lr
0.05, momentum 0.9), per-rank batch and epochs as ddp_exp; no logger, checkpointing, progress bar,
model summary or sanity validation. Lightning's DDP launcher re-runs this script once per extra
rank; this process is rank 0. Lightning sets ``cores // devices`` intra-op threads itself when
``OMP_NUM_THREADS`` is unset. The default workload is digits (``--workload compute`` also works).

    python -m benchmarks.baselines.lightning_digits --world-size 2

Exits with status 3 when ``import lightning`` fails (install the ``bench`` extra:
``pip install -e ".[bench]"``). Prints one line ``BENCH_RESULT {json}`` like the other scripts.
"""

import time

T0 = time.time()  # wall time from the first line, imports included

import sys  # noqa: E402

from benchmarks import common, workloads  # noqa: E402
from benchmarks.workloads import LR, MOMENTUM, SEED  # noqa: E402

try:
    import lightning as L
except ImportError as exc:
    print(f"skipped: install the bench extra (import lightning failed: {exc})", file=sys.stderr)
    raise SystemExit(common.EXIT_SKIPPED) from None

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


class LitMLP(L.LightningModule):
    def __init__(self, in_features, hidden, num_classes):
        super().__init__()
        self.net = common.mlp(in_features, hidden, num_classes)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        self.log("val_loss", F.cross_entropy(out, y), sync_dist=True, batch_size=len(y))
        self.log("val_accuracy", (out.argmax(1) == y).float().mean(), sync_dist=True,
                 batch_size=len(y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


class Meter(L.Callback):
    """Training-loop seconds (first batch start to last batch end, per epoch, rank 0's clock),
    samples of all ranks, and peak RSS per rank (max over ranks)."""

    def __init__(self):
        self.loop_s, self.samples, self.t0, self.t_last, self.result = 0.0, 0, 0.0, None, None

    def on_train_epoch_start(self, trainer, pl_module):
        self.t0, self.t_last = time.perf_counter(), None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.t_last = time.perf_counter()
        self.samples += len(batch[0])

    def on_train_epoch_end(self, trainer, pl_module):
        if self.t_last is not None:
            self.loop_s += self.t_last - self.t0

    def on_train_end(self, trainer, pl_module):
        samples = torch.tensor([float(self.samples)], dtype=torch.float64)
        rss = torch.tensor([common.peak_rss_mib()], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(samples)
            dist.all_reduce(rss, op=dist.ReduceOp.MAX)
        metrics = trainer.callback_metrics
        self.result = common.result(
            int(samples.item()), self.loop_s, None,
            float(metrics["val_loss"]) if "val_loss" in metrics else None,
            float(metrics["val_accuracy"]) if "val_accuracy" in metrics else None,
            threads_per_rank=torch.get_num_threads(), peak_rss_mib_rank0=common.peak_rss_mib(),
            peak_rss_mib_per_rank=rss.item())


def main():
    p = common.parser(__doc__.splitlines()[0], start_method="spawn")
    args = p.parse_args()
    cfg = common.job_config(args, args.workload)
    L.seed_everything(SEED, verbose=False)  # also the seed of Lightning's DistributedSampler
    xtr, ytr, xva, yva, num_classes = workloads.load(args.workload, args.num_train)
    train = DataLoader(TensorDataset(torch.from_numpy(xtr), torch.from_numpy(ytr)),
                       batch_size=cfg["batch_size"], shuffle=True)
    val = DataLoader(TensorDataset(torch.from_numpy(xva), torch.from_numpy(yva)),
                     batch_size=common.EVAL_BATCH)
    torch.manual_seed(SEED)
    model = LitMLP(int(xtr[0].size), cfg["hidden"], num_classes)
    meter = Meter()
    trainer = L.Trainer(accelerator="cpu", devices=args.world_size, strategy="ddp",
                        max_epochs=cfg["epochs"], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[meter])
    trainer.fit(model, train, val)
    if trainer.global_rank == 0:
        common.finish(meter.result, T0, args, cfg, "lightning", start_method="subprocess")
    # Leave the process group before exit: left to interpreter shutdown, gloo's threads are
    # sometimes destroyed while joinable ("terminate called without an active exception").
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
