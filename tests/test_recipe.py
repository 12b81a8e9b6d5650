"""The training recipe (issue 15, "Behaviour that must hold" 1-7): LR schedules, gradient
clipping, SyncBatchNorm, best checkpoint, early stopping and a test split, all exact under DDP.

Expected values come from elsewhere than the run under test: a world_size=1 run on the same
global batch, an uninterrupted run, the closed-form schedule written out here, the TensorBoard
validation curve, torch's own ``nn.BatchNorm``, or the seeded initial model evaluated in this
process.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from faulty import write_model_yaml
from helpers import (
    QUIET,
    UNREACHABLE,
    cosine_lr,
    digits_split,
    initial_mlp,
    load_ckpt,
    refused_before_ranks,
    rel_close,
    scalars,
    tensorboard_series,
    tests_on_path,
)

SMALL_CNN = ("model=cnn", "model.channels=[4,8]", "model.hidden_size=16")


def best_by_curve(curve: list[tuple[int, float]], mode: str) -> int:
    """1-based epoch of the best validation value of a per-epoch TensorBoard curve (first best
    wins: a tie is no improvement)."""
    values = [v for _, v in curve]
    best = 0
    for i, v in enumerate(values):
        if (v < values[best]) if mode == "min" else (v > values[best]):
            best = i
    return best + 1


def stop_epoch_by_curve(curve: list[tuple[int, float]], mode: str, patience: int) -> int | None:
    """1-based epoch after which early stopping must stop, from the validation curve."""
    best, bad = None, 0
    for epoch, (_, v) in enumerate(curve, start=1):
        if best is None or ((v < best) if mode == "min" else (v > best)):
            best, bad = v, 0
        else:
            bad += 1
        if bad >= patience:
            return epoch
    return None


def assert_state_close(got: dict, ref: dict, rel: float) -> None:
    assert got.keys() == ref.keys() and len(ref) > 0
    for name in ref:
        torch.testing.assert_close(got[name].double(), ref[name].double(), rtol=rel, atol=rel,
                                   msg=name)


# ----------------------------------------------------------------- SyncBatchNorm, in process
def test_cpu_sync_batchnorm_equals_batchnorm_in_one_process():
    """Forward, input/parameter gradients and running statistics of the CPU path equal
    torch's BatchNorm (one process: the world's batch is the batch)."""
    from ddp_exp.distributed.sync_batchnorm import CPUSyncBatchNorm, convert_sync_batchnorm

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.BatchNorm2d(4),
                              torch.nn.Flatten(), torch.nn.Linear(36 * 4, 3),
                              torch.nn.BatchNorm1d(3, momentum=None))
    synced = convert_sync_batchnorm(copy.deepcopy(ref), "cpu")
    assert sum(isinstance(m, CPUSyncBatchNorm) for m in synced.modules()) == 2
    for _ in range(3):
        x = torch.randn(16, 2, 8, 8)
        x_ref, x_syn = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ref, y_syn = ref(x_ref), synced(x_syn)
        torch.testing.assert_close(y_syn, y_ref, rtol=1e-5, atol=1e-5)
        g = torch.randn_like(y_ref)
        (y_ref * g).sum().backward()
        (y_syn * g).sum().backward()
        torch.testing.assert_close(x_syn.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for (name, p_ref), (_, p_syn) in zip(ref.named_parameters(), synced.named_parameters(),
                                         strict=True):
        torch.testing.assert_close(p_syn.grad, p_ref.grad, rtol=1e-5, atol=1e-5, msg=name)
    assert_state_close(synced.state_dict(), ref.state_dict(), 1e-6)
    ref.eval(), synced.eval()
    x = torch.randn(5, 2, 8, 8)
    torch.testing.assert_close(synced(x), ref(x))


# ------------------------------------------------------------- clipping under loss scaling
@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.float_sensitive
def test_optimizer_step_unscales_before_clipping_and_measuring(clip):
    """16-mixed's path (a GradScaler; its CPU variant here, since 16-mixed needs CUDA): the
    norm is measured and clipped on unscaled gradients, so the step and the reported
    ``train/grad_norm`` equal those of the unscaled run (the scale is a power of 2: exact)."""
    from ddp_exp.train.optimizer import OptimizerStep, grad_scaler

    assert grad_scaler("32-true", torch.device("cpu")) is None
    runs = []
    for scaler in (None, torch.amp.GradScaler("cpu")):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        step = OptimizerStep(optimizer, scaler, clip, list(model.parameters()))
        loss = F.mse_loss(model(torch.randn(8, 6)), torch.randn(8, 3))
        (loss if scaler is None else scaler.scale(loss)).backward()
        norm = step.step(measure_norm=True)
        runs.append((float(norm), [p.detach().clone() for p in model.parameters()]))
    (norm, params), (scaled_norm, scaled_params) = runs
    assert norm == pytest.approx(scaled_norm, rel=1e-6) and norm > (clip or 0)
    for p, q in zip(params, scaled_params, strict=True):
        torch.testing.assert_close(q, p)


# ------------------------------------------------------------------------- the split, unit
def test_test_split_is_disjoint_and_leaves_validation_unchanged():
    from ddp_exp.data import build_datasets, load_digits

    data = load_digits()
    plain = build_datasets(data, 297, 0, 2)
    split = build_datasets(data, 297, 0, 2, test_size=200)
    assert len(split.test) == 200 and len(split.val) == 297 and len(split.train) == 1300
    assert (split.val.features == plain.val.features).all()  # test_size moves no val sample
    rows = {tuple(r) for part in (split.train, split.val, split.test)
            for r in part.features.reshape(len(part), -1).tolist()}
    assert len(rows) == len({tuple(r) for r in data.features.reshape(1797, -1).tolist()})


# ------------------------------------------------------- 1. DDP equivalence with everything on
@pytest.mark.slow
@pytest.mark.float_sensitive
def test_everything_on_world_2_batch_8_equals_world_1_batch_16(run_cli):
    """Must-hold 1 (and the SyncBatchNorm test): a BatchNorm CNN with ddp.sync_batchnorm,
    cosine warmup and clipping trains the same weights and buffers at world_size=2 batch 8 as
    at world_size=1 batch 16; with accumulate_grad_batches=2, world_size=2 batch 4 equals
    world_size=1 batch 8 (BatchNorm normalises each micro-batch: a global micro-batch of 8)."""
    common = ("seed=0", "trainer.epochs=1", "trainer.max_steps=50", QUIET, *SMALL_CNN,
              "model.batch_norm=true", "ddp.sync_batchnorm=true", "scheduler=cosine",
              "scheduler.warmup_steps=5", "trainer.gradient_clip_val=0.5",
              "trainer.log_every_n_steps=5")
    pairs = [(run_cli("world_size=1", "data.batch_size=16", *common, job="ws1").ok(),
              run_cli("world_size=2", "data.batch_size=8", *common, job="ws2").ok())]
    accumulate = (*common, "trainer.accumulate_grad_batches=2")
    pairs.append((run_cli("world_size=1", "data.batch_size=8", *accumulate, job="acc1").ok(),
                  run_cli("world_size=2", "data.batch_size=4", *accumulate, job="acc2").ok()))
    for one, two in pairs:
        ref = torch.load(one.job_dir / "model.pt", weights_only=True)
        assert any("running_var" in k for k in ref)  # the BatchNorm buffers are compared too
        assert two.metrics["global_step"] == one.metrics["global_step"] == 50
        assert_state_close(torch.load(two.job_dir / "model.pt", weights_only=True), ref, 1e-5)
        # Clipping was in play: some step's norm before clipping is above the threshold.
        norms_one, norms_two = (scalars(r.job_dir, "train/grad_norm") for r in (one, two))
        assert max(v for _, v in norms_one) > 0.5
        for (s1, v1), (s2, v2) in zip(norms_one, norms_two, strict=True):
            assert s1 == s2 and v2 == pytest.approx(v1, rel=1e-4)


# ------------------------------------------------------------------ 2. train/lr, closed form
def test_logged_lr_is_the_closed_form_cosine_with_warmup(run_cli):
    """Must-hold 2: every logged train/lr equals the schedule written out here; the run's step
    count knows world_size, accumulation and max_steps; the last step is at min_lr."""
    lr, warmup, min_lr, max_steps = 0.05, 5, 0.001, 30
    run = run_cli("world_size=2", "data.batch_size=32", "trainer.accumulate_grad_batches=2",
                  "trainer.epochs=3", f"trainer.max_steps={max_steps}", f"optim.lr={lr}",
                  "scheduler=cosine", f"scheduler.warmup_steps={warmup}",
                  f"scheduler.min_lr={min_lr}", "trainer.log_every_n_steps=1", QUIET).ok()
    per_epoch = math.ceil(math.ceil(1500 / 2 / 32) / 2)  # 12: 3 epochs would be 36 steps
    total = min(3 * per_epoch, max_steps)
    logged = scalars(run.job_dir, "train/lr")
    assert [s for s, _ in logged] == list(range(1, total + 1))
    for step, value in logged:
        assert rel_close(value, cosine_lr(step, lr, warmup, total, min_lr), 1e-6), step
    assert rel_close(logged[-1][1], min_lr, 1e-6)


# -------------------------------------------------------------------------- 3. exact resume
@pytest.mark.slow
@pytest.mark.float_sensitive
def test_resume_with_scheduler_best_and_patience_is_exact(run_cli, tmp_path):
    """Must-hold 3: 4 epochs in one go equal 2 epochs, a rank killed in epoch 3, and a resume
    to 4: weights, best/epoch, the patience counter (stopped_early after 3 bad epochs), the lr
    curve, each step logged once. monitor_mode=max on a falling val/loss makes epoch 1 the
    best and counts every later epoch as bad."""
    recipe = ("world_size=2", "trainer.epochs=4", "seed=0", QUIET, "scheduler=cosine",
              "scheduler.warmup_steps=10", "trainer.monitor_mode=max",
              "trainer.early_stopping_patience=3", "trainer.log_every_n_steps=5")
    conf = tmp_path / "conf"
    steps = math.ceil(1500 / 64)
    ref = run_cli(*recipe, "model=mlp", job="ref").ok()
    write_model_yaml(conf, fault="kill", fault_step=2 * steps + steps // 2,
                     after_checkpoint=str(tmp_path / "job/checkpoints/last.pt"), after_epoch=1)
    faulty = ("--config-dir", str(conf), "model=faulty")
    killed = run_cli(*faulty, *recipe, job="job", env=tests_on_path())
    assert killed.returncode != 0
    assert load_ckpt(killed.job_dir / "checkpoints" / "last.pt")["monitor"]["bad_epochs"] == 1
    write_model_yaml(conf, fault="kill", fault_step=UNREACHABLE)
    resumed = run_cli(*faulty, *recipe, "trainer.resume=auto", job="job",
                      env=tests_on_path()).ok()

    got, want = resumed.metrics, ref.metrics
    val = scalars(ref.job_dir, "val/loss")
    assert want["best/epoch"] == best_by_curve(val, "max")
    assert want["stopped_early"] is (stop_epoch_by_curve(val, "max", 3) == 4)
    for key in ("best/epoch", "best/val/loss", "stopped_early", "epoch", "global_step"):
        assert got[key] == want[key], key
    assert_state_close(torch.load(resumed.job_dir / "model.pt", weights_only=True),
                       torch.load(ref.job_dir / "model.pt", weights_only=True), 1e-6)
    assert_state_close(load_ckpt(resumed.job_dir / "checkpoints" / "best.pt")["model"],
                       load_ckpt(ref.job_dir / "checkpoints" / "best.pt")["model"], 1e-6)
    lr_got = tensorboard_series(resumed.job_dir, "train/lr")
    lr_ref = tensorboard_series(ref.job_dir, "train/lr")
    assert [s for s, _ in lr_got] == [s for s, _ in lr_ref]  # each step once
    assert [v for _, v in lr_got] == pytest.approx([v for _, v in lr_ref], rel=1e-6)


# ------------------------------------------------ 4. early stopping, 5. best.pt is the best
@pytest.mark.slow
def test_early_stopping_stops_every_rank_after_the_same_epoch(run_cli):
    """Must-hold 4: patience 2 with monitor_mode=max on a falling val/loss: 3 ranks stop after
    the epoch the validation curve says, exit 0, stopped_early, the log says why; resuming the
    stopped run changes nothing and says so (exit 0: nothing left to train)."""
    common = ("world_size=3", "trainer.epochs=10", QUIET, "trainer.monitor_mode=max")
    run = run_cli(*common, "trainer.early_stopping_patience=2", timeout=120).ok()
    curve = scalars(run.job_dir, "val/loss")
    expected = stop_epoch_by_curve(curve, "max", 2)
    assert expected is not None and expected < 10
    assert len(curve) == expected and run.metrics["epoch"] == expected
    assert run.metrics["stopped_early"] is True
    assert "early stopping: val/loss has not improved" in run.stdout
    assert load_ckpt(run.job_dir / "checkpoints" / "last.pt")["epoch"] == expected - 1
    again = run_cli(*common, "trainer.early_stopping_patience=2", "trainer.resume=auto",
                    "trainer.epochs=20", timeout=60)
    assert again.returncode == 0 and "stopped early" in again.stderr, again.stderr


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_best_checkpoint_holds_the_best_epoch(run_cli):
    """Must-hold 5: best.pt, evaluated here in one process on the validation split, gives
    best/val/loss (the default monitor); best/epoch is the validation curve's best epoch."""
    run = run_cli("world_size=2", "trainer.epochs=3", QUIET).ok()
    m = run.metrics
    assert m["best/epoch"] == best_by_curve(scalars(run.job_dir, "val/loss"), "min")
    best = load_ckpt(run.job_dir / "checkpoints" / "best.pt")
    assert best["epoch"] + 1 == m["best/epoch"]
    ds = digits_split(297, 0, 2)
    model = initial_mlp(0, ds)
    model.load_state_dict(best["model"])
    with torch.no_grad():
        out = model(torch.from_numpy(ds.val.features))
    losses = F.cross_entropy(out, torch.from_numpy(ds.val.targets), reduction="none")
    assert rel_close(losses.double().mean().item(), m["best/val/loss"], 1e-6)


# ------------------------------------------------------------------------ 6. the test split
@pytest.mark.slow
@pytest.mark.float_sensitive
def test_test_accuracy_is_identical_for_world_size_1_and_3(run_cli, compose, tmp_path):
    """Must-hold 6: optim.lr=0 keeps the seeded weights, so test/ metrics are those of the
    initial model on the seed's test split, for any world size (101 samples: uneven shards)."""
    common = ("optim.lr=0.0", "trainer.epochs=1", "trainer.max_steps=2", "data.test_size=101",
              QUIET)
    one = run_cli("world_size=1", *common, job="ws1").ok().metrics
    three_run = run_cli("world_size=3", *common, job="ws3").ok()
    three = three_run.metrics
    from ddp_exp.data import build_datasets, load_digits

    ds = build_datasets(load_digits(), 297, 0, 1, test_size=101)
    model = initial_mlp(0, ds)
    with torch.no_grad():
        out = model(torch.from_numpy(ds.test.features))
    targets = torch.from_numpy(ds.test.targets)
    correct = int((out.argmax(1) == targets).sum())
    loss = F.cross_entropy(out, targets, reduction="none").double().mean().item()
    assert one["test/num_samples"] == three["test/num_samples"] == 101
    assert one["test/accuracy"] == three["test/accuracy"] == correct / 101
    assert rel_close(one["test/loss"], loss, 1e-6) and rel_close(three["test/loss"], loss, 1e-6)
    # trainer.max_steps stopped the epoch part-way: last.pt is the step checkpoint at step 2
    # (test_resume_max_steps.py); the new best epoch's best.pt is the whole state after the
    # partial epoch's validation, marked so that continuing from it is refused.
    folder = three_run.job_dir / "checkpoints"
    assert sorted(os.listdir(folder)) == ["best.pt", "last.pt"]
    assert load_ckpt(folder / "last.pt")["position"] == 2 * 96
    best = load_ckpt(folder / "best.pt")
    assert best["resumable"] is False and best["global_step"] == 2 and "optimizer" in best
    message = refused_before_ranks(compose("world_size=3", *common,
                                           f"trainer.resume={folder / 'best.pt'}"),
                                   tmp_path / "resumed")
    assert "trainer.max_steps stopped the epoch part-way" in message, message


# ------------------------------------------------------------------------- 7. bad input
BAD_RECIPE = [  # (override, the key the one line must start with)
    ("trainer.monitor=val/nonexistent", "trainer.monitor"),
    ("scheduler.warmup_steps=1000", "scheduler.warmup_steps"),
    ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val"),
    ("data.test_size=1500", "data.test_size"),
]
RECIPE_BASE = ("world_size=2", "trainer.epochs=2", "scheduler=cosine")


@pytest.mark.parametrize("override,key", BAD_RECIPE)
def test_bad_recipe_input_is_refused_before_any_rank(compose, tmp_path, override, key):
    """Must-hold 7, in-process: the steps the CLI runs before any rank refuse it, one line
    naming the key (the cosine run has 2 x 24 = 48 steps, so a 1000-step warmup is longer
    than the run)."""
    message = refused_before_ranks(compose(*RECIPE_BASE, override), tmp_path / "run")
    assert message.startswith(f"{key}="), message


def test_bad_recipe_input_is_one_line_before_any_rank(run_cli):
    """Must-hold 7 through the CLI, for one of BAD_RECIPE (refused by the build step): one
    line naming the key, exit 2, no rank started."""
    override, key = BAD_RECIPE[1]
    run = run_cli(*RECIPE_BASE, override, QUIET, timeout=60)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2, run.stdout + run.stderr
    assert len(lines) == 1 and lines[0].startswith(f"error: {key}="), run.stderr
    assert "[rank" not in run.stdout
    for leftover in ("tensorboard", "metrics.json", "model.pt", "checkpoints"):
        assert not (run.job_dir / leftover).exists(), leftover


def test_monitor_default_mode_and_test_weights_follow_the_metric():
    from ddp_exp.train import monitor

    def cfg(**trainer):
        base = {"monitor": "val/loss", "monitor_mode": None, "early_stopping_patience": None,
                "test_weights": None}
        return {"trainer": {**base, **trainer}}

    c = cfg(monitor="val/accuracy")
    monitor.resolve(c, ["accuracy"], 10)
    assert (c["trainer"]["monitor_mode"], c["trainer"]["test_weights"]) == ("max", "best")
    c = cfg()
    monitor.resolve(c, ["accuracy"], 0)  # no validation: nothing to monitor
    assert (c["trainer"]["monitor"], c["trainer"]["test_weights"]) == (None, "last")
    with pytest.raises(Exception, match="trainer.early_stopping_patience"):
        monitor.resolve(cfg(early_stopping_patience=2), ["accuracy"], 0)


def test_conf_experiment_recipe_composes(tmp_path):
    """The preset that uses every recipe key composes and validates."""
    from hydra import compose, initialize_config_module

    from ddp_exp.config.checks import validate
    from ddp_exp.config.compose import register_configs

    register_configs()
    with initialize_config_module("ddp_exp.conf", version_base="1.3"):
        cfg = compose("config", overrides=["experiment=digits_cnn_recipe"])
    validate(cfg)
    t = cfg.trainer
    assert cfg.scheduler._target_.endswith("warmup_cosine") and t.gradient_clip_val
    assert t.early_stopping_patience and cfg.data.test_size > 0 and cfg.ddp.sync_batchnorm
    assert Path(__file__).parents[1].joinpath("conf/experiment/digits_cnn_recipe.yaml").exists()


def test_sweep_summary_has_the_recipe_columns(tmp_path):
    """best/<monitor>, best/epoch, stopped_early and test/ values of each job's metrics.json
    become summary columns (empty for a job without them)."""
    import csv
    import json

    from ddp_exp.job.sweep import collect, write_summary

    jobs = {"0": {"val/loss": 0.5, "best/val/loss": 0.4, "best/epoch": 3, "stopped_early": True,
                  "test/loss": 0.45, "test/accuracy": 0.9, "test/num_samples": 10},
            "1": {"val/loss": 0.6}}
    for name, metrics in jobs.items():
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / "metrics.json").write_text(json.dumps(metrics))
    write_summary(str(tmp_path), collect(str(tmp_path)))
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert {k: rows[0][k] for k in ("best/val/loss", "best/epoch", "stopped_early", "test/loss",
                                    "test/accuracy")} == {
        "best/val/loss": "0.4", "best/epoch": "3", "stopped_early": "true", "test/loss": "0.45",
        "test/accuracy": "0.9"}
    assert rows[1]["best/val/loss"] == "" and "test/num_samples" not in rows[0]
    assert "best/epoch" in (tmp_path / "summary.md").read_text()
