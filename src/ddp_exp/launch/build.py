"""The build-once step: from a validated config to what every rank needs (:class:`RankInputs`).

:func:`prepare`, used by both launch paths (the elastic launch and the torchrun join of
:mod:`ddp_exp.launch.elastic`), builds in this process, before any rank starts: the data split, the
seeded model (identical initial weights on every rank), the objective checked on two training
samples, the optimizer and the scheduler, and, when resuming, checks that the checkpoint fits
them. Bad input therefore fails here, once, with one line naming the key, not in ``world_size``
ranks.

May use: :mod:`ddp_exp.config`, :mod:`ddp_exp.data`, :mod:`ddp_exp.data.loaders`,
:mod:`ddp_exp.train.models`, :mod:`ddp_exp.train.objective`, :mod:`ddp_exp.train.loop` (the
optimizer),
:mod:`ddp_exp.train.schedule`, :mod:`ddp_exp.train.monitor`, :mod:`ddp_exp.io.checkpoint`,
:mod:`ddp_exp.metrics.writer` (hyper-parameters), :mod:`ddp_exp.job.folder` (refusals, the job log),
:mod:`ddp_exp.job.earlier_run` (an earlier run in the job folder),
:mod:`ddp_exp.rank.worker` (:class:`RankInputs`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from ddp_exp import data as data_module
from ddp_exp.config.checks import apply_global_batch, effective_lr, global_batch_size
from ddp_exp.config.errors import ConfigError, described
from ddp_exp.config.view import RankConfig, rank_config
from ddp_exp.data import Datasets
from ddp_exp.data.loaders import seeded
from ddp_exp.io import checkpoint, sharded
from ddp_exp.job import earlier_run
from ddp_exp.job.folder import AlreadyComplete, job_log_file
from ddp_exp.launch import model_size
from ddp_exp.launch.run_record import record_start
from ddp_exp.launch.tracker_plan import plan_trackers, preload_trackers, start_trackers
from ddp_exp.metrics.writer import flatten_hparams
from ddp_exp.rank.worker import RankInputs
from ddp_exp.train import monitor, schedule
from ddp_exp.train import state as train_state
from ddp_exp.train.models import build_model
from ddp_exp.train.objective import Objective
from ddp_exp.train.optimizer import build_optimizer, check_optimizer
from ddp_exp.train.strategy import check_model as check_strategy

log = logging.getLogger("ddp_exp")


def load_data(cfg: DictConfig) -> Datasets:
    """Build ``cfg.data``'s training, validation and test split (:func:`ddp_exp.data.load`): arrays
    read once, or lazy datasets of which one item is read.

    Raises:
        ConfigError: unreadable data, or ``data.val_size`` / ``data.test_size`` too large.
    """
    datasets = data_module.load(OmegaConf.to_container(cfg.data, resolve=True), cfg.seed,
                                cfg.world_size)
    limit = cfg.trainer.get("limit_val_batches")
    if limit is not None:
        # the first limit x global batch validation samples of the single-process order:
        # counted in the world's batches, so equal training validates on equal samples
        # (the same set for any world_size with the same global batch)
        keep = limit * global_batch_size(cfg)
        if len(datasets.val) > keep:
            datasets.val = datasets.val.subset(np.arange(keep))
    return datasets


def config_as_run(cfg: DictConfig, world_size: int, device: str) -> dict[str, Any]:
    """The resolved config as the ranks will run it, known before any data is read (what
    ``print_config`` shows first): ``world_size`` and ``device`` resolved, the per-rank batch
    of ``data.global_batch_size``. Keys resolved later from the data (``trainer.monitor_mode``,
    ``trainer.test_weights`` left null) are in ``.hydra/`` and metrics.json."""
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    plain["world_size"], plain["device"] = world_size, device
    apply_global_batch(plain, world_size)
    return plain


def _hparams(plain: dict[str, Any]) -> dict[str, Any]:
    """The config flattened, plus the group choices and the derived global batch size."""
    hparams = flatten_hparams(plain)
    if HydraConfig.initialized():
        for group, choice in HydraConfig.get().runtime.choices.items():
            if not group.startswith(("hydra", "schema")) and choice is not None:
                hparams[group] = str(choice)
    hparams["global_batch_size"] = global_batch_size(plain)
    hparams["optim.effective_lr"] = effective_lr(plain)
    return hparams


def prepare(cfg: DictConfig, job_dir: str, world_size: int, device: str, backend: str,
            owner: bool = True) -> RankInputs:
    """Build, once and in this process, what every rank of the world needs; shared by both
    launch paths. In order: the folder may take a fresh run, the data, the seeded model, the
    checkpoint to resume from (it fits the model and has epochs left), the resolved config,
    the objective on two training samples, the monitor, the optimizer and the scheduler (and
    their states from the checkpoint).

    Args:
        cfg: the validated config; ``world_size``, ``device`` (``cpu`` | ``cuda``) and
            ``backend``: as resolved for this world (recorded in the returned config).
        job_dir: absolute path of the job folder.
        owner: this process owns the job folder (the launcher; rank 0 under torchrun; task 0
            of a cluster job): it alone changes the folder (a killed attempt cleared, temp
            files, ``run.json``, ``best.pt`` repaired), starts the trackers and says the
            warnings. Every process judges the folder alike, so all refuse together.

    Raises:
        FolderHoldsRun: an earlier run's outputs in ``job_dir`` and no checkpoint to resume.
        AlreadyComplete: the checkpoint to resume has no epoch left to train.
        ConfigError: any other bad input (data, model, objective, optim, scheduler, a
            checkpoint that does not fit), before any rank starts.
    """
    t_start = time.time()
    trackers = plan_trackers(cfg, job_dir)  # a tracker's missing library: refused first
    if owner:
        preload_trackers(trackers)
    apply_global_batch(cfg, world_size)  # data.global_batch_size: the per-rank batch
    killed_attempt = earlier_run.refuse_earlier_run(job_dir, cfg.trainer.resume, warn=owner)
    datasets = load_data(cfg)
    model_size.check_fits(OmegaConf.to_container(cfg.model, resolve=True),
                          datasets.train.input_shape, datasets.train.num_outputs,
                          world_size // cfg.launcher.nnodes, device)  # before allocating it
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank and every rerun
    model = build_model(OmegaConf.to_container(cfg.model, resolve=True),
                        datasets.train.input_shape, datasets.train.num_outputs)
    source = checkpoint.find_resume(job_dir, cfg.trainer.resume, restarted=False)
    # Check the file and that it fits, before ranks start.
    state = None if source is None else _resumable_state(cfg, source, model, world_size)
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # ranks: plain values
    if state is not None:
        checkpoint.check_same_split(state.get("config"), plain, cfg.trainer.resume,
                                    cfg.trainer.resume_allow_changes)
    plain["world_size"] = world_size
    plain["device"] = device  # resolved: the config records what ran (cpu | cuda)
    objective = Objective(datasets.num_classes, plain.get("loss"), plain.get("metrics"),
                          plain["trainer"].get("output_key", "logits"),
                          plain["trainer"].get("class_dim", "last"),
                          plain["data"].get("ignore_index", -100))
    _check_objective(objective, model, datasets, cfg.seed)
    note = monitor.resolve(plain, objective.metrics, len(datasets.val))
    if note and owner:  # once per world
        log.warning(note)  # a run that trains blind: a user's Dataset holds out none by default
    view = rank_config(plain)  # what every rank will read (typed), checked here first
    check_strategy(view, model, device)  # strategy=fsdp's refusals (ddp_exp.train.strategy)
    check_optimizer(view)  # a bad optim fails here, not in ranks; built only where needed:
    optimizer = None  # building one imports torch._dynamo (~1.3 s), which the ranks do anyway
    if state is not None or (view.targets.scheduler or {}).get("_target_") is not None:
        optimizer = build_optimizer(view, model.parameters())
    scheduler = _build_scheduler(view, optimizer, len(datasets.train))
    if state is not None:  # and a checkpoint of another optimizer (SGD state for AdamW) too
        _load_optimizer_states(cfg.trainer.resume, view, state, optimizer, scheduler,
                               len(datasets.train), model)
        if owner:  # every check passed
            checkpoint.repair_best(source, state)
        _log_world_change(cfg, state, world_size)
    if owner:
        earlier_run.make_way(job_dir, killed_attempt)  # a killed attempt's files, temp files
        record_start(job_dir, plain, backend, datasets.fingerprint(), t_start)  # run.json
        start_trackers(trackers)  # the MLflow run, before the ranks start
    return RankInputs(cfg=plain, job_dir=job_dir, log_file=job_log_file(), device=device,
                      backend=backend,
                      datasets=datasets, model=model, objective=objective,
                      hparams=_hparams(plain), t_start=t_start, trackers=trackers)


def _resumable_state(cfg: DictConfig, source: str, model: torch.nn.Module, world_size: int
                     ) -> dict[str, Any]:
    """Load the checkpoint ``source`` into ``model`` and check that it has epochs left to
    train (a step checkpoint: at this world's global batch). Returns its state.

    Raises:
        ConfigError: unreadable, written mid-epoch (not resumable), its model does not fit
            this one, or a step checkpoint of another global batch.
        AlreadyComplete: it stopped early, or has trained ``trainer.epochs`` already.
    """
    state = checkpoint.load(source)
    train_state.check_resumable(state, cfg.trainer.resume)
    try:
        if state.get("shards"):  # a sharded checkpoint: read whole in this process
            sharded.load_model(state["shards"], model, no_dist=True)
        else:
            model.load_state_dict(state["model"])
    except (RuntimeError, KeyError, ValueError) as exc:
        raise ConfigError(f"trainer.resume={cfg.trainer.resume!r}: the checkpoint's model "
                          "does not fit this model ("
                          f"{checkpoint.model_mismatch(exc, state, cfg.model)})") from None
    owed = _end_owed(source, state)
    if (state.get("monitor") or {}).get("stopped_early") and not owed:
        raise AlreadyComplete(f"trainer.resume={cfg.trainer.resume!r}: {source} stopped "
                              "early (trainer.early_stopping_patience): nothing left to "
                              "train; the job folder is unchanged")
    if state["epoch"] + 1 >= cfg.trainer.epochs and not owed:
        raise AlreadyComplete(f"trainer.resume={cfg.trainer.resume!r}: {source} has "
                              f"finished {state['epoch'] + 1} epoch(s), trainer.epochs="
                              f"{cfg.trainer.epochs}: nothing left to train (raise "
                              "trainer.epochs to continue); the job folder is unchanged")
    max_steps = cfg.trainer.max_steps
    if max_steps is not None and state["global_step"] >= max_steps:
        raise AlreadyComplete(f"trainer.resume={cfg.trainer.resume!r}: {source} has taken "
                              f"{state['global_step']} optimizer step(s), trainer.max_steps="
                              f"{max_steps}: nothing left to train (raise trainer.max_steps to "
                              "continue); the job folder is unchanged")
    # A step checkpoint continues only at its global batch: refused here, before any line
    # says the run resumes.
    train_state.steps_into_epoch(global_batch_size(_world_view(cfg, world_size)), world_size,
                                 state, cfg.trainer.resume, source)
    if owed and (state["epoch"] + 1 >= cfg.trainer.epochs
                 or (state.get("monitor") or {}).get("stopped_early")):
        log.info("trainer.resume=%s: %s has trained every epoch, but the run was stopped before "
                 "its end: finishing it (final evaluation, metrics.json, model.pt, status.json)",
                 cfg.trainer.resume, source)
    return state


def _world_view(cfg: DictConfig, world_size: int) -> dict[str, Any]:
    """What :func:`ddp_exp.config.checks.global_batch_size` reads, for this world."""
    return {"data": cfg.data, "trainer": cfg.trainer, "world_size": world_size}


def _log_world_change(cfg: DictConfig, state: dict[str, Any], world_size: int) -> None:
    """One line when the checkpoint was written by a world of another size: exact with the
    same global batch, else what would continue it exactly (advice that is accepted:
    :func:`ddp_exp.train.state.exact_batch_advice`). Logged once every check has passed. A
    world of the same size with another global batch (``data.batch_size`` changed on resume)
    gets the warning too: it was accepted without a word (a fresh user's find)."""
    saved = state.get("global_batch_size") or (
        global_batch_size(state["config"]) if state.get("config") else None)
    now = global_batch_size(_world_view(cfg, world_size))
    if state.get("world_size") in (None, world_size):
        if saved is not None and saved != now:
            log.warning("resuming at a global batch of %d, the interrupted run's was %d: the "
                        "data order and the schedule differ from it (keep %s for an exact "
                        "continuation)", now, saved,
                        train_state.exact_batch_advice(saved, world_size))
        return
    if saved == now:  # exact (issue 30)
        log.info("resuming a world of %s rank(s) with %d, the same global batch of %d: the "
                 "data order, schedule and weights continue as if never stopped (dropout "
                 "draws per rank, unsynchronised BatchNorm per rank: those differ)",
                 state["world_size"], world_size, saved)
        return
    advice = train_state.exact_batch_advice(saved, world_size)
    if advice.startswith("data."):
        advice = f"keep {advice} for an exact continuation"
    log.warning("resuming a world of %s rank(s) with %d: the data order and the global batch "
                "differ from the interrupted run (%s)", state["world_size"], world_size, advice)


def _end_owed(source: str, state: dict[str, Any]) -> bool:
    """Whether the run that wrote ``source`` (a ``checkpoints/last.pt``) still owes its end:
    the checkpoint's job folder has no ``status.json`` saying ``completed`` (a kill between the
    final checkpoint and ``metrics.json`` / ``status.json``). Only ``last.pt`` is a run's
    state: a ``best.pt`` or an epoch file given as ``trainer.resume`` owes nothing."""
    del state
    if os.path.basename(source) != checkpoint.LAST:
        return False
    job_dir = os.path.dirname(os.path.dirname(os.path.abspath(source)))
    return earlier_run.run_status(job_dir) != "completed"


def _check_objective(objective: Objective, model: torch.nn.Module, datasets: Datasets,
                     seed: int) -> None:
    """Run the objective on the model's output for the first two training samples, taking
    those that loading read already from ``datasets.items_read`` (a user's Dataset reads each
    item once here), then empty ``items_read``: the ranks read every item themselves.

    Raises:
        ConfigError: reading those samples failed, or the loss / a metric does not fit the
            model's output (:meth:`ddp_exp.train.objective.Objective.check`).
    """
    try:
        with seeded(seed):  # an augmented probe draws nothing from this process's RNG
            probe_x, probe_y = datasets.train.batch(range(min(2, len(datasets.train))),
                                                    datasets.items_read)
    except ConfigError:
        raise
    except Exception as exc:  # an unreadable file, an item of another shape, a transform's bug
        raise ConfigError(f"data: reading the first training samples failed: "
                          f"{described(exc)}") from None
    finally:
        datasets.items_read.clear()
    objective.check(model, *bounded_probe(model, probe_x, probe_y))


PROBE_TOKENS = 64  # a sequence model's check forward: this many positions of each window


def bounded_probe(model: torch.nn.Module, x: Any, y: Any) -> tuple[Any, Any]:
    """The check's probe cut to a bounded cost: a sequence model that takes any length up to
    its context (a ``block_size`` attribute, nanoGPT's convention, at least the window's length
    ``T``) gets the first :data:`PROBE_TOKENS` positions of token windows ``x [B, T]`` and
    per-token targets ``y [B, T]``; anything else as it is. The check is of shapes and of the
    objective, which the first positions show; a full window of 100,000 tokens would cost the
    attention's ``T^2`` before the first line (issue 41 item 2). A model whose context is shorter
    than ``T`` gets the whole window, so that its forward refuses it at once."""
    context = getattr(model, "block_size", None)
    if (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() == 2
            and not x.is_floating_point() and y.shape == x.shape
            and isinstance(context, int) and context >= x.shape[1] > PROBE_TOKENS):
        return x[:, :PROBE_TOKENS], y[:, :PROBE_TOKENS]
    return x, y


def _build_scheduler(view: RankConfig, optimizer: torch.optim.Optimizer | None, n_train: int
                     ) -> Any:
    """The learning-rate scheduler over the run's optimizer steps, or None; built here so that
    a bad scheduler fails before the ranks start (``optimizer``: None when the run has no
    scheduler, whose relations to the run are still checked).

    Raises:
        ConfigError: as :func:`ddp_exp.train.schedule.check` /
        :func:`ddp_exp.train.schedule.build_scheduler`.
    """
    t = view.trainer
    per_epoch = schedule.steps_per_epoch(n_train, view.world_size, view.data.batch_size,
                                         t.accumulate_grad_batches)
    run_steps = schedule.total_steps(t.epochs, t.max_steps, per_epoch)
    schedule.check(view, run_steps)
    if optimizer is None:
        return None
    scheduler, _ = schedule.build_scheduler(view.targets.scheduler, optimizer, run_steps,
                                            per_epoch)
    return scheduler


def _load_optimizer_states(resume: str, view: RankConfig, state: dict[str, Any],
                           optimizer: torch.optim.Optimizer, scheduler: Any, n_train: int,
                           model: torch.nn.Module) -> None:
    """Check, before any rank starts, that the checkpoint's optimizer state fits this run's
    optimizer and that this run's schedule can be entered where the checkpoint left off
    (:func:`ddp_exp.train.state.resume_optimizer`, which every rank runs again). When the
    run's length or steps per epoch changed (``trainer.epochs``, ``world_size``,
    ``data.batch_size``, ``trainer.accumulate_grad_batches``, ``trainer.max_steps``) and a
    ``scheduler`` is set, one line says so and where its schedule continues.

    Args:
        scheduler: built by :func:`_build_scheduler` for a fresh run (None: no schedule).
        n_train: training samples (the run's steps per epoch follow from it).
        model: the model ``optimizer`` is over (a sharded checkpoint's optimizer state is
            stored by parameter name).

    Raises:
        ConfigError: written by another optimizer (SGD state for AdamW), or a schedule that
            does not fit this run.
    """
    t = view.trainer
    per_epoch = schedule.steps_per_epoch(n_train, view.world_size, view.data.batch_size,
                                         t.accumulate_grad_batches)
    load = (train_state.sharded_optimizer_loader(state["shards"], model, no_dist=True)
            if state.get("shards") else None)
    _, interval, run_steps = train_state.resume_optimizer(view, state, optimizer, per_epoch,
                                                          resume, load)
    was = (state.get("steps_per_epoch"), state.get("run_steps"))
    if scheduler is not None and None not in was and was != (per_epoch, run_steps):
        start, _ = schedule.resume_steps(state["epoch"] + 1, state["global_step"], t.epochs,
                                         t.max_steps, per_epoch)
        where = (f"step {start} of {run_steps}" if interval == "step" else
                 f"epoch {state['epoch'] + 1} of {t.epochs}")
        log.info("trainer.resume: this run has %d optimizer steps, %d per epoch (the "
                 "checkpoint's run: %d, %d per epoch): the schedule is this run's, continued "
                 "at %s, as in an uninterrupted run with these settings", run_steps, per_epoch,
                 was[1], was[0], where)
