"""Real multi-process gloo worlds through the CLI (issue 2, "What must hold"; cases C01-C17).

Every expected value here comes from somewhere other than the run under test: a world_size=1 run
on the same data, a value computed in this process from the data and the seeded initial model
(``optim.lr=0.0`` freezes the weights), or a count derived from the dataset sizes.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from helpers import (
    QUIET,
    TORCHRUN_2,
    Run,
    digits_split,
    initial_mlp,
    rel_close,
    scalars,
    shared_run,
)

CONF = Path(__file__).resolve().parents[1] / "conf"
DIGITS_N = 1797  # scikit-learn's digits
DEFAULT_VAL = 297  # conf/data/digits.yaml


# ------------------------------------------------------------------------------------ helpers
@torch.no_grad()
def _per_sample_losses(model, features, targets) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample cross-entropy (float64) and per-sample correctness of ``model``."""
    x, y = torch.from_numpy(features), torch.from_numpy(targets)
    out = model(x)
    return F.cross_entropy(out, y, reduction="none").double(), out.argmax(dim=1) == y


def expected_val(seed: int, val_size: int, world_size: int) -> tuple[float, int]:
    """(mean val loss, correct count) of the seeded initial model on the whole val split."""
    ds = digits_split(val_size, seed, world_size)
    assert len(ds.val) == val_size
    losses, correct = _per_sample_losses(initial_mlp(seed, ds), ds.val.features,
                                         ds.val.targets)
    return losses.sum().item() / val_size, int(correct.sum())


def job_dirs_under(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir())


def log_messages(text: str) -> list[str]:
    """The message part of each ``[time][rankN|launcher][logger][LEVEL] - message`` log record
    line (the launching process tags its lines [launcher], the ranks [rankN])."""
    return [line.split(" - ", 1)[1] for line in text.splitlines()
            if re.match(r"^\[[^\]]*\]\[(rank\d+|launcher)\]\[[^\]]*\]\[[A-Z]+\] - ", line)]


def event_files(root: Path) -> list[Path]:
    return sorted(root.rglob("events.out.tfevents*"))


# ------------------------------------------------------------------ 1. DDP equivalence
@pytest.mark.slow
@pytest.mark.float_sensitive
def test_ddp_two_ranks_batch_8_equals_one_rank_batch_16(run_cli):
    """Invariant 1: world_size=2 batch 8 trains the same model as world_size=1 batch 16."""
    common = ("seed=0", "trainer.epochs=3", QUIET)
    two = run_cli("world_size=2", "data.batch_size=8", *common, job="ws2").ok()
    one = run_cli("world_size=1", "data.batch_size=16", *common, job="ws1").ok()

    m2, m1 = two.metrics, one.metrics
    assert m2["global_batch_size"] == m1["global_batch_size"] == 16
    assert m2["batch_size"] == 8 and m1["batch_size"] == 16
    assert m2["steps_per_epoch"] == m1["steps_per_epoch"] == math.ceil(1500 / 16)
    assert m2["global_step"] == m1["global_step"] == 3 * math.ceil(1500 / 16)
    for key in ("train/epoch_loss", "val/loss", "val/accuracy"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-5), key

    for tag in ("train/loss", "val/loss", "val/accuracy"):
        s2, s1 = scalars(two.job_dir, tag), scalars(one.job_dir, tag)
        assert [s for s, _ in s2] == [s for s, _ in s1], tag
        assert len(s1) >= 3
        for (step, v2), (_, v1) in zip(s2, s1, strict=True):
            assert v2 == pytest.approx(v1, rel=1e-5, abs=1e-5), (tag, step)

    p2 = torch.load(two.job_dir / "model.pt", weights_only=True)
    p1 = torch.load(one.job_dir / "model.pt", weights_only=True)
    assert p2.keys() == p1.keys() and len(p1) > 0
    for name in p1:
        torch.testing.assert_close(p2[name], p1[name], rtol=1e-5, atol=1e-5, msg=name)
    # The weights moved: equal final parameters are not the untouched initial ones.
    init = initial_mlp(0, digits_split(DEFAULT_VAL, 0, 1)).state_dict()
    assert any(not torch.allclose(init[k], p1[k], atol=1e-3) for k in p1)


# --------------------------------------------------------------- 2. exact global metrics
@pytest.mark.slow
@pytest.mark.parametrize("val_size", [101, 4])
@pytest.mark.float_sensitive
def test_validation_metrics_exact_for_world_size_3_uneven_val(run_cli, val_size):
    """C06: with frozen weights, world_size=3 reports the world_size=1 (and true) val metrics."""
    common = ("optim.lr=0.0", f"data.val_size={val_size}", "trainer.epochs=1", "seed=0", QUIET)
    three = run_cli("world_size=3", *common, job="ws3").ok().metrics
    one = run_cli("world_size=1", *common, job="ws1").ok().metrics

    assert three["val/num_samples"] == one["val/num_samples"] == val_size
    assert three["val/accuracy"] == one["val/accuracy"]
    assert rel_close(three["val/loss"], one["val/loss"], 1e-6), (three["val/loss"], one["val/loss"])

    # The true values, computed here from the data and the seeded initial weights.
    loss, correct = expected_val(0, val_size, 3)
    for m in (three, one):
        assert m["val/accuracy"] == correct / val_size
        assert round(m["val/accuracy"] * val_size) == correct
        assert rel_close(m["val/loss"], loss, 1e-6), (m["val/loss"], loss)


# --------------------------------------------------------------------- 3. shuffles (C05)
def _expected_step_losses(seed: int, order_seed: int, epochs: int = 2) -> list[float]:
    """Per-step train/loss of the frozen seed-``seed`` model when the two ranks' batches of 50
    come from ``DistributedSampler(seed=order_seed)`` with ``set_epoch`` every epoch."""
    from torch.utils.data import DistributedSampler

    ds = digits_split(DEFAULT_VAL, seed, 2)
    losses, _ = _per_sample_losses(initial_mlp(seed, ds), ds.train.features, ds.train.targets)
    steps = []
    for epoch in range(epochs):
        shards = []
        for rank in range(2):
            sampler = DistributedSampler(range(len(ds.train)), num_replicas=2, rank=rank,
                                         shuffle=True, seed=order_seed, drop_last=False)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        for start in range(0, len(shards[0]), 50):
            idx = shards[0][start:start + 50] + shards[1][start:start + 50]
            steps.append(losses[idx].mean().item())
    return steps


def _train_losses(job_dir: Path) -> list[float]:
    points = scalars(job_dir, "train/loss")
    assert [s for s, _ in points] == list(range(1, 31)), points
    return [v for _, v in points]


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_each_epoch_shuffles_differently_and_seed_reproduces(run_cli):
    """C05: per-step loss order differs between epochs, epoch means agree, same seed repeats."""
    common = ("world_size=2", "data.val_size=297", "data.batch_size=50", "optim.lr=0.0",
              "trainer.epochs=2", "trainer.log_every_n_steps=1", QUIET)
    first = _train_losses(run_cli(*common, "seed=0", job="a").ok().job_dir)
    again = _train_losses(run_cli(*common, "seed=0", job="b").ok().job_dir)
    other = _train_losses(run_cli(*common, "seed=1", job="c").ok().job_dir)

    e0, e1 = first[:15], first[15:]
    assert max(abs(a - b) for a, b in zip(e0, e1, strict=True)) > 1e-6, "same order both epochs"
    assert abs(sum(e0) / 15 - sum(e1) / 15) <= 1e-6
    assert all(abs(a - b) <= 1e-7 for a, b in zip(first, again, strict=True))

    # The epoch mean is the frozen model's loss over all 1500 training samples.
    ds = digits_split(DEFAULT_VAL, 0, 2)
    losses, _ = _per_sample_losses(initial_mlp(0, ds), ds.train.features, ds.train.targets)
    assert sum(e0) / 15 == pytest.approx(losses.mean().item(), abs=1e-6)

    # Every step holds the loss of the batches DistributedSampler(seed, set_epoch) serves.
    assert first == pytest.approx(_expected_step_losses(0, 0), abs=1e-5)
    assert other == pytest.approx(_expected_step_losses(1, 1), abs=1e-5)
    # seed=1 changes the order itself, not only the weights: the seed-1 model in the seed-0
    # order gives a different epoch-0 sequence.
    seed0_order = _expected_step_losses(1, 0, epochs=1)
    assert max(abs(a - b) for a, b in zip(other[:15], seed0_order, strict=True)) > 1e-6


@pytest.fixture(scope="module")
def three_ranks_two_epochs(tmp_path_factory) -> Run:
    """``world_size=3 trainer.epochs=2`` (the config printed, as by default), run once for the
    module in a folder of its own (``<root>/run``): C10 reads its event stream and
    metrics.json, C02 its job log and output."""
    return shared_run(tmp_path_factory, "world_size=3", "trainer.epochs=2")


# ------------------------------------------------------------- 4. one writer (C10, HParams)
@pytest.mark.slow
def test_one_event_stream_one_metrics_json_with_hparams_for_world_size_3(
        run_cli, tmp_path, three_ranks_two_epochs):
    """C10: world_size=3 leaves exactly one event file (val/loss at 2 steps, hparams inside),
    launched by ddp_exp and by torchrun."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    run = three_ranks_two_epochs
    torchrun_3 = [*TORCHRUN_2[:-3], "--nproc_per_node=3", "-m", "ddp_exp"]
    under_torchrun = run_cli("trainer.epochs=2", QUIET, job="torchrun", launcher=torchrun_3).ok()
    assert under_torchrun.metrics["world_size"] == 3
    files = event_files(run.job_dir)
    assert len(files) == 1, files
    assert len(event_files(under_torchrun.job_dir)) == 1
    for job in (run.job_dir, under_torchrun.job_dir):  # nothing written beside the job folder
        assert event_files(job.parent) == event_files(job)
        assert sorted(job.parent.rglob("metrics.json")) == [job / "metrics.json"]

    steps_per_epoch = math.ceil(1500 / 3 / 32)
    for job in (run, under_torchrun):
        val = scalars(job.job_dir, "val/loss")
        assert [s for s, _ in val] == [steps_per_epoch, 2 * steps_per_epoch]
        assert job.metrics["val/loss"] == pytest.approx(val[-1][1], rel=1e-6)

    plugin = {}
    for event in EventFileLoader(str(files[0])).Load():
        for value in event.summary.value:
            if value.metadata.plugin_data.plugin_name == "hparams":
                plugin[value.tag] = plugin_data_pb2.HParamsPluginData.FromString(
                    value.metadata.plugin_data.content)
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= plugin.keys(), plugin.keys()
    hp = plugin["_hparams_/session_start_info"].session_start_info.hparams
    assert hp["world_size"].number_value == 3
    assert hp["global_batch_size"].number_value == 3 * 32


# ----------------------------------------------------------------- 5. the main job learns
@pytest.mark.slow
def test_main_job_reaches_90_percent_val_accuracy(run_cli):
    """Issue 2 item 5: the default main job (world_size=2, default epochs) gets val acc >= 0.9."""
    run = run_cli("world_size=2", QUIET).ok()
    m = run.metrics
    cfg = yaml.safe_load((run.job_dir / ".hydra" / "config.yaml").read_text())
    assert m["epoch"] == cfg["trainer"]["epochs"] >= 1
    assert m["val/num_samples"] == DEFAULT_VAL
    assert m["val/accuracy"] >= 0.9, m
    assert scalars(run.job_dir, "val/accuracy")[-1][1] == pytest.approx(m["val/accuracy"])


# --------------------------------------------------------------------- 6. run dirs (C01)
def _single_job_dir(root: Path) -> Path:
    dirs = job_dirs_under(root)
    assert len(dirs) == 1, dirs
    configs = sorted(root.rglob("config.yaml"))
    assert configs == [dirs[0] / ".hydra" / "config.yaml"], configs
    return dirs[0]


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_one_run_dir_with_now_timestamp_under_ddp_exp_and_torchrun(run_cli, tmp_path,
                                                                 default_run_2_epochs):
    """C01: a ${now:...%f} run dir is created once per job, launched by ddp_exp and by torchrun."""
    args = ("world_size=2", "trainer.epochs=1", QUIET)
    run_cli(*args, f"hydra.run.dir={tmp_path}/c01/${{now:%H-%M-%S-%f}}", run_dir=False).ok()
    run_cli(*args, f"hydra.run.dir={tmp_path}/c01t/${{now:%H-%M-%S-%f}}", run_dir=False,
            launcher=TORCHRUN_2).ok()

    own = _single_job_dir(tmp_path / "c01")
    tr = _single_job_dir(tmp_path / "c01t")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c01", "c01t"]  # nothing stray
    assert len(event_files(own)) == len(event_files(tr)) == 1

    m_own = json.loads((own / "metrics.json").read_text())
    m_tr = json.loads((tr / "metrics.json").read_text())
    assert m_tr["world_size"] == m_own["world_size"] == 2
    for key in ("val/num_samples", "train/num_samples", "global_step", "val/accuracy"):
        assert m_tr[key] == m_own[key], key
    for key in ("train/epoch_loss", "val/loss"):
        assert rel_close(m_tr[key], m_own[key], 1e-6), (key, m_tr[key], m_own[key])
    p_own = torch.load(own / "model.pt", weights_only=True)
    p_tr = torch.load(tr / "model.pt", weights_only=True)
    for name in p_own:
        torch.testing.assert_close(p_tr[name], p_own[name], rtol=1e-6, atol=1e-6, msg=name)

    # Resume each job in its ${now:} folder, under the launcher that made it: every rank loads
    # rank 0's checkpoint (weights, optimizer, RNG), so both end as an uninterrupted 2-epoch run.
    more = ("world_size=2", "trainer.epochs=2", "trainer.resume=auto", QUIET)
    own2 = run_cli(*more, f"hydra.run.dir={own}", run_dir=False).ok()
    tr2 = run_cli(*more, f"hydra.run.dir={tr}", run_dir=False, launcher=TORCHRUN_2).ok()
    ref = default_run_2_epochs  # world_size=2 trainer.epochs=2, uninterrupted
    for job, run in ((own, own2), (tr, tr2)):
        assert f"resumed from {job / 'checkpoints' / 'last.pt'}: epoch 1 done" in run.stdout
        assert "epoch 2/2" in run.stdout and "epoch 1/2" not in run.stdout
        assert _single_job_dir(job.parent) == job
        got = json.loads((job / "metrics.json").read_text())
        assert got["epoch"] == 2 and got["global_step"] == ref.metrics["global_step"]
        for key in ("train/epoch_loss", "val/loss"):
            assert rel_close(got[key], ref.metrics[key], 1e-6), (job, key)
        assert got["val/accuracy"] == ref.metrics["val/accuracy"]
        weights = torch.load(job / "model.pt", weights_only=True)
        expected = torch.load(ref.job_dir / "model.pt", weights_only=True)
        for name in expected:
            torch.testing.assert_close(weights[name], expected[name], rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------- 7. logging (C02)
@pytest.mark.slow
def test_epoch_summary_and_config_logged_once_with_3_ranks(three_ranks_two_epochs):
    """C02: each epoch line and the config dump appear once in the job log and stdout
    (world_size=3, 2 epochs)."""
    run = three_ranks_two_epochs
    log_text = (run.job_dir / "ddp_exp.log").read_text()
    for source, text in (("log", log_text), ("stdout", run.stdout)):
        messages = log_messages(text)
        for n in (1, 2):
            hits = [m for m in messages if m.startswith(f"epoch {n}/2")]
            assert len(hits) == 1, (source, n, hits)
        assert sum(m.startswith("config:") for m in messages) == 1, source
        assert text.count("_target_: ddp_exp.data.load_digits") == 1, source  # the dump's body
    # Other ranks speak only at WARNING or above, tagged with their rank.
    for line in log_text.splitlines():
        match = re.match(r"^\[.*?\]\[rank(\d+)\]\[.*?\]\[([A-Z]+)\] - ", line)
        if match and match.group(1) != "0":
            assert match.group(2) in ("WARNING", "ERROR", "CRITICAL"), line


# ------------------------------------------------------------------- 8. multirun (C03)
@pytest.mark.slow
def test_multirun_batch_sweep_makes_two_jobs_and_no_nested_sweep(run_cli, tmp_path):
    """C03: -m data.batch_size=16,32 at world_size=2 gives jobs 0/ and 1/, 47 and 24 steps."""
    sweep = tmp_path / "sweep"
    run_cli("-m", "world_size=2", "data.val_size=297", "data.batch_size=16,32",
            "trainer.epochs=1", f"hydra.sweep.dir={sweep}", QUIET, run_dir=False,
            timeout=300).ok()
    assert [p.name for p in job_dirs_under(sweep)] == ["0", "1"]
    assert list(tmp_path.rglob("multirun")) == []
    assert list(tmp_path.rglob("multirun.yaml")) == [sweep / "multirun.yaml"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]

    train = DIGITS_N - 297
    for job, batch in (("0", 16), ("1", 32)):
        m = json.loads((sweep / job / "metrics.json").read_text())
        assert m["batch_size"] == batch
        assert m["global_batch_size"] == 2 * batch
        assert m["steps_per_epoch"] == math.ceil(train / 2 / batch)
        assert len(event_files(sweep / job)) == 1
    assert [math.ceil(train / 2 / b) for b in (16, 32)] == [47, 24]


# ---------------------------------------------------------------- 9. uneven inputs (C07)
@pytest.mark.slow
def test_uneven_training_shards_pad_and_finish(run_cli):
    """C07: 1501 training samples on 2 ranks finish; DistributedSampler pads to 1502 (logged);
    the repeated sample counts zero (issue 28)."""
    run = run_cli("world_size=2", "data.val_size=296", "data.batch_size=10", "trainer.epochs=2",
                  QUIET, timeout=300).ok()
    m = run.metrics
    train = DIGITS_N - 296
    assert train == 1501
    assert m["train/num_samples"] == train  # padding served, counted zero (issue 28)
    assert m["steps_per_epoch"] == math.ceil(math.ceil(train / 2) / 10) == 76
    assert m["global_step"] == 2 * 76
    assert m["val/num_samples"] == 296 and math.isfinite(m["val/loss"])
    log_text = (run.job_dir / "ddp_exp.log").read_text()
    assert "which count zero: each of the 1501 samples counts once" in log_text


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_rank_with_empty_val_shard_gives_exact_val_loss(run_cli):
    """C07: world_size=3 data.val_size=2 (one rank has no val sample) matches world_size=1."""
    common = ("data.val_size=2", "trainer.epochs=1", "optim.lr=0.0", QUIET)
    three = run_cli("world_size=3", *common, job="ws3", timeout=300).ok().metrics
    one = run_cli("world_size=1", *common, job="ws1").ok().metrics
    assert three["val/num_samples"] == one["val/num_samples"] == 2
    assert math.isfinite(three["val/loss"])
    assert rel_close(three["val/loss"], one["val/loss"], 1e-6), (three["val/loss"], one["val/loss"])
    assert three["val/accuracy"] == one["val/accuracy"]
    loss, correct = expected_val(0, 2, 3)
    assert rel_close(three["val/loss"], loss, 1e-6), (three["val/loss"], loss)
    assert three["val/accuracy"] == correct / 2


# ------------------------------------------------------------------------ 10. threads (C17)
@pytest.mark.slow
def test_threads_per_rank_default_and_user_value(run_cli, tmp_path, monkeypatch):
    """C17: on 2 cores (the run pinned to two of this machine's), every rank runs
    torch.get_num_threads() threads: 2 for one rank, 1 each for 2 or 4 (read on each rank by a
    probe model), world_size=4 through the command line included, or OMP_NUM_THREADS if set;
    more ranks than cores gets one warning line."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or (len(cores) > 2 and not shutil.which("taskset")):
        pytest.skip("needs 2 cores (or taskset to pin the run to 2 of them)")
    pin = ["taskset", "-c", f"{cores[0]},{cores[1]}"] if len(cores) > 2 else []
    for ws, omp, expected, warned in ((1, None, 2, False), (2, None, 1, False),
                                      (4, None, 1, True), (2, "2", 2, False)):
        probe = tmp_path / f"probe-{ws}-{omp}"
        (probe / "model").mkdir(parents=True)
        (probe / "model" / "probe.yaml").write_text(yaml.safe_dump(
            {"_target_": "faulty.EnvProbeMLP", "probe_dir": str(probe)}))
        env = {"PYTHONPATH": str(Path(__file__).parent), **({"OMP_NUM_THREADS": omp} if omp
                                                            else {})}
        run = run_cli("--config-dir", str(probe), "model=probe", f"world_size={ws}",
                      "trainer.epochs=1", "trainer.max_steps=2", QUIET, job=probe.name,
                      env=env, launcher=[*pin, sys.executable, "-m", "ddp_exp"]).ok()
        threads = [json.loads((probe / f"rank{r}.json").read_text())["threads"]
                   for r in range(ws)]
        assert threads == [expected] * ws, (ws, omp, threads)
        assert run.metrics["threads_per_rank"] == expected
        warnings = [ln for ln in run.stdout.splitlines()
                    if f"{ws} ranks on this machine's 2 CPU core(s)" in ln]
        assert len(warnings) == warned, run.stdout


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_every_start_method_trains_the_same_model(run_cli, default_run_1_epoch):
    """Regression: under spawn/forkserver the model reached the ranks in shared memory, so all
    ranks stepped one set of parameters (an effective lr x world_size, racy). Every start
    method must give fork's result, bit for bit (fork, the default: the session's shared
    1-epoch run)."""
    common = ("world_size=2", "trainer.epochs=1", QUIET)
    fork = default_run_1_epoch
    a = torch.load(fork.job_dir / "model.pt", weights_only=True)
    for start_method in ("spawn", "forkserver"):
        other = run_cli(*common, f"launcher.start_method={start_method}", job=start_method).ok()
        for key in ("train/epoch_loss", "val/loss", "val/accuracy"):
            assert other.metrics[key] == fork.metrics[key], (start_method, key)
        b = torch.load(other.job_dir / "model.pt", weights_only=True)
        assert all(torch.equal(a[k], b[k]) for k in a), start_method


@pytest.mark.slow
def test_a_global_batch_larger_than_the_training_set_is_said(run_cli):
    """world_size=100 at the default batch gave a global batch of 3,200 for digits' 1,500
    training samples without a word (a fresh user): each step took the whole set. Now one
    warning line says so, with the step's real size per rank."""
    run = run_cli("world_size=2", "data.batch_size=1000", "trainer.epochs=1",
                  "print_config=false").ok()
    out = run.stdout + run.stderr
    assert ("the global batch of 2000 is larger than the 1500 training samples: each "
            "optimizer step takes the whole training set (750 per rank), not 2000") in out
    assert out.count("is larger than the 1500 training samples") == 1, out  # rank 0's alone
    assert run.metrics["steps_per_epoch"] == 1
