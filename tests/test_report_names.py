"""Issue 41 item 5's reports: each figure under its own name, and what a user would miss said in
the log.

* ``train/loss`` (TensorBoard's curve, the progress line) is one logging interval's mean;
  ``train/epoch_loss`` (the TensorBoard curve, metrics.json, the epoch lines, the HParams tab,
  the sweep summary) the last epoch's: two figures, two names.
* The progress bar's rate is labelled by its unit (``tokens_s`` under ``data=tokens``).
* A user's ``Dataset`` that trains without a validation set gets one WARNING naming
  ``data.val_size``.
* The GPT preset's text sample is in the log as in TensorBoard; without
  ``trainer.peak_flops`` one line says why there is no ``perf/mfu``.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import QUIET, hparams_table, run_once, scalars, tests_on_path

from ddp_exp.job import summary
from ddp_exp.metrics.progress import Progress


def test_the_progress_bar_labels_its_rate_by_unit():
    """data=tokens counts tokens: the bar says tokens_s; other data samples_s."""
    for unit in ("tokens", "samples"):
        progress = Progress("bar", 0, 1, 10, unit)
        progress.interval(1.5, 12345.0)
        postfix = progress.bar.postfix
        progress.close()
        assert f"{unit}_s=12,345" in postfix and "loss=1.5000" in postfix, postfix


def test_the_progress_counts_the_steps_the_epoch_will_run():
    """A fresh user's find: ``trainer.max_steps=300`` at 547 steps an epoch showed ``step
    240/547``. The total is where the epoch stops: max_steps part-way, counting a resumed
    epoch's steps done (``done``) and the run's before it (``global_step``)."""
    from ddp_exp.metrics.progress import steps_in_epoch

    assert steps_in_epoch(547, 0, 0, 300) == 300
    assert steps_in_epoch(547, 0, 0, None) == 547
    assert steps_in_epoch(100, 0, 200, 250) == 50  # the third epoch stops at step 250
    assert steps_in_epoch(100, 30, 230, 250) == 50  # resumed 30 steps into it
    assert steps_in_epoch(100, 0, 0, 1000) == 100
    assert steps_in_epoch(100, 0, 300, 250) == 0  # max_steps already reached


def test_the_summary_names_the_epoch_mean(tmp_path):
    """A sweep's summary row takes metrics.json's train/epoch_loss under that name."""
    job = tmp_path / "0"
    (job / ".hydra").mkdir(parents=True)
    (job / "metrics.json").write_text(json.dumps({"val/loss": 0.5, "train/epoch_loss": 0.25}))
    (job / ".hydra" / "overrides.yaml").write_text("- seed=1\n")
    (row,) = summary.collect(str(tmp_path))
    assert row["train/epoch_loss"] == 0.25 and "train/loss" not in row
    assert "train/epoch_loss" in summary.columns([row])


@pytest.mark.slow
def test_a_users_dataset_without_validation_warns_and_names_both_losses(tmp_path, monkeypatch):
    """data=dataset holds out nothing by default: one WARNING naming data.val_size. The run's
    metrics.json and HParams tab carry train/epoch_loss (the last epoch_loss point), not
    train/loss, whose curve's last point is another interval's figure."""
    monkeypatch.setenv("PYTHONPATH", tests_on_path()["PYTHONPATH"])
    run = run_once(tmp_path, "data=dataset", "data._target_=lazy_data.DigitsDataset",
                   "world_size=1", "trainer.epochs=2", "trainer.log_every_n_steps=7", QUIET)
    warnings = [line for line in run.stdout.splitlines() if "[WARNING]" in line]
    assert len(warnings) == 1 and "no validation set (data.val_size=0)" in warnings[0], warnings
    assert "set data.val_size=N" in warnings[0]
    m = run.metrics
    assert "train/loss" not in m and m["val/loss"] is None
    epochs = scalars(run.job_dir, "train/epoch_loss")
    assert len(epochs) == 2 and m["train/epoch_loss"] == pytest.approx(epochs[-1][1], rel=1e-6)
    intervals = scalars(run.job_dir, "train/loss")
    assert abs(intervals[-1][1] - m["train/epoch_loss"]) > 1e-6  # another figure
    (table,) = hparams_table(run.job_dir / "tensorboard").values()
    assert table["train/epoch_loss"] == m["train/epoch_loss"] and "train/loss" not in table
    assert f"train/epoch_loss {m['train/epoch_loss']:.4f}" in run.stdout  # the epoch line


@pytest.mark.slow
def test_the_gpt_sample_is_in_the_log_and_a_missing_mfu_is_explained(tmp_path):
    """The preset's text sample, logged by rank 0 as TensorBoard has it; no peak_flops: one
    line says perf/mfu is not reported and why."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = run_once(tmp_path, "experiment=gpt_tokens", "world_size=1", "model.n_layer=1",
                   "model.n_embd=32", "data.batch_size=4", "trainer.epochs=1",
                   "trainer.max_steps=3", "scheduler.warmup_steps=1",
                   "trainer.limit_val_batches=1", QUIET)
    (events,) = (run.job_dir / "tensorboard").glob("events.out.tfevents*")
    acc = EventAccumulator(str(events), size_guidance={"tensors": 0})
    acc.Reload()
    (text,) = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("samples/text_summary")]
    assert text.startswith("    The ")
    # control characters (an untrained model's \\r, \\x1b) as escapes: the log stays lines
    named = {"\t": "\\t", "\r": "\\r"}
    shown = "".join(c if c.isprintable() or c == "\n" else named.get(c) or (
        f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}") for c in text)
    assert f"sample after epoch 1 (trainer.sample_prompt='The ', 120 tokens):\n{shown}\n" in (
        run.stdout)
    assert run.stdout.count("perf/mfu is not reported: set trainer.peak_flops") == 1
    # the whole sentence (a fresh user's find: it stopped at "perf/model_flops_per_sec is")
    assert "; perf/model_flops_per_sec is reported either way\n" in run.stdout
    assert "perf/mfu" not in run.metrics
    assert torch.isfinite(torch.tensor(run.metrics["perf/model_flops_per_sec"]))
