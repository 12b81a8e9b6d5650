"""What TensorBoard shows (cases U01, U02): ``train/loss`` exactly every
``trainer.log_every_n_steps`` global steps, each epoch's mean under ``train/epoch_loss``, and an
HParams table whose numbers are the ones in ``metrics.json``.

The expected losses are computed here, from the data and the seeded initial model
(``optim.lr=0.0`` freezes the weights) in the order ``DistributedSampler`` serves it; the
HParams numbers are read back through TensorBoard's own HParams plugin.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import QUIET, hparams_table, initial_mlp, scalars

from ddp_exp.data import build_datasets, load_digits

VAL, BATCH, EPOCHS, EVERY = 297, 50, 2, 4  # 750 samples per rank: 15 steps of 2 x 50 an epoch
STEPS_PER_EPOCH = (1797 - VAL) // 2 // BATCH


def frozen_step_losses() -> list[torch.Tensor]:
    """Per-sample losses (float64) of each global step's 100 samples, for the frozen seed-0
    MLP over two ranks of batch 50 and ``EPOCHS`` epochs."""
    from torch.utils.data import DistributedSampler

    ds = build_datasets(load_digits(), VAL, 0, 2)
    model = initial_mlp(0, ds)  # the default model, seeded, in eval mode
    with torch.no_grad():
        losses = F.cross_entropy(model(torch.from_numpy(ds.train.features)),
                                 torch.from_numpy(ds.train.targets), reduction="none").double()
    steps = []
    for epoch in range(EPOCHS):
        shards = []
        for rank in range(2):
            sampler = DistributedSampler(range(len(ds.train)), num_replicas=2, rank=rank,
                                         shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        for start in range(0, len(shards[0]), BATCH):
            steps.append(losses[shards[0][start:start + BATCH] + shards[1][start:start + BATCH]])
    return steps


@pytest.mark.smoke
@pytest.mark.float_sensitive
def test_train_loss_every_n_steps_epoch_loss_and_hparams_equal_metrics_json(run_cli):
    """U02: points at 4, 8, ..., 28 (the one at 16 averages steps 13-15 of epoch 1 and step 16
    of epoch 2), the epoch means at steps 15 and 30. U01: the HParams table's val/loss,
    val/accuracy and train/loss are metrics.json's numbers, bit for bit."""
    run = run_cli("world_size=2", f"data.val_size={VAL}", f"data.batch_size={BATCH}",
                  "optim.lr=0.0", f"trainer.epochs={EPOCHS}",
                  f"trainer.log_every_n_steps={EVERY}", QUIET).ok()
    steps = frozen_step_losses()
    total = EPOCHS * STEPS_PER_EPOCH
    assert len(steps) == total == 30

    points = scalars(run.job_dir, "train/loss")
    assert [s for s, _ in points] == list(range(EVERY, total + 1, EVERY))
    for step, value in points:
        window = torch.cat(steps[step - EVERY:step])
        assert len(window) == EVERY * 2 * BATCH
        assert value == pytest.approx(window.mean().item(), rel=1e-6), step
    for tag in ("train/lr", "train/samples_per_sec"):
        assert [s for s, _ in scalars(run.job_dir, tag)] == [s for s, _ in points], tag

    epochs = scalars(run.job_dir, "train/epoch_loss")
    assert [s for s, _ in epochs] == [STEPS_PER_EPOCH * (e + 1) for e in range(EPOCHS)]
    for e, (_, value) in enumerate(epochs):
        epoch = torch.cat(steps[e * STEPS_PER_EPOCH:(e + 1) * STEPS_PER_EPOCH])
        assert value == pytest.approx(epoch.mean().item(), rel=1e-6), e
    metrics = run.metrics
    assert metrics["train/epoch_loss"] == pytest.approx(
        torch.cat(steps[-STEPS_PER_EPOCH:]).mean().item(), rel=1e-6)

    (table,) = hparams_table(run.job_dir / "tensorboard").values()
    # every number of the table is metrics.json's (the recipe's best/* too; stopped_early as 0/1)
    assert {"val/loss", "val/accuracy", "train/epoch_loss", "best/val/loss"} <= set(table)
    assert table == {key: float(metrics[key]) for key in table}
    # The curve's last point (steps 25-28) is another number: the table does not show it.
    assert abs(points[-1][1] - table["train/epoch_loss"]) > 1e-6
