"""Sweeps that compare (issue 3, "What must hold"): multirun over batch size, parallel jobs with
the joblib launcher, HParams in each run's own event stream, the sweep summary, lr scaling, the
experiment/debug presets and the Optuna search.

Every expected value comes from somewhere other than the output under test: a job's own
``metrics.json`` and ``.hydra/`` files (read here, not through ``ddp_exp.job.sweep``), the
TensorBoard
event file read with tensorboard's ``EventAccumulator``, or a learning rate computed here.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from helpers import (
    QUIET,
    assert_no_orphans,
    cli_env,
    hparams_table,
    rel_close,
    run_sweep,
    scalars,
    start_cli,
)

BATCH_SIZES = (16, 32, 64)
SWEEP_3 = ("-m", "world_size=2", "trainer.epochs=1", "data.batch_size=16,32,64", QUIET)
METRIC_COLUMNS = ("val/loss", "val/accuracy", "train/epoch_loss")
# What issue 3 says each run's HParams row carries (besides the swept key).
PROMISED_HPARAMS = ("world_size", "global_batch_size", "optim.lr", "model", "data", "backend",
                    "optim", "seed")


# ------------------------------------------------------------------------------------ helpers
def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def job_dirs(sweep_dir: Path) -> list[Path]:
    return sorted((p for p in sweep_dir.iterdir() if p.is_dir()), key=lambda p: p.name)


def metrics_of(job_dir: Path) -> dict:
    return json.loads((job_dir / "metrics.json").read_text())


def job_overrides(job_dir: Path) -> dict[str, str]:
    """The job's task overrides from Hydra's own ``.hydra/overrides.yaml``."""
    items = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text())
    return dict(item.split("=", 1) for item in items)


def job_config(job_dir: Path) -> dict:
    return yaml.safe_load((job_dir / ".hydra" / "config.yaml").read_text())


def summary_rows(sweep_dir: Path) -> dict[str, dict[str, str]]:
    """summary.csv rows keyed by their ``job`` column (a job folder name)."""
    with open(sweep_dir / "summary.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    by_job = {row["job"]: row for row in rows}
    assert len(by_job) == len(rows), rows
    return by_job


def event_file(job_dir: Path) -> Path:
    files = list(job_dir.rglob("events.out.tfevents*"))
    assert len(files) == 1, f"{job_dir}: {files}"
    return files[0]


def hparams_of(job_dir: Path) -> tuple[dict, list[str]]:
    """(hparams of the run's session_start_info, metric columns of its experiment summary: each
    metric's display name), read from the job's single event stream."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(event_file(job_dir)))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    hparams, metric_tags, kinds = None, [], set()
    for blob in content.values():
        data = plugin_data_pb2.HParamsPluginData.FromString(blob)
        kinds.add(data.WhichOneof("data"))
        if data.HasField("session_start_info"):
            hparams = {k: getattr(v, v.WhichOneof("kind"))
                       for k, v in data.session_start_info.hparams.items()}
        if data.HasField("experiment"):
            metric_tags = [m.display_name or m.name.tag for m in data.experiment.metric_infos]
    assert {"experiment", "session_start_info"} <= kinds, kinds
    assert hparams is not None
    return hparams, metric_tags


def assert_row_matches_metrics(row: dict[str, str], metrics: dict, rel: float = 1e-12) -> None:
    for key in METRIC_COLUMNS:
        assert row[key] != "", (key, row)
        assert rel_close(float(row[key]), metrics[key], rel), (key, row[key], metrics[key])


def assert_summary_files(sweep_dir: Path, n_rows: int) -> None:
    for name in ("summary.csv", "summary.md", "summary.png"):
        assert (sweep_dir / name).is_file(), name
    assert (sweep_dir / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (sweep_dir / "summary.md").read_text().splitlines()
    table = [line for line in md if line.startswith("|")]
    assert len(table) == 2 + n_rows, md  # header, separator, one line per job


@pytest.fixture(scope="module")
def sequential_sweep(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The 3-job batch-size sweep, run once with Hydra's default (sequential) launcher."""
    root = tmp_path_factory.mktemp("sequential")
    sweep_dir = root / "sweep"
    proc = run_sweep(root, *SWEEP_3, f"hydra.sweep.dir={sweep_dir}")
    return proc, sweep_dir


# ------------------------------------------------------- 1. the 3-job batch-size sweep
@pytest.mark.smoke
def test_batch_size_sweep_folders_event_streams_and_summary(sequential_sweep):
    proc, sweep_dir = sequential_sweep
    ok(proc)

    jobs = job_dirs(sweep_dir)
    assert [j.name for j in jobs] == ["0", "1", "2"], jobs
    # Exactly one event stream per job, and none anywhere else (no stray hparams sub-runs).
    assert sorted(sweep_dir.rglob("events.out.tfevents*")) == sorted(map(event_file, jobs))

    seen_batch_sizes = set()
    for job in jobs:
        bs = int(job_overrides(job)["data.batch_size"])
        assert job_config(job)["data"]["batch_size"] == bs
        seen_batch_sizes.add(bs)
        metrics = metrics_of(job)
        assert metrics["batch_size"] == bs and metrics["world_size"] == 2
        assert metrics["global_batch_size"] == 2 * bs
        assert metrics["global_step"] == math.ceil(1500 / (2 * bs))

        # Scalars in the job's own stream; the last val/loss is the final one in metrics.json.
        train = scalars(job, "train/loss")
        val = scalars(job, "val/loss")
        assert train and val, job
        assert val[-1][0] == metrics["global_step"]
        assert val[-1][1] == pytest.approx(metrics["val/loss"], rel=1e-6)

        # HParams summaries in the same stream, for this job's values.
        hparams, metric_tags = hparams_of(job)
        assert hparams["data.batch_size"] == bs
        assert hparams["global_batch_size"] == 2 * bs
        assert hparams["world_size"] == 2
        missing = [k for k in PROMISED_HPARAMS if k not in hparams]
        assert not missing, f"hparams lack {missing}: {sorted(hparams)}"
        assert set(METRIC_COLUMNS) <= set(metric_tags), metric_tags
        # ... and the HParams tab shows each with metrics.json's value (and the summary's).
        (table,) = hparams_table(job / "tensorboard").values()
        assert table == {key: metrics[key] for key in metric_tags}, job
    assert seen_batch_sizes == set(BATCH_SIZES)

    # The summary: one row per job, metrics equal to each job's metrics.json.
    assert_summary_files(sweep_dir, 3)
    rows = summary_rows(sweep_dir)
    assert sorted(rows) == ["0", "1", "2"]
    for job in jobs:
        row = rows[job.name]
        assert row["status"] == "completed", row
        assert f"data.batch_size={job_overrides(job)['data.batch_size']}" in row["overrides"]
        assert_row_matches_metrics(row, metrics_of(job))
        assert row["error"] == ""


# ---------------------------------------------------------- 2. joblib, 2 jobs at a time
@pytest.mark.slow
@pytest.mark.float_sensitive
def test_joblib_sweep_gives_same_summary_as_sequential(sequential_sweep, tmp_path):
    seq_proc, seq_dir = sequential_sweep
    ok(seq_proc)
    par_dir = tmp_path / "joblib"
    proc = ok(run_sweep(tmp_path, *SWEEP_3, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                        f"hydra.sweep.dir={par_dir}"))

    # It really was the joblib launcher with 2 jobs at a time.
    hydra_cfg = yaml.safe_load((par_dir / "multirun.yaml").read_text())["hydra"]
    assert "joblib" in hydra_cfg["launcher"]["_target_"].lower(), hydra_cfg["launcher"]
    assert hydra_cfg["launcher"]["n_jobs"] == 2

    jobs = job_dirs(par_dir)
    assert [j.name for j in jobs] == ["0", "1", "2"]
    for job in jobs:
        event_file(job)
    assert_summary_files(par_dir, 3)

    def by_batch(sweep_dir: Path) -> dict[int, dict[str, str]]:
        rows = summary_rows(sweep_dir)
        out = {}
        for job in job_dirs(sweep_dir):
            out[int(job_overrides(job)["data.batch_size"])] = rows[job.name]
        return out

    seq, par = by_batch(seq_dir), by_batch(par_dir)
    assert sorted(seq) == sorted(par) == list(BATCH_SIZES)
    for bs in BATCH_SIZES:
        assert par[bs]["status"] == "completed", par[bs]
        for key in METRIC_COLUMNS:
            assert rel_close(float(par[bs][key]), float(seq[bs][key]), 1e-9), (bs, key)
    # And the parallel rows equal their own jobs' metrics.json.
    rows = summary_rows(par_dir)
    for job in jobs:
        assert_row_matches_metrics(rows[job.name], metrics_of(job))
    assert proc.returncode == 0


# ------------------------------------------------------------ 3. one failing job
@pytest.mark.slow
def test_failed_job_reported_others_complete(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_sweep(tmp_path, "-m", "world_size=2", "trainer.epochs=1", "data.batch_size=16,0",
                     QUIET, f"hydra.sweep.dir={sweep_dir}")
    assert proc.returncode != 0, proc.stderr

    jobs = {int(job_overrides(j)["data.batch_size"]): j for j in job_dirs(sweep_dir)}
    assert sorted(jobs) == [0, 16]
    good, bad = jobs[16], jobs[0]
    assert not (bad / "metrics.json").exists()

    assert_summary_files(sweep_dir, 2)
    rows = summary_rows(sweep_dir)
    assert sorted(rows) == sorted([good.name, bad.name])
    bad_row, good_row = rows[bad.name], rows[good.name]
    assert bad_row["status"] == "failed", bad_row
    assert "data.batch_size" in bad_row["error"], bad_row
    assert all(bad_row[k] == "" for k in METRIC_COLUMNS), bad_row
    assert good_row["status"] == "completed", good_row
    assert good_row["error"] == ""
    assert_row_matches_metrics(good_row, metrics_of(good))

    # stderr names the failed job (its folder name or its failing override).
    assert f"{bad.name} (failed)" in proc.stderr or str(bad) in proc.stderr, proc.stderr
    assert "data.batch_size" in proc.stderr, proc.stderr


# ------------------------------------------------------------------- 4. lr scaling
@pytest.mark.parametrize("rule, factor", [("linear", 128 / 64), ("sqrt", math.sqrt(128 / 64)),
                                          ("none", 1.0)], ids=["linear", "sqrt", "none"])
def test_lr_scaling_logged_effective_lr(run_cli, rule, factor):
    base = 0.05
    expected = base * factor  # global batch 2 x 64 = 128, reference 64
    run = run_cli(f"optim.lr_scaling={rule}", f"optim.lr={base}", "optim.reference_batch_size=64",
                  "world_size=2", "data.batch_size=64", "trainer.epochs=1",
                  "data.val_size=1413",  # 384 training samples: one epoch of 3 steps of 128
                  "trainer.log_every_n_steps=1", QUIET).ok()
    assert run.metrics["global_batch_size"] == 128

    lrs = scalars(run.job_dir, "train/lr")
    assert [s for s, _ in lrs] == [1, 2, 3]
    for step, value in lrs:
        assert value == pytest.approx(expected, rel=1e-6), (step, value, expected)

    hparams, _ = hparams_of(run.job_dir)
    assert hparams["optim.effective_lr"] == pytest.approx(expected, rel=1e-12)
    assert hparams["optim.lr"] == pytest.approx(base, rel=1e-12)
    assert hparams["optim.lr_scaling"] == rule
    # The lr the optimizer really used, as its checkpointed state records it.
    state = torch.load(run.job_dir / "checkpoints" / "last.pt", weights_only=True)
    assert [g["lr"] for g in state["optimizer"]["param_groups"]] == pytest.approx([expected],
                                                                                 rel=1e-12)


# ------------------------------------------------------------------ 5. Optuna search
@pytest.mark.slow
def test_optuna_search_records_best_params(tmp_path):
    sweep_dir = tmp_path / "optuna"
    ok(run_sweep(tmp_path, "hparams_search=digits_optuna", "hydra.sweeper.n_trials=3",
                 "trainer.epochs=1", QUIET, f"hydra.sweep.dir={sweep_dir}", timeout=280))

    jobs = job_dirs(sweep_dir)
    assert len(jobs) == 3, jobs
    losses = {}
    for job in jobs:
        over = job_overrides(job)
        lr, bs = float(over["optim.lr"]), int(over["data.batch_size"])
        assert 0.003 <= lr <= 0.3 and bs in BATCH_SIZES, over
        cfg = job_config(job)
        assert cfg["optim"]["lr"] == pytest.approx(lr) and cfg["data"]["batch_size"] == bs
        losses[job.name] = metrics_of(job)["val/loss"]
        event_file(job)

    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    best = results["best_params"]
    assert set(best) >= {"optim.lr", "data.batch_size"}, best
    assert rel_close(float(results["best_value"]), min(losses.values()), 1e-12), (results, losses)
    best_job = next(j for j in jobs if j.name == min(losses, key=losses.get))
    over = job_overrides(best_job)
    assert float(best["optim.lr"]) == pytest.approx(float(over["optim.lr"]), rel=1e-12)
    assert int(best["data.batch_size"]) == int(over["data.batch_size"])

    assert_summary_files(sweep_dir, 3)
    rows = summary_rows(sweep_dir)
    for job in jobs:
        assert rows[job.name]["status"] == "completed"
        assert_row_matches_metrics(rows[job.name], metrics_of(job))


@pytest.mark.slow
def test_optuna_search_goes_on_after_a_diverged_trial(tmp_path):
    """N06: a trial whose loss diverges (lr=1e30) fails; Optuna is told the worst value (inf)
    instead of NaN, so every other trial runs, the summary lists all four and
    optimization_results.yaml names the best completed one; the sweep exits 1 like any sweep
    with a failed job. Hydra's plugin discovery prints no "setup plugin alembic" lines."""
    sweep_dir = tmp_path / "optuna"
    proc = run_sweep(tmp_path, "-m", "hydra/sweeper=ddp_optuna", "hydra.sweeper.n_trials=4",
                     "hydra.sweeper.sampler.seed=0", "optim.lr=choice(1e30,0.05)",
                     "trainer.max_steps=20", QUIET, f"hydra.sweep.dir={sweep_dir}")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "setup plugin" not in proc.stdout + proc.stderr

    jobs = job_dirs(sweep_dir)
    assert [j.name for j in jobs] == ["0", "1", "2", "3"]
    rows = summary_rows(sweep_dir)
    assert sorted(rows) == ["0", "1", "2", "3"]
    completed = {}
    for job in jobs:
        lr = float(job_overrides(job)["optim.lr"])
        row = rows[job.name]
        if lr == 1e30:
            assert row["status"] == "failed", row
            assert "non-finite training loss" in row["error"], row
            assert not (job / "metrics.json").exists()
        else:
            assert row["status"] == "completed", row
            completed[job.name] = metrics_of(job)["val/loss"]
            assert_row_matches_metrics(row, metrics_of(job))
    assert 0 < len(completed) < 4, rows  # both kinds of trial ran (sampler seed 0)
    assert f"{4 - len(completed)} of 4 jobs did not complete" in proc.stderr

    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert results["best_params"] == {"optim.lr": 0.05}
    assert results["best_value"] == min(completed.values())


def test_objective_is_the_worst_value_for_optimising_sweepers_only():
    """What a failed (NaN) or metric-less (None) job returns: Optuna's direction decides the
    worst value; the basic sweeper (no direction) keeps NaN; a finite val/loss passes as is."""
    from omegaconf import OmegaConf

    from ddp_exp.job.sweep import objective

    for direction, worst in (("minimize", math.inf), (["maximize"], -math.inf)):
        sweeper = OmegaConf.create({"direction": direction})
        assert objective(math.nan, sweeper) == worst, direction
        assert objective(None, sweeper) == worst, direction
        assert objective(0.25, sweeper) == 0.25
    basic = OmegaConf.create({"_target_": "hydra._internal.core_plugins.basic_sweeper."
                                          "BasicSweeper", "max_batch_size": None})
    assert math.isnan(objective(math.nan, basic))
    assert objective(0.25, basic) == 0.25


# ------------------------------------------------------------------------- 6. presets
@pytest.fixture
def compose_hydra():
    """``compose_hydra(*overrides)`` -> the composed config including its ``hydra`` node."""
    import hydra

    from ddp_exp.cli.registry import register  # the entry's: the ddp_optuna sweeper too

    register()
    with hydra.initialize_config_module(config_module="ddp_exp.conf", version_base="1.3"):
        yield lambda *o: hydra.compose("config", overrides=list(o), return_hydra_config=True)


def test_experiment_preset_composes(compose_hydra):
    cfg = compose_hydra("experiment=digits_cnn_batch_sweep")
    assert cfg.model._target_.endswith(".CNN"), cfg.model
    assert cfg.hydra.runtime.choices.model == "cnn"
    assert cfg.optim.lr_scaling == "linear"
    assert cfg.world_size == 2
    params = cfg.hydra.sweeper.params
    assert list(params) == ["data.batch_size"], params
    assert [int(v) for v in str(params["data.batch_size"]).split(",")] == list(BATCH_SIZES)


def test_optuna_preset_composes(compose_hydra):
    from hydra.types import RunMode

    cfg = compose_hydra("hparams_search=digits_optuna")
    assert cfg.hydra.mode == RunMode.MULTIRUN
    assert "optuna" in cfg.hydra.sweeper._target_.lower()
    assert cfg.hydra.sweeper.direction == "minimize"
    assert set(cfg.hydra.sweeper.params) == {"optim.lr", "data.batch_size"}


@pytest.mark.slow
def test_experiment_preset_sweep_runs(tmp_path):
    """The preset's own sweep (3 jobs, CNN, linear lr scaling), shortened to 3 steps per job."""
    sweep_dir = tmp_path / "exp"
    ok(run_sweep(tmp_path, "-m", "experiment=digits_cnn_batch_sweep", "trainer.max_steps=3",
                 "trainer.log_every_n_steps=1", QUIET, f"hydra.sweep.dir={sweep_dir}"))
    jobs = job_dirs(sweep_dir)
    assert len(jobs) == 3
    seen = set()
    for job in jobs:
        bs = job_config(job)["data"]["batch_size"]
        seen.add(bs)
        hparams, _ = hparams_of(job)
        assert hparams["model"] == "cnn"
        assert hparams["optim.effective_lr"] == pytest.approx(0.05 * (2 * bs) / 64, rel=1e-12)
        lrs = scalars(job, "train/lr")
        assert lrs and all(v == pytest.approx(0.05 * 2 * bs / 64, rel=1e-6) for _, v in lrs)
        assert metrics_of(job)["global_step"] == 3
    assert seen == set(BATCH_SIZES)
    rows = summary_rows(sweep_dir)
    assert all(rows[j.name]["status"] == "completed" for j in jobs)


def test_debug_preset_runs_end_to_end(run_cli):
    run = run_cli("debug=default").ok()
    m = run.metrics
    assert m["global_step"] == 5
    assert m["epoch"] == 1
    assert m["val/num_samples"] == 64


# ---------------------------------------------------------- 7. two sweeps at the same time
@pytest.mark.slow
@pytest.mark.float_sensitive
def test_two_sweeps_at_once_do_not_collide(tmp_path):
    tags = [uuid.uuid4().hex, uuid.uuid4().hex]
    dirs = [tmp_path / "a", tmp_path / "b"]
    procs = [start_cli([sys.executable, "-m", "ddp_exp", "-m", "world_size=2",
                        "trainer.epochs=1", "data.batch_size=32,64", QUIET,
                        f"hydra.sweep.dir={d}"], tmp_path, cli_env(tag))
             for tag, d in zip(tags, dirs, strict=True)]
    deadline = time.monotonic() + 240
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for tag in tags:
        assert_no_orphans(tag)
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, f"exit {p.returncode}\n{out}\n{err}"

    per_sweep = []
    for d in dirs:
        jobs = job_dirs(d)
        assert [j.name for j in jobs] == ["0", "1"]
        assert_summary_files(d, 2)
        rows = summary_rows(d)
        values = {}
        for job in jobs:
            m = metrics_of(job)
            assert m["world_size"] == 2  # its own 2-rank world, not merged with the other
            assert rows[job.name]["status"] == "completed"
            assert_row_matches_metrics(rows[job.name], m)
            event_file(job)
            values[int(job_overrides(job)["data.batch_size"])] = m
        per_sweep.append(values)
    # Same seed, same config: the two sweeps trained the same models.
    a, b = per_sweep
    assert sorted(a) == sorted(b) == [32, 64]
    for bs in a:
        for key in METRIC_COLUMNS:
            assert rel_close(a[bs][key], b[bs][key], 1e-9), (bs, key)


def test_a_sweep_run_again_with_resume_skips_finished_jobs(run_cli, tmp_path):
    """Regression: rerunning an interrupted sweep with trainer.resume=auto stopped at the first
    finished job ("nothing left to train"); finished jobs are skipped, the others run."""
    sweep = tmp_path / "sweep"
    args = ("-m", "trainer.epochs=1", "print_config=false", "data.batch_size=32,64",
            f"hydra.sweep.dir={sweep}")
    run_cli(*args, run_dir=False, timeout=300).ok()
    done = (sweep / "0" / "metrics.json").read_bytes()
    shutil.rmtree(sweep / "1")  # as if the sweep had been stopped before job 1
    again = run_cli(*args, "trainer.resume=auto", run_dir=False, timeout=300).ok()
    assert "job 0 already trained all its epochs: skipped" in again.stdout + again.stderr
    assert (sweep / "0" / "metrics.json").read_bytes() == done
    assert json.loads((sweep / "1" / "metrics.json").read_text())["batch_size"] == 64
    assert (sweep / "summary.csv").read_text().count("completed") == 2
