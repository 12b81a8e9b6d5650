"""``hydra/sweeper=ddp_optuna``: Optuna search whose trials are pruned per epoch (issue 31).

Each trial is one Hydra job (one DDP world) started through the launcher in use. The sweeper
asks the study for a trial, hands the job the trial's link (``ddp_exp.job.pruning``: a file in
``<sweep dir>/.optuna/``, named by ``hydra.job.env_set``), and, when the job ends, reads its
``status.json`` and ``metrics.json``: a completed job with a finite monitored value is COMPLETE
with that value (the last epoch's), a job its pruner stopped (``pruned_at_epoch``) is PRUNED,
anything else FAIL; the search goes on. The default storage is a journal file in the sweep
folder: no server, and running the same sweep again in the same ``hydra.sweep.dir`` continues
the study (trials left RUNNING by an interrupted sweep become FAIL and are requeued once).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("ddp_exp")

JOURNAL = "optuna_journal.log"
RESULTS = "optimization_results.yaml"
SAMPLERS = ("tpe", "random", "grid")


class SweepRefused(ValueError):
    """A ddp_optuna setting that cannot run (one line naming the key and what is valid)."""


def distributions(params: dict[str, str], arguments: list[str]) -> tuple[dict, list[str]]:
    """Optuna distributions of the swept keys and the fixed overrides of every trial:
    ``interval`` is a float range (``tag(log, ...)``: log scale; ``tag(int, ...)``: integers),
    ``choice`` and ``range`` are categorical.

    Args:
        params: ``hydra.sweeper.params`` (key -> a value in Hydra's sweep grammar).
        arguments: the command line's overrides (a sweep there joins ``params``).

    Returns:
        ``({key: optuna distribution}, [fixed "key=value" overrides])``.

    Raises:
        SweepRefused: a sweep the sampler cannot take (``range`` of floats is a choice).
    """
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    parser = OverridesParser.create()
    overrides = parser.parse_overrides([f"{k}={v}" for k, v in params.items()] + arguments)
    dists, fixed = {}, []
    for o in overrides:
        key = o.get_key_element()
        if not o.is_sweep_override():
            fixed.append(o.input_line)
            continue
        value = o.value()
        if isinstance(value, IntervalSweep):
            log_scale = "log" in value.tags
            kind = IntDistribution if "int" in value.tags else FloatDistribution
            cast = int if kind is IntDistribution else float  # Hydra's interval is float
            try:
                dists[key] = kind(cast(value.start), cast(value.end), log=log_scale)
            except ValueError as exc:  # low > high, or a log scale that reaches 0
                raise SweepRefused(f"{o.input_line}: {exc}") from None
        elif isinstance(value, (ChoiceSweep, RangeSweep)):
            dists[key] = CategoricalDistribution(list(o.sweep_iterator()))
        else:
            raise SweepRefused(f"{key}={o.get_value_element_as_str()}: not a sweep the "
                               "ddp_optuna sweeper takes (choice, range, interval)")
    return dists, fixed


def direction_of(direction: str | None, task: DictConfig) -> str:
    """``minimize`` or ``maximize``: ``direction`` if given, else from ``trainer.monitor`` and
    ``trainer.monitor_mode`` (``max`` for ``val/accuracy``).

    Raises:
        SweepRefused: no monitored metric, an unknown direction, or one that contradicts the
            monitored metric's mode.
    """
    from ddp_exp.train.monitor import default_mode

    monitor = OmegaConf.select(task, "trainer.monitor")
    if monitor is None:
        raise SweepRefused("hydra/sweeper=ddp_optuna needs trainer.monitor (the metric it "
                           "optimises and prunes on), e.g. trainer.monitor=val/loss")
    mode = OmegaConf.select(task, "trainer.monitor_mode") or default_mode(monitor)
    implied = "maximize" if mode == "max" else "minimize"
    if direction is None:
        return implied
    if direction not in ("minimize", "maximize"):
        raise SweepRefused(f"hydra.sweeper.direction={direction!r} is invalid: minimize, "
                           "maximize or null (from trainer.monitor_mode)")
    if direction != implied:
        raise SweepRefused(f"hydra.sweeper.direction={direction} contradicts "
                           f"trainer.monitor={monitor} with monitor_mode={mode} (which "
                           f"{implied}s it): drop the direction or set trainer.monitor_mode")
    return direction


def check_counts(n_trials: Any, n_jobs: Any) -> None:
    """Raises SweepRefused for ``hydra.sweeper.n_trials`` or ``n_jobs`` below 1."""
    for key, value in (("n_trials", n_trials), ("n_jobs", n_jobs)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SweepRefused(f"hydra.sweeper.{key}={value!r} is invalid: a whole number >= 1")


def check_storage(storage: str | None) -> None:
    """Raises SweepRefused for a journal-file ``hydra.sweeper.storage`` (no ``://``) whose
    folder does not exist or is not a folder; an RDB URL is Optuna's to check."""
    if not storage or "://" in storage:
        return
    folder = os.path.dirname(os.path.abspath(storage))
    if not os.path.isdir(folder):
        raise SweepRefused(f"hydra.sweeper.storage={storage!r}: its folder {folder} does not "
                           "exist (a journal file's folder must exist; or an RDB URL such as "
                           "sqlite:///study.db)")
    if os.path.isdir(storage):
        raise SweepRefused(f"hydra.sweeper.storage={storage!r} is a folder: name a journal "
                           "file in it, e.g. .../optuna_journal.log")


def build_sampler(spec: dict[str, Any], dists: dict[str, Any]) -> Any:
    """The Optuna sampler of ``hydra.sweeper.sampler`` (``name``, ``seed``)."""
    import optuna

    name, seed = spec.get("name") or "tpe", spec.get("seed")
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        if not all(hasattr(d, "choices") for d in dists.values()):
            raise SweepRefused("hydra.sweeper.sampler.name=grid takes choice(...) and "
                               "range(...) params only, not interval(...)")
        return optuna.samplers.GridSampler(
            {k: list(d.choices) for k, d in dists.items()}, seed=seed)
    raise SweepRefused(f"hydra.sweeper.sampler.name={name!r} is invalid: one of "
                       f"{', '.join(SAMPLERS)}")


def _override(key: str, value: Any) -> str:
    if isinstance(value, str):
        return f"{key}={value}"
    return f"{key}={value!r}" if isinstance(value, float) else f"{key}={value}"


def _quoted(value: str) -> str:
    """``value`` as a quoted string of Hydra's override grammar."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def job_outcome(job_dir: str | None, monitor: str
                ) -> tuple[str, float | None, int | None, int | None]:
    """``(state, value, pruned_at_epoch, epochs_run)`` of a finished job from its folder's
    ``status.json`` and ``metrics.json``: ``COMPLETE`` (finite monitored value), ``PRUNED`` or
    ``FAIL``; ``epochs_run`` is metrics.json's ``epoch`` (``trainer.max_steps`` and early
    stopping end runs early too), None without one."""
    from ddp_exp.io.files import read_json

    folder = job_dir or ""
    status = read_json(os.path.join(folder, "status.json")) or {}
    metrics = read_json(os.path.join(folder, "metrics.json")) or {}
    epochs = metrics.get("epoch") if isinstance(metrics.get("epoch"), int) else None
    if status.get("status") != "completed" or not metrics:
        return "FAIL", None, None, epochs
    pruned = metrics.get("pruned_at_epoch")
    value = metrics.get(monitor)
    finite = isinstance(value, (int, float)) and math.isfinite(value)
    if pruned is not None:
        return "PRUNED", (float(value) if finite else None), int(pruned), epochs
    return ("COMPLETE", float(value), None, epochs) if finite else ("FAIL", None, None, epochs)


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
        seed = self.sampler_spec.get("seed")
        asking = threading.Lock()
        self._requeue_interrupted(study, storage)
        env = {pruning.ENV_STORAGE: storage_url, pruning.ENV_STUDY: study_name}
        returns: list[Any] = []

        def run_trial() -> Any:
            with asking:
                if seed is not None:  # seeded by the trial's place in the search: a resumed
                    # study draws what the uninterrupted one would have (interrupted trials
                    # have no place; their requeued copy takes it)
                    place = sum(1 for t in study.get_trials(deepcopy=False)
                                if not t.user_attrs.get("interrupted")
                                and t.state != optuna.trial.TrialState.WAITING)
                    study.sampler = build_sampler({**self.sampler_spec, "seed": seed + place},
                                                  dists)
                trial = study.ask(dists)
            link = pruning.trial_id(storage, study_name, trial.number)  # what the job links to
            env_set = {**env, pruning.ENV: str(link)}
            overrides = [*fixed, *(_override(k, v) for k, v in trial.params.items()),
                         *(f"++hydra.job.env_set.{k}={_quoted(v)}" for k, v in env_set.items())]
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

        def left() -> int:
            done = {optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED}
            finished = [t for t in study.get_trials(deepcopy=False) if t.state in done
                        or (t.state == optuna.trial.TrialState.FAIL
                            and not t.user_attrs.get("interrupted"))]
            return max(0, self.n_trials - len(finished))

        todo = left()
        parallel = self.n_jobs > 1 and "BasicLauncher" not in type(self.launcher).__name__
        if parallel:  # one-job batches from threads: a slot refills as soon as a trial ends
            with ThreadPoolExecutor(self.n_jobs) as pool:
                returns = list(pool.map(lambda _: run_trial(), range(todo)))
        else:
            returns = [run_trial() for _ in range(todo)]
        self._write_results(study, direction, epochs)
        return [returns]

    def _requeue_interrupted(self, study: Any, storage: Any) -> None:
        """Trials left RUNNING by an interrupted sweep (the journal has no heartbeat): FAIL in
        the study's ``storage``, and each one's params queued once more (not a requeued one's)."""
        import optuna

        study_id = storage.get_study_id_from_name(study.study_name)
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            requeue = "requeue_of" not in t.user_attrs
            tid = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
            storage.set_trial_user_attr(tid, "interrupted", True)
            storage.set_trial_state_values(tid, optuna.trial.TrialState.FAIL)
            if requeue:
                study.enqueue_trial(t.params, user_attrs={"requeue_of": t.number})
            log.info("trial %d was left running by an interrupted sweep: FAIL%s", t.number,
                     ", requeued" if requeue else " (a requeued trial: not again)")

    def _write_results(self, study: Any, direction: str, epochs: int | None) -> None:
        """``optimization_results.yaml``: best params and value, the count per state, and the
        epochs run against those a search without pruning would have run."""
        import yaml

        trials = study.get_trials(deepcopy=False)
        counts: dict[str, int] = {}
        for t in trials:
            counts[t.state.name] = counts.get(t.state.name, 0) + 1
        ran = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]
        # What each trial ran (its metrics.json's epoch: max_steps and early stopping count);
        # without pruning, a pruned trial would have run trainer.epochs at most, a complete one
        # what it ran.
        run = sum(t.user_attrs.get("epochs_run", t.user_attrs.get("pruned_at_epoch") or epochs
                                   or 0) for t in ran)
        full = sum((epochs or 0) if t.state.name == "PRUNED"
                   else t.user_attrs.get("epochs_run", epochs or 0) for t in ran)
        try:
            best = study.best_trial
            best_params, best_value = dict(best.params), best.value
        except ValueError:  # no COMPLETE trial
            best_params, best_value = None, None
        results = {"name": "ddp_optuna", "direction": direction, "best_params": best_params,
                   "best_value": best_value, "states": counts,
                   "epochs_run": run, "epochs_without_pruning": full}
        from ddp_exp.io.files import atomic_write
        from ddp_exp.job.pruning import TRIALS_RECORD

        record = {t.user_attrs["job"]: {
            "number": t.number, "state": t.state.name, "metric": self.monitor,
            "pruned_at_epoch": t.user_attrs.get("pruned_at_epoch"),
            "curve": sorted([step, v] for step, v in t.intermediate_values.items())}
            for t in trials if t.user_attrs.get("job")}
        text = json.dumps(record, indent=1) + "\n"
        atomic_write(os.path.join(self.sweep_dir, TRIALS_RECORD),
                     lambda fh: fh.write(text.encode()))
        path = os.path.join(self.sweep_dir, RESULTS)
        text = yaml.safe_dump(results, sort_keys=False)
        atomic_write(path, lambda fh: fh.write(text.encode()))
        log.info("best %s: %s (%s)", direction, best_value, os.path.abspath(path))
