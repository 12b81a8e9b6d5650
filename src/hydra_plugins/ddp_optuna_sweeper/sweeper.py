"""``hydra/sweeper=ddp_optuna``: Optuna search whose trials are pruned per epoch (issue 31).

Each trial is one Hydra job (one DDP world) started through the launcher in use. The sweeper
asks the study for a trial, hands the job the trial's values as overrides it receives exactly
(:func:`space.override_of`) and the trial's link (``ddp_exp.job.pruning``, named by
``hydra.job.env_set``), and, when the job ends, reads its ``status.json`` and ``metrics.json``:
a completed job with a finite monitored value is COMPLETE with that value (the last epoch's), a
job its pruner stopped (``pruned_at_epoch``) is PRUNED, anything else FAIL; the search goes on.
The default storage is a journal file in the sweep folder: no server, and running the same
sweep again in the same ``hydra.sweep.dir`` continues the study up to ``n_trials`` trials that
count (:mod:`.trials`: an interrupted trial is rerun with its parameters and does not count).
A grid search (``sampler.name=grid``) stops when its grid is exhausted, and says so.

The pieces: :mod:`.checks` (settings refused in one line), :mod:`.space` (distributions,
sampler, overrides), :mod:`.trials` (what counts, requeues, the grid's points left),
:mod:`.results` (``optimization_results.yaml``, the summary's record).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from hydra_plugins.ddp_optuna_sweeper import trials as study_trials
from hydra_plugins.ddp_optuna_sweeper.checks import (
    SweepRefused,
    check_counts,
    check_storage,
    direction_of,
)
from hydra_plugins.ddp_optuna_sweeper.results import write_results
from hydra_plugins.ddp_optuna_sweeper.space import (
    build_sampler,
    distributions,
    override_of,
    quoted,
)
from hydra_plugins.ddp_optuna_sweeper.trials import job_outcome

log = logging.getLogger("ddp_exp")

JOURNAL = "optuna_journal.log"


class DDPOptunaSweeper(Sweeper):
    """Hydra sweeper: an Optuna study whose DDP trials report every epoch and can be pruned.
    The keys are those of :class:`hydra_plugins.ddp_optuna_sweeper.config.DDPOptunaSweeperConf`.
    """

    def __init__(self, sampler: Any, pruner: Any, direction: str | None,
                 study_name: str | None, storage: str | None, n_trials: int, n_jobs: int,
                 params: Any) -> None:
        self.sampler_spec = dict(OmegaConf.to_container(sampler) if isinstance(
            sampler, DictConfig) else sampler)
        self.pruner_spec = dict(OmegaConf.to_container(pruner) if isinstance(
            pruner, DictConfig) else pruner)
        self.direction, self.study_name, self.storage = direction, study_name, storage
        self.n_trials, self.n_jobs = n_trials, n_jobs
        self.params = {str(k): str(v) for k, v in (params or {}).items()}

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)
        self.sweep_dir = str(config.hydra.sweep.dir)

    def sweep(self, arguments: list[str]) -> Any:
        """Run the search (see the module's docstring); returns the JobReturns of the
        trials this call ran. Raises SystemExit(2) with one line for a refused setting or
        without Optuna."""
        try:
            import optuna
        except ImportError:
            print("error: hydra/sweeper=ddp_optuna needs Optuna: pip install -e '.[optuna]'",
                  file=sys.stderr, flush=True)
            raise SystemExit(2) from None

        from ddp_exp.job import pruning

        try:
            check_counts(self.n_trials, self.n_jobs)
            check_storage(self.storage)
            dists, fixed = distributions(self.params, arguments)
            direction = direction_of(self.direction, self.config)
            sampler = build_sampler(self.sampler_spec, dists)
            pruner = pruning.build_pruner(self.pruner_spec,
                                          OmegaConf.select(self.config, "trainer.epochs"))
        except (SweepRefused, ValueError) as exc:
            print(f"error: {exc}", flush=True, file=sys.stderr)
            raise SystemExit(2) from None
        monitor = self.monitor = str(OmegaConf.select(self.config, "trainer.monitor"))
        epochs = OmegaConf.select(self.config, "trainer.epochs")
        os.makedirs(self.sweep_dir, exist_ok=True)
        OmegaConf.save(self.config, os.path.join(self.sweep_dir, "multirun.yaml"))  # as Hydra's
        storage_url = self.storage or os.path.abspath(os.path.join(self.sweep_dir, JOURNAL))
        study_name = self.study_name or "ddp_exp"
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage = pruning.storage_of(storage_url)
        study = optuna.create_study(study_name=study_name, storage=storage, sampler=sampler,
                                    pruner=pruner, direction=direction, load_if_exists=True)
        study.set_user_attr(pruning.PRUNER_ATTR, {"spec": self.pruner_spec, "epochs": epochs})
        study_trials.requeue_interrupted(study, storage)
        # Seeded by the trial's place in the search: a resumed study draws what the
        # uninterrupted one would have (interrupted trials have no place; their rerun takes
        # it). Not a grid: its seed orders the grid once, and another order per trial would
        # hand out points twice.
        seed = self.sampler_spec.get("seed") if "grid" != self.sampler_spec.get("name") else None
        asking = threading.Lock()
        env = {pruning.ENV_STORAGE: storage_url, pruning.ENV_STUDY: study_name}

        def run_trial() -> Any:
            with asking:
                if seed is not None:
                    place = sum(1 for t in study.get_trials(deepcopy=False)
                                if not t.user_attrs.get("interrupted")
                                and t.state != optuna.trial.TrialState.WAITING)
                    study.sampler = build_sampler({**self.sampler_spec, "seed": seed + place},
                                                  dists)
                trial = study.ask(dists)
            link = pruning.trial_id(storage, study_name, trial.number)  # what the job links to
            env_set = {**env, pruning.ENV: str(link)}
            overrides = [*fixed, *(override_of(k, v) for k, v in trial.params.items()),
                         *(f"++hydra.job.env_set.{k}={quoted(v)}" for k, v in env_set.items())]
            ret = self.launcher.launch([overrides], initial_job_idx=trial.number)[0]
            job_dir = (OmegaConf.select(ret.hydra_cfg, "hydra.runtime.output_dir")
                       if ret.hydra_cfg is not None else None)
            state, value, pruned_at, epochs_run = job_outcome(job_dir, monitor)
            if pruned_at is not None:
                trial.set_user_attr("pruned_at_epoch", pruned_at)
            if epochs_run is not None:
                trial.set_user_attr("epochs_run", epochs_run)
            trial.set_user_attr("job", os.path.basename(os.path.normpath(job_dir or "")))
            study.tell(trial, value if state == "COMPLETE" else None,
                       state=getattr(optuna.trial.TrialState, state))
            log.info("trial %d: %s%s", trial.number, state,
                     "" if value is None else f" ({monitor} {value:.6g})")
            return ret

        todo = self._todo(study.get_trials(deepcopy=False), dists)
        parallel = self.n_jobs > 1 and "BasicLauncher" not in type(self.launcher).__name__
        if parallel:  # one-job batches from threads: a slot refills as soon as a trial ends
            with ThreadPoolExecutor(self.n_jobs) as pool:
                returns = list(pool.map(lambda _: run_trial(), range(todo)))
        else:
            returns = [run_trial() for _ in range(todo)]
        write_results(study, self.sweep_dir, monitor, direction, epochs)
        return [returns]

    def _todo(self, trials: list[Any], dists: dict[str, Any]) -> int:
        """Trials to run now: ``n_trials`` less those that count (:func:`.trials.counts`); a
        grid search no more than its points left. Says in one line when there is nothing to
        run or when the grid, not ``n_trials``, sets the number."""
        todo = max(0, self.n_trials - sum(study_trials.counts(t) for t in trials))
        if todo == 0:
            log.info("the study has its %d trials (hydra.sweeper.n_trials=%d): nothing to run",
                     self.n_trials, self.n_trials)
            return 0
        if self.sampler_spec.get("name") != "grid":
            return todo
        left, points = study_trials.grid_points_left(trials, dists)
        if left == 0:
            log.info("grid search: all %d points of the grid have run: nothing to run", points)
        elif left < todo:
            log.info("grid search: %d of the grid's %d points left to run; the search stops "
                     "when the grid is exhausted, before hydra.sweeper.n_trials=%d",
                     left, points, self.n_trials)
        elif left > todo:
            log.info("grid search: hydra.sweeper.n_trials=%d leaves %d of the grid's %d points "
                     "unrun (a larger n_trials, run again in this folder, runs them)",
                     self.n_trials, left - todo, points)
        return min(todo, left)
