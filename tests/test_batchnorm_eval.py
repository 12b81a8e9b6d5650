"""BatchNorm without ``ddp.sync_batchnorm``: every number reported is that of the saved model
(issue 26 item 4, case N02).

Under DDP each rank's BatchNorm updates its running statistics from its own shard; DDP copies
rank 0's buffers to the other ranks only before the next training forward. The validation and
test metrics must be those of rank 0's model, the one written to ``model.pt`` and
``checkpoints/*.pt``. Expected values: the saved files evaluated here, in one process, on the
whole split (independent of the run's evaluation code).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import scalars

from ddp_exp.data import build_datasets, load_digits
from ddp_exp.train.models import CNN

CHANNELS, HIDDEN = [8, 16], 32
VAL_SIZE, TEST_SIZE = 297, 300
BN_CNN = ("model=cnn", "model.batch_norm=true", f"model.channels=[{CHANNELS[0]},{CHANNELS[1]}]",
          f"model.hidden_size={HIDDEN}", f"data.test_size={TEST_SIZE}", "print_config=false")
REL = 1e-6  # float32 forwards in another batch split and summation order


def _one_process(state: dict, split: str) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of the CNN with ``state`` on the whole digits ``split``
    (``val`` or ``test``), in this process, in eval mode."""
    parts = build_datasets(load_digits(), VAL_SIZE, seed=0, world_size=1, test_size=TEST_SIZE)
    data = getattr(parts, split)
    model = CNN((1, 8, 8), 10, channels=CHANNELS, hidden_size=HIDDEN, batch_norm=True)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        out = model(torch.as_tensor(data.features)).double()
    y = torch.as_tensor(data.targets).long()
    return F.cross_entropy(out, y).item(), (out.argmax(1) == y).double().mean().item()


def _load(path: Path) -> dict:
    state = torch.load(path, weights_only=True)
    return state["model"] if "model" in state else state


@pytest.mark.parametrize(("world_size", "test_weights"), [(2, "last"), (3, "best")])
@pytest.mark.float_sensitive
def test_reported_metrics_are_those_of_the_saved_model(run_cli, world_size, test_weights):
    """At world_size 2 and 3 without SyncBatchNorm: val/* in metrics.json is model.pt's (and
    last.pt's) one-process evaluation, best/val/loss and the best epoch's val/accuracy are
    best.pt's, and test/* is that of the weights trainer.test_weights names."""
    run = run_cli(*BN_CNN, f"world_size={world_size}", "trainer.epochs=3",
                  f"trainer.test_weights={test_weights}").ok()
    m = run.metrics
    ckpt = run.job_dir / "checkpoints"
    final = _load(run.job_dir / "model.pt")
    # model.pt, last.pt and best.pt (when the last epoch was the best) hold the same buffers
    for key, value in _load(ckpt / "last.pt").items():
        assert torch.equal(value, final[key]), key

    loss, accuracy = _one_process(final, "val")
    assert math.isclose(m["val/loss"], loss, rel_tol=REL), (m["val/loss"], loss)
    assert m["val/accuracy"] == pytest.approx(accuracy, abs=1e-12)

    best = _load(ckpt / "best.pt")
    best_loss, best_accuracy = _one_process(best, "val")
    assert math.isclose(m["best/val/loss"], best_loss, rel_tol=REL), (m["best/val/loss"],
                                                                       best_loss)
    curve = scalars(run.job_dir, "val/accuracy")
    assert curve[m["best/epoch"] - 1][1] == pytest.approx(best_accuracy, abs=1e-6)

    scored = best if test_weights == "best" else final
    test_loss, test_accuracy = _one_process(scored, "test")
    assert math.isclose(m["test/loss"], test_loss, rel_tol=REL), (m["test/loss"], test_loss)
    assert m["test/accuracy"] == pytest.approx(test_accuracy, abs=1e-12)


@pytest.mark.float_sensitive
def test_accumulated_steps_report_the_saved_model(run_cli):
    """With gradient accumulation (micro-batches inside no_sync(), where DDP copies no buffers)
    the validation metrics are still model.pt's one-process evaluation."""
    run = run_cli(*BN_CNN, "world_size=2", "trainer.epochs=2", "data.batch_size=16",
                  "trainer.accumulate_grad_batches=2").ok()
    loss, accuracy = _one_process(_load(run.job_dir / "model.pt"), "val")
    assert math.isclose(run.metrics["val/loss"], loss, rel_tol=REL), (run.metrics["val/loss"],
                                                                      loss)
    assert run.metrics["val/accuracy"] == pytest.approx(accuracy, abs=1e-12)
