"""hydra/sweeper=ddp_optuna (issue 31): an Optuna search whose DDP trials report every epoch and
are pruned, on a journal file in the sweep folder, resumable there.

One pruned sweep (8 trials, ASHA, 6 epochs, a learning rate space with diverging and useless
values, maximising val/accuracy) serves most assertions; the resume test runs the same sweep in
a fresh folder, interrupted at its fourth trial and run again, and compares it with the first.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from helpers import QUIET, run_sweep, start_watched

optuna = pytest.importorskip("optuna")

SWEEP = ["-m", "hydra/sweeper=ddp_optuna", "hydra.sweeper.n_trials=8",
         "hydra.sweeper.sampler.seed=0", "hydra.sweeper.pruner.name=successive_halving",
         "hydra.sweeper.pruner.min_resource=1", "hydra.sweeper.pruner.reduction_factor=2",
         "optim.lr=choice(1e30,3.0,1e-4,0.003,0.03,0.1,0.3)", "trainer.epochs=6",
         "trainer.monitor=val/accuracy", QUIET]


def study_trials(sweep_dir: Path) -> list:
    """The study's trials, read from the sweep folder's journal file."""
    from ddp_exp.job.pruning import storage_of

    storage = storage_of(str(sweep_dir / "optuna_journal.log"))
    (summary,) = optuna.get_all_study_summaries(storage)
    return optuna.load_study(study_name=summary.study_name, storage=storage).trials


def by_place(trials: list) -> list:
    """Finished trials in their place in the search (an interrupted trial has none)."""
    return [t for t in trials if not t.user_attrs.get("interrupted")]


def csv_rows(sweep_dir: Path) -> dict[str, dict[str, str]]:
    import csv

    with open(sweep_dir / "summary.csv", newline="") as fh:
        return {row["job"]: row for row in csv.DictReader(fh)}


@pytest.fixture(scope="module")
def asha(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    root = tmp_path_factory.mktemp("asha")
    sweep_dir = root / "sweep"
    return run_sweep(root, *SWEEP, f"hydra.sweep.dir={sweep_dir}"), sweep_dir


@pytest.mark.slow
def test_pruned_search_states_summary_and_best(asha):
    proc, sweep_dir = asha
    # The diverging trial (lr=1e30) fails, the search goes on; the sweep exits 1 for it.
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    trials = study_trials(sweep_dir)
    assert len(trials) == 8
    states = {t.number: t.state.name for t in trials}
    assert list(states.values()).count("PRUNED") >= 1, states
    rows = csv_rows(sweep_dir)
    assert sorted(rows, key=int) == [str(n) for n in range(8)]
    epochs_run = 0
    for t in trials:
        row, job = rows[str(t.number)], sweep_dir / str(t.number)
        assert row["state"] == t.state.name, row
        assert float(job.joinpath(".hydra", "overrides.yaml").read_text().split(
            "optim.lr=")[1].split()[0]) == t.params["optim.lr"]
        if t.params["optim.lr"] == 1e30:
            assert t.state.name == "FAIL" and row["status"] == "failed", row
            assert "non-finite" in row["error"]
            continue
        metrics = json.loads((job / "metrics.json").read_text())
        epochs_run += metrics["epoch"]
        # every epoch's reduced value reached the study, the last one is the final metric
        assert sorted(t.intermediate_values) == list(range(1, metrics["epoch"] + 1))
        assert t.intermediate_values[metrics["epoch"]] == metrics["val/accuracy"]
        if t.state.name == "PRUNED":
            assert metrics["pruned_at_epoch"] == metrics["epoch"] < 6, metrics
            assert row["pruned_at_epoch"] == str(metrics["epoch"]), row
            assert metrics["stopped_early"] is True
            status = json.loads((job / "status.json").read_text())
            assert status["status"] == "completed" and status["pruned"] is True
            assert status["pruned_at_epoch"] == metrics["epoch"]
        else:
            assert t.state.name == "COMPLETE" and metrics["epoch"] == 6
            assert metrics["pruned_at_epoch"] is None and row["pruned_at_epoch"] == ""
            assert t.value == metrics["val/accuracy"]
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert results["states"] == {s: list(states.values()).count(s) for s in set(states.values())}
    assert results["epochs_run"] == epochs_run
    assert results["epochs_without_pruning"] == 6 * 7
    assert epochs_run <= 0.8 * 6 * 7, results  # clearly fewer epochs than the full search
    # Maximising val/accuracy (the direction from trainer.monitor): the best is the highest.
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    best = max(complete, key=lambda t: t.value)
    assert results["direction"] == "maximize"
    assert results["best_value"] == best.value and results["best_params"] == best.params
    assert (sweep_dir / "summary.png").read_bytes()[:4] == b"\x89PNG"
    record = json.loads((sweep_dir / "optuna_trials.json").read_text())
    assert {k: v["state"] for k, v in record.items()} == {str(n): s for n, s in states.items()}


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_pruned_trial_equals_a_run_of_that_many_epochs(asha, run_cli):
    """Pruning only stops: a pruned trial's weights and metrics are those of the same config
    run for the epochs it ran (scheduler=none, the default)."""
    _, sweep_dir = asha
    pruned = [t for t in study_trials(sweep_dir) if t.state.name == "PRUNED"]
    job = sweep_dir / str(pruned[0].number)
    metrics = json.loads((job / "metrics.json").read_text())
    overrides = [o for o in yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
                 if not o.startswith("trainer.epochs=")]
    run = run_cli(*overrides, f"trainer.epochs={metrics['pruned_at_epoch']}").ok()
    for key in ("val/loss", "val/accuracy", "train/loss", "epoch", "global_step"):
        assert run.metrics[key] == metrics[key], key
    ours = torch.load(job / "checkpoints" / "last.pt", weights_only=True)["model"]
    theirs = torch.load(run.job_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_interrupted_sweep_resumes_reproducing_the_uninterrupted_one(asha, tmp_path):
    """The same sweep in a fresh folder, stopped by Ctrl-C as its fourth trial starts, then run
    again there: the rerun starts 5 trials (the interrupted one's params first, none of the 3
    finished again) and the search, place by place, has the uninterrupted sweep's params,
    states and per-epoch values."""
    _, first_dir = asha
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "ddp_exp", *SWEEP, f"hydra.sweep.dir={sweep_dir}"]
    watched = start_watched(cmd, tmp_path, uuid.uuid4().hex, "#3 :")
    assert watched.seen.wait(120), watched.text
    watched.proc.send_signal(signal.SIGINT)
    assert watched.proc.wait(60) != 0
    interrupted = study_trials(sweep_dir)
    assert [t.state.name for t in interrupted][3] == "RUNNING"

    proc = run_sweep(tmp_path, *SWEEP, f"hydra.sweep.dir={sweep_dir}")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # lr=1e30 failed, as in the first
    out = proc.stdout + proc.stderr
    assert out.count("Launching 1 jobs") == 5, out
    assert "trial 3 was left running by an interrupted sweep: FAIL, requeued" in out
    trials = study_trials(sweep_dir)
    assert trials[3].state.name == "FAIL" and trials[3].user_attrs["interrupted"]
    assert trials[4].user_attrs["requeue_of"] == 3  # the next number, run first
    # its job folder, if Hydra had made it before the signal, is a FAIL row
    assert csv_rows(sweep_dir).get("3", {"state": "FAIL"})["state"] == "FAIL"
    want, got = by_place(study_trials(first_dir)), by_place(trials)
    assert [t.number for t in got] == [0, 1, 2, 4, 5, 6, 7, 8]
    assert [t.params for t in got] == [t.params for t in want]
    assert [t.state for t in got] == [t.state for t in want]
    assert [t.intermediate_values for t in got] == [t.intermediate_values for t in want]


@pytest.mark.slow
def test_direction_that_contradicts_the_monitor_is_refused(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_sweep(tmp_path, "hparams_search=digits_asha", "hydra.sweeper.direction=minimize",
                     f"hydra.sweep.dir={sweep_dir}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: hydra.sweeper.direction=minimize contradicts trainer.monitor=val/accuracy with "
        "monitor_mode=max (which maximizes it): drop the direction or set "
        "trainer.monitor_mode")
    assert "Traceback" not in proc.stderr
    assert not sweep_dir.exists()


@pytest.mark.parametrize("override, line", [
    ("hydra.sweeper.n_trials=0", "error: hydra.sweeper.n_trials=0 is invalid: a whole number >= 1"),
    ("hydra.sweeper.storage=/nonexistent/dir/j.log",
     "error: hydra.sweeper.storage='/nonexistent/dir/j.log': its folder /nonexistent/dir does "
     "not exist (a journal file's folder must exist; or an RDB URL such as "
     "sqlite:///study.db)")], ids=["n_trials", "storage"])
def test_trial_count_and_storage_are_refused_in_one_line(tmp_path, override, line):
    """Fresh-user findings: n_trials=0 (or -1) ran nothing and exited 0; a journal file in a
    folder that does not exist was a 36-line FileNotFoundError traceback leaving a sweep
    folder. One line, exit 2, no folder."""
    sweep_dir = tmp_path / "sweep"
    proc = run_sweep(tmp_path, "hparams_search=digits_asha", override,
                     f"hydra.sweep.dir={sweep_dir}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [line], proc.stderr
    assert not sweep_dir.exists()


def test_epochs_run_counts_what_each_trial_ran(tmp_path):
    """Fresh-user finding: optimization_results.yaml's epochs_run counted trainer.epochs for
    every complete trial, so a sweep under trainer.max_steps (or with early stopping) reported
    epochs no trial ran. It is each trial's metrics.json epoch; epochs_without_pruning counts a
    pruned trial at trainer.epochs and a complete one at what it ran."""
    from hydra_plugins.ddp_optuna_sweeper.results import write_results

    dist = {"optim.lr": optuna.distributions.FloatDistribution(1e-4, 1.0)}
    study = optuna.create_study(direction="maximize")
    for number, (state, ran) in enumerate([("COMPLETE", 1), ("COMPLETE", 3), ("PRUNED", 2)]):
        attrs = {"job": str(number), "epochs_run": ran}
        if state == "PRUNED":
            attrs["pruned_at_epoch"] = ran
        study.add_trial(optuna.trial.create_trial(
            state=getattr(optuna.trial.TrialState, state), params={"optim.lr": 0.1},
            distributions=dist, value=0.5 if state == "COMPLETE" else None, user_attrs=attrs))
    write_results(study, str(tmp_path), "val/accuracy", "maximize", 6)
    results = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert results["epochs_run"] == 1 + 3 + 2
    assert results["epochs_without_pruning"] == 1 + 3 + 6


# ------------------------------------------------------------------ in-process pieces
def test_sweep_grammar_becomes_optuna_distributions():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from hydra_plugins.ddp_optuna_sweeper.sweeper import distributions

    dists, fixed = distributions(
        {"optim.lr": "tag(log, interval(0.001, 0.3))", "data.batch_size": "choice(16, 32)"},
        ["model.hidden=range(8, 20, 4)", "optim.momentum=interval(0.5, 0.9)",
         "trainer.epochs=3", "seed=tag(int, interval(1, 5))"])
    assert dists["optim.lr"] == FloatDistribution(0.001, 0.3, log=True)
    assert dists["data.batch_size"] == CategoricalDistribution([16, 32])
    assert dists["model.hidden"] == CategoricalDistribution([8, 12, 16])
    assert dists["optim.momentum"] == FloatDistribution(0.5, 0.9)
    assert dists["seed"] == IntDistribution(1, 5)
    assert fixed == ["trainer.epochs=3"]


def test_a_backwards_interval_names_its_key():
    """Fresh-user finding: optim.lr=interval(1,0) was "`low <= high` must hold, but got
    (low=1.0, high=0.0)" without the key."""
    from hydra_plugins.ddp_optuna_sweeper.sweeper import SweepRefused, distributions

    with pytest.raises(SweepRefused, match=r"^optim\.lr=interval\(1,0\): .*low <= high"):
        distributions({"optim.lr": "interval(1,0)"}, [])


def test_direction_defaults_from_the_monitor():
    from omegaconf import OmegaConf

    from hydra_plugins.ddp_optuna_sweeper.sweeper import SweepRefused, direction_of

    def task(monitor, mode=None):
        return OmegaConf.create({"trainer": {"monitor": monitor, "monitor_mode": mode}})

    assert direction_of(None, task("val/accuracy")) == "maximize"
    assert direction_of(None, task("val/loss")) == "minimize"
    assert direction_of(None, task("val/f1", "max")) == "maximize"
    assert direction_of("minimize", task("val/loss")) == "minimize"
    for direction, cfg in (("maximize", task("val/loss")), ("up", task("val/loss")),
                           (None, task(None))):
        with pytest.raises(SweepRefused):
            direction_of(direction, cfg)


def test_pruners_and_samplers_by_name():
    from ddp_exp.job.pruning import build_pruner
    from hydra_plugins.ddp_optuna_sweeper.sweeper import SweepRefused, build_sampler

    assert isinstance(build_pruner({"name": "none"}), optuna.pruners.NopPruner)
    assert isinstance(build_pruner({"name": "median"}), optuna.pruners.MedianPruner)
    assert isinstance(build_pruner({"name": "successive_halving", "min_resource": 1}),
                      optuna.pruners.SuccessiveHalvingPruner)
    assert isinstance(build_pruner({"name": "hyperband"}, epochs=9),
                      optuna.pruners.HyperbandPruner)
    with pytest.raises(ValueError, match="one of none, median, successive_halving"):
        build_pruner({"name": "asha"})
    choice = optuna.distributions.CategoricalDistribution([1, 2])
    assert isinstance(build_sampler({"name": "grid", "seed": 0}, {"a": choice}),
                      optuna.samplers.GridSampler)
    assert isinstance(build_sampler({"name": "random"}, {}), optuna.samplers.RandomSampler)
    with pytest.raises(SweepRefused, match="one of tpe, random, grid"):
        build_sampler({"name": "cmaes"}, {})


def test_monitor_stops_every_rank_on_the_pruners_word():
    """The prune decision (a stand-in for the broadcast TrialLink) stops like early stopping
    and lands in metrics.json's pruned_at_epoch; a run outside a sweep has no such key."""
    from ddp_exp.train.monitor import Monitor

    class Link:
        def should_prune(self, value, epoch, final=False):
            return epoch == 1

    monitor = Monitor("val/accuracy", "max", None)
    assert "pruned_at_epoch" not in monitor.results()
    monitor.trial = Link()
    monitor.update({"val/accuracy": 0.5}, 0)
    assert not monitor.stopped_early and monitor.results()["pruned_at_epoch"] is None
    monitor.update({"val/accuracy": 0.6}, 1)
    assert monitor.stopped_early and monitor.results()["pruned_at_epoch"] == 2
    assert monitor.stop_line(6).startswith("pruned: the sweep's pruner stops this trial after "
                                           "epoch 2/6")


def test_old_optuna_sweeper_names_its_replacement():
    from ddp_exp.cli.errors import missing_plugin_hint

    line = missing_plugin_hint("hydra/sweeper=optuna: no such option in config group "
                               "hydra/sweeper; valid options: basic, ddp_optuna")
    assert line.startswith("hint: hydra/sweeper=optuna (Hydra's Optuna sweeper: optuna<3, no "
                           "pruning) is replaced by hydra/sweeper=ddp_optuna"), line
    assert missing_plugin_hint("hydra/sweeper=ddp_optuna: x") is None


@pytest.mark.parametrize("preset, direction, pruner", [("digits_optuna", "minimize", "none"),
                                                        ("digits_asha", None,
                                                         "successive_halving")])
def test_presets_use_the_ddp_optuna_sweeper(preset, direction, pruner):
    import hydra

    from ddp_exp.cli.registry import register  # the entry's: the ddp_optuna sweeper too

    register()
    with hydra.initialize_config_module(config_module="ddp_exp.conf", version_base="1.3"):
        cfg = hydra.compose("config", overrides=[f"hparams_search={preset}"],
                            return_hydra_config=True)
    assert cfg.hydra.sweeper._target_.endswith("ddp_optuna_sweeper.sweeper.DDPOptunaSweeper")
    assert cfg.hydra.sweeper.direction == direction
    assert cfg.hydra.sweeper.pruner.name == pruner
    assert math.isfinite(cfg.hydra.sweeper.n_trials)


def test_without_optuna_the_sweeper_says_what_to_install(monkeypatch, capsys):
    from hydra_plugins.ddp_optuna_sweeper.sweeper import DDPOptunaSweeper

    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna raises ImportError
    sweeper = DDPOptunaSweeper({"name": "tpe"}, {"name": "none"}, None, None, None, 2, 1, {})
    with pytest.raises(SystemExit) as exit_info:
        sweeper.sweep([])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: hydra/sweeper=ddp_optuna needs Optuna: pip install -e '.[optuna]'\n")
