"""hydra/sweeper=ddp_optuna, round 4 (issue 41): an interrupted study exits 0 once every trial
has a final state (F11), a trial that trained all its epochs is COMPLETE (F12), a grid search
finishes and stops when its grid is exhausted (W01, optuna #5141), and string choices reach the
job exactly as written (W03, hydra #2612).

One CLI test (a grid of three strings, killed with SIGKILL inside a trial, run again twice);
the rest in-process on real Optuna studies.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from helpers import QUIET, assert_no_orphans, run_sweep, start_watched

optuna = pytest.importorskip("optuna")

# Strings Hydra's grammar would split, misparse, retype or strip when written unquoted.
AWKWARD = ["Hello, world", "x=y", "Q: The ", "  both  ", "it's", 'say "hi"', "a\\b",
           "ends\\", "\\'", "32", "true", "null", "${oc.env:HOME}", "[1, 2]", "é 中 🙂", ""]


@pytest.mark.parametrize("value", [*AWKWARD, True, False, None, 3, -7, 0.1, 1e-05, 3.0e30])
def test_a_trial_value_is_parsed_back_exactly(value):
    """Every value an Optuna categorical can hold, written as an override, parses back (Hydra's
    own parser) to the same value and type."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra_plugins.ddp_optuna_sweeper.space import override_of

    parsed = OverridesParser.create().parse_override(override_of("trainer.sample_prompt",
                                                                 value)).value()
    assert type(parsed) is type(value) and parsed == value, override_of("k", value)


def test_string_choices_reach_the_composed_config_exactly():
    """The sweep grammar's own choice of awkward strings (as a user writes it) gives the
    sweeper its values, whose overrides compose a job config holding the exact strings
    (``${...}`` stays an interpolation, as in Hydra's own sweeps)."""
    import hydra

    from ddp_exp.config.compose import register_configs
    from hydra_plugins.ddp_optuna_sweeper.space import distributions, override_of

    written = "choice('Hello, world', 'x=y', 'Q: The ', \"it's\", '32', 'a\\b', ' lead')"
    dist = distributions({"trainer.sample_prompt": written}, [])[0]["trainer.sample_prompt"]
    assert list(dist.choices) == ["Hello, world", "x=y", "Q: The ", "it's", "32", "a\\b",
                                  " lead"]
    register_configs()
    with hydra.initialize_config_module(config_module="ddp_exp.conf", version_base="1.3"):
        for value in dist.choices:
            cfg = hydra.compose("config", overrides=[override_of("trainer.sample_prompt",
                                                                 value)])
            assert cfg.trainer.sample_prompt == value


def _grid_study(values: list[int]):
    from hydra_plugins.ddp_optuna_sweeper.space import build_sampler, distributions

    dists, _ = distributions({"data.batch_size": f"choice({','.join(map(str, values))})"}, [])
    sampler = build_sampler({"name": "grid", "seed": 0}, dists)
    return optuna.create_study(sampler=sampler), dists


def test_grid_search_by_ask_and_tell_runs_every_point_once():
    """W01: the grid of choice(32, 64) asked and told twice: both points, no
    ``Study.stop`` error, and nothing left. Optuna's own GridSampler still raises there (the
    day it does not, our subclass can go)."""
    from hydra_plugins.ddp_optuna_sweeper.trials import grid_points_left

    study, dists = _grid_study([32, 64])
    for value in (1.0, 2.0):
        trial = study.ask(dists)
        study.tell(trial, value)
    assert sorted(t.params["data.batch_size"] for t in study.trials) == [32, 64]
    assert grid_points_left(study.trials, dists) == (0, 2)

    upstream = optuna.create_study(sampler=optuna.samplers.GridSampler(
        {"data.batch_size": [32, 64]}))
    upstream.tell(upstream.ask(dists), 1.0)
    with pytest.raises(RuntimeError, match="Study.stop` is supposed to be invoked inside"):
        upstream.tell(upstream.ask(dists), 2.0)


@pytest.mark.parametrize("points, n_trials, todo, line", [
    (2, 5, 2, "grid search: 2 of the grid's 2 points left to run; the search stops when the "
              "grid is exhausted, before hydra.sweeper.n_trials=5"),
    (4, 2, 2, "grid search: hydra.sweeper.n_trials=2 leaves 2 of the grid's 4 points unrun (a "
              "larger n_trials, run again in this folder, runs them)"),
    (2, 2, 2, None), (1, 3, 1, "grid search: 1 of the grid's 1 points left to run; the "
                                 "search stops when the grid is exhausted, before "
                                 "hydra.sweeper.n_trials=3")])
def test_grid_or_n_trials_whichever_is_smaller(points, n_trials, todo, line, caplog):
    from hydra_plugins.ddp_optuna_sweeper.sweeper import DDPOptunaSweeper

    study, dists = _grid_study([16 * 2 ** i for i in range(points)])
    sweeper = DDPOptunaSweeper({"name": "grid"}, {"name": "none"}, None, None, None,
                               n_trials, 1, {})
    with caplog.at_level(logging.INFO, logger="ddp_exp"):
        assert sweeper._todo(study.trials, dists) == todo
    assert [r.getMessage() for r in caplog.records if r.name == "ddp_exp"] == (
        [line] if line else [])


def _study_in(folder: Path):
    from ddp_exp.job.pruning import storage_of

    storage = storage_of(str(folder / "optuna_journal.log"))
    return optuna.create_study(study_name="s", storage=storage, direction="maximize"), storage


def _job(sweep_dir: Path, num: int, status: str | None, accuracy: float | None = None) -> None:
    """A job folder as Hydra and ddp_exp leave it (status None: killed before it wrote one)."""
    job = sweep_dir / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"job": {"num": num}}}))
    if status is not None:
        (job / "status.json").write_text(json.dumps({"status": status, "overrides": []}))
    if accuracy is not None:
        (job / "metrics.json").write_text(json.dumps({"val/accuracy": accuracy, "epoch": 1}))


def test_an_interrupted_trial_is_rerun_and_fails_nothing(tmp_path):
    """F11: trial 1 left RUNNING by a killed sweep becomes FAIL (interrupted), its params run
    again as trial 2 and it counts neither against n_trials nor as a failed job; a rerun
    interrupted in its turn is queued again. A trial that truly failed still fails the sweep."""
    from omegaconf import OmegaConf

    from ddp_exp.job import sweep
    from hydra_plugins.ddp_optuna_sweeper.results import write_results
    from hydra_plugins.ddp_optuna_sweeper.trials import counts, requeue_interrupted

    dist = {"optim.lr": optuna.distributions.FloatDistribution(1e-3, 1.0)}
    study, storage = _study_in(tmp_path)
    done = study.ask(dist)
    done.set_user_attr("job", "0")
    study.tell(done, 0.9)
    killed = study.ask(dist)  # the sweep died while trial 1 trained: RUNNING in the journal
    requeue_interrupted(study, storage)
    rerun = study.ask(dist)
    assert (rerun.number, rerun.params) == (2, killed.params)
    rerun.set_user_attr("job", "2")
    study.tell(rerun, 0.8)
    trials = study.get_trials()
    assert trials[1].state.name == "FAIL" and trials[1].user_attrs["interrupted"]
    assert trials[2].user_attrs["requeue_of"] == 1
    assert [counts(t) for t in trials] == [True, False, True]

    for num, status, acc in ((0, "completed", 0.9), (1, None, None), (2, "completed", 0.8)):
        _job(tmp_path, num, status, acc)
    write_results(study, str(tmp_path), "val/accuracy", "maximize", 1)
    results = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert results["reruns"] == {1: 2} and results["states"] == {"COMPLETE": 2, "FAIL": 1}
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    sweep.SummaryCallback().on_multirun_end(config)
    sweep.raise_if_failed()  # exit 0: every trial has a final state
    summary = (tmp_path / "summary.md").read_text()
    assert "| interrupted; rerun as trial 2 |" in summary
    assert "`objective`: the value the Optuna search optimises" in summary

    again = study.ask(dist)  # the rerun of a rerun: interrupted too, queued again
    requeue_interrupted(study, storage)
    assert study.get_trials()[-1].user_attrs["requeue_of"] == again.number
    assert study.get_trials()[-1].state.name == "WAITING"

    failed = study.ask(dist)
    failed.set_user_attr("job", str(failed.number))
    study.tell(failed, state=optuna.trial.TrialState.FAIL)
    _job(tmp_path, failed.number, "failed")
    write_results(study, str(tmp_path), "val/accuracy", "maximize", 1)
    sweep.SummaryCallback().on_multirun_end(config)
    with pytest.raises(sweep.SweepFailed, match=rf"^1 of 4 jobs did not complete: "
                                                rf"{failed.number} \(failed\)"):
        sweep.raise_if_failed()


def test_a_trial_that_trained_its_last_epoch_is_not_pruned(tmp_path):
    """F12: successive halving (min_resource 1, factor 2) has a rung at epoch 8; a trial among
    the best at epochs 1, 2 and 4 and the worst at its last epoch, 8 of 8, reports that value
    and finishes COMPLETE-able: not pruned, not stopped early. The same trial with 9 epochs
    (epoch 8 not its last) is pruned there: the rung is real."""
    from ddp_exp.job.pruning import PRUNER_ATTR, TrialLink, trial_id
    from ddp_exp.train.monitor import Monitor

    dist = {"optim.lr": optuna.distributions.FloatDistribution(1e-3, 1.0)}
    study, storage = _study_in(tmp_path)
    spec = {"name": "successive_halving", "min_resource": 1, "reduction_factor": 2}
    study.set_user_attr(PRUNER_ATTR, {"spec": spec, "epochs": 8})
    journal = str(tmp_path / "optuna_journal.log")

    def link(trial):
        return TrialLink(journal, "s", trial_id(storage, "s", trial.number), True, "cpu")

    for value in (0.5, 0.6, 0.7):  # three trials through every rung, none pruned
        trial = study.ask(dist)
        others = link(trial)
        assert not any(others.should_prune(value, epoch) for epoch in range(9))
        study.tell(trial, value)
    curve = [0.95] * 7 + [0.1]  # the best until epoch 7, the worst at epoch 8
    for epochs, want_pruned in ((8, None), (9, 8)):
        trial = study.ask(dist)
        monitor = Monitor("val/accuracy", "max", None)
        monitor.trial = link(trial)
        for epoch, value in enumerate(curve):
            monitor.update({"val/accuracy": value}, epoch, final=epoch + 1 == epochs)
            if monitor.stopped_early:
                break
        assert monitor.results()["pruned_at_epoch"] == want_pruned
        assert monitor.stopped_early is (want_pruned is not None)
        reported = study.get_trials()[trial.number].intermediate_values
        assert reported == {e + 1: v for e, v in enumerate(curve)}


@pytest.mark.slow
def test_string_grid_killed_inside_a_trial_finishes_and_exits_0(tmp_path):
    """W01 + W03 + F11 end to end: a grid of three awkward strings (n_trials 4: the grid ends
    first), SIGKILL to the whole sweep while trial 1 trains, the same command again: trial 1's
    string reruns as trial 2, every string reached its job as written, the results record
    what ran, exit 0; a third run has nothing to do and exits 0."""
    sweep_dir = tmp_path / "sweep"
    values = ["Hello, world", "x=y", "Q: The "]
    args = ["-m", "hydra/sweeper=ddp_optuna", "hydra.sweeper.sampler.name=grid",
            "trainer.sample_prompt=choice('Hello, world','x=y','Q: The ')",
            "hydra.sweeper.n_trials=4", "trainer.epochs=1", "world_size=1", QUIET,
            f"hydra.sweep.dir={sweep_dir}"]
    tag = uuid.uuid4().hex
    watched = start_watched([sys.executable, "-m", "ddp_exp", *args], tmp_path, tag,
                            "#1 :")
    assert watched.seen.wait(120), watched.text
    while not (sweep_dir / "1" / "tensorboard").exists() and watched.proc.poll() is None:
        time.sleep(0.05)  # inside trial 1 once its world has started writing
    os.killpg(watched.proc.pid, signal.SIGKILL)
    watched.proc.wait(30)
    assert_no_orphans(tag)
    assert not (sweep_dir / "1" / "status.json").exists()

    proc = run_sweep(tmp_path, *args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "trial 1 was left running by an interrupted sweep: FAIL, requeued" in out
    assert ("grid search: 2 of the grid's 3 points left to run; the search stops when the grid "
            "is exhausted, before hydra.sweeper.n_trials=4") in out
    ran = {}
    for job in ("0", "2", "3"):
        config = yaml.safe_load((sweep_dir / job / ".hydra" / "config.yaml").read_text())
        ran[job] = config["trainer"]["sample_prompt"]
        assert json.loads((sweep_dir / job / "status.json").read_text())["status"] == "completed"
    assert sorted(ran.values()) == sorted(values)
    record = json.loads((sweep_dir / "optuna_trials.json").read_text())
    assert record["1"]["interrupted"] and record["1"]["rerun_as"] == 2  # queued: next number
    killed = yaml.safe_load((sweep_dir / "1" / ".hydra" / "config.yaml").read_text())
    assert ran["2"] == killed["trainer"]["sample_prompt"]  # the same string, run again
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert results["states"] == {"COMPLETE": 3, "FAIL": 1}
    assert results["best_params"]["trainer.sample_prompt"] in values
    from ddp_exp.job.pruning import storage_of

    storage = storage_of(str(sweep_dir / "optuna_journal.log"))
    trials = optuna.load_study(study_name="ddp_exp", storage=storage).trials
    assert {t.user_attrs["job"]: t.params["trainer.sample_prompt"]
            for t in trials if t.state.name == "COMPLETE"} == ran

    third = run_sweep(tmp_path, *args)
    assert third.returncode == 0, third.stdout + third.stderr
    assert "grid search: all 3 points of the grid have run: nothing to run" in third.stdout
    assert "Launching" not in third.stdout + third.stderr
