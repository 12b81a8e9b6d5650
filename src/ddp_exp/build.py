"""The build-once step: from a validated config to what every rank needs (:class:`RankInputs`).

:func:`prepare`, used by both launch paths (the elastic launch and the torchrun join of
:mod:`ddp_exp.launch`), builds in this process, before any rank starts: the data split, the
seeded model (identical initial weights on every rank), the objective checked on two training
samples, the optimizer and the scheduler, and, when resuming, checks that the checkpoint fits
them. Bad input therefore fails here, once, with one line naming the key, not in ``world_size``
ranks.

May use: :mod:`ddp_exp.config`, :mod:`ddp_exp.data`, :mod:`ddp_exp.loaders`,
:mod:`ddp_exp.models`, :mod:`ddp_exp.objective`, :mod:`ddp_exp.train` (the optimizer),
:mod:`ddp_exp.schedule`, :mod:`ddp_exp.monitor`, :mod:`ddp_exp.checkpoint`,
:mod:`ddp_exp.metrics` (hyper-parameters), :mod:`ddp_exp.jobdir` (refusals, the job log),
:mod:`ddp_exp.worker` (:class:`RankInputs`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from ddp_exp import checkpoint, monitor, schedule
from ddp_exp import data as data_module
from ddp_exp.config import ConfigError, effective_lr, global_batch_size
from ddp_exp.data import Datasets
from ddp_exp.jobdir import AlreadyComplete, FolderHoldsRun, earlier_outputs, job_log_file
from ddp_exp.loaders import seeded
from ddp_exp.metrics import flatten_hparams
from ddp_exp.models import build_model
from ddp_exp.objective import Objective
from ddp_exp.train import build_optimizer
from ddp_exp.worker import RankInputs

log = logging.getLogger("ddp_exp")


def load_data(cfg: DictConfig) -> Datasets:
    """Build ``cfg.data``'s training, validation and test split (:func:`ddp_exp.data.load`): arrays
    read once, or lazy datasets of which one item is read.

    Raises:
        ConfigError: unreadable data, or ``data.val_size`` / ``data.test_size`` too large.
    """
    return data_module.load(OmegaConf.to_container(cfg.data, resolve=True), cfg.seed,
                            cfg.world_size)


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


def prepare(cfg: DictConfig, job_dir: str, world_size: int, device: str, backend: str
            ) -> RankInputs:
    """Validate-and-build step shared by both launch paths; raises ConfigError on bad input."""
    t_start = time.time()
    resume = cfg.trainer.resume
    no_checkpoint = resume == "auto" and not os.path.isfile(
        os.path.join(checkpoint.checkpoint_dir(job_dir), checkpoint.LAST))
    earlier = earlier_outputs(job_dir) if resume is None or no_checkpoint else []
    if earlier:  # training afresh here would mix two runs' event streams and files
        how = ("trainer.resume=auto finds no checkpoints/last.pt to continue from"
               if no_checkpoint else "continue it with trainer.resume=auto")
        raise FolderHoldsRun(f"hydra.run.dir={job_dir!r} already holds a run "
                             f"({', '.join(earlier)}): {how}; or give this run its own folder")
    datasets = load_data(cfg)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank and every rerun
    model = build_model(OmegaConf.to_container(cfg.model, resolve=True),
                        datasets.train.input_shape, datasets.train.num_outputs)
    source = checkpoint.find_resume(job_dir, cfg.trainer.resume, restarted=False)
    if source is not None:  # check the file and that it fits, before ranks start
        state = checkpoint.load(source)
        try:
            model.load_state_dict(state["model"])
        except (RuntimeError, KeyError) as exc:
            raise ConfigError(f"trainer.resume={cfg.trainer.resume!r}: the checkpoint's model "
                              "does not fit this model ("
                              f"{checkpoint.model_mismatch(exc, state, cfg.model)})") from None
        if (state.get("monitor") or {}).get("stopped_early"):
            raise AlreadyComplete(f"trainer.resume={cfg.trainer.resume!r}: {source} stopped "
                                  "early (trainer.early_stopping_patience): nothing left to "
                                  "train; the job folder is unchanged")
        if state["epoch"] + 1 >= cfg.trainer.epochs:
            raise AlreadyComplete(f"trainer.resume={cfg.trainer.resume!r}: {source} has "
                                  f"finished {state['epoch'] + 1} epoch(s), trainer.epochs="
                                  f"{cfg.trainer.epochs}: nothing left to train (raise "
                                  "trainer.epochs to continue); the job folder is unchanged")
        if state.get("world_size") not in (None, world_size):
            log.warning("resuming a world of %s rank(s) with %d: the data order and the global "
                        "batch differ from the interrupted run", state["world_size"], world_size)
    plain = OmegaConf.to_container(cfg, resolve=True)
    if source is not None:
        checkpoint.check_same_split(state.get("config"), plain, cfg.trainer.resume,
                                    cfg.trainer.resume_allow_changes)
    plain["world_size"] = world_size
    plain["device"] = device  # resolved: the config records what ran (cpu | cuda)
    objective = Objective(datasets.num_classes, plain.get("loss"), plain.get("metrics"))
    try:
        with seeded(cfg.seed):  # an augmented probe draws nothing from this process's RNG
            probe_x, probe_y = datasets.train.batch(range(min(2, len(datasets.train))))
    except ConfigError:
        raise
    except Exception as exc:  # an unreadable file, an item of another shape, a transform's bug
        first = (str(exc).splitlines() or [""])[0][:300]
        raise ConfigError(f"data: reading the first training samples failed: "
                          f"{type(exc).__name__}: {first}") from None
    objective.check(model, probe_x, probe_y)
    note = monitor.resolve(plain, objective.metrics, len(datasets.val))
    if note:
        log.info(note)
    optimizer = build_optimizer(plain, model.parameters())  # a bad optim fails here, not in ranks
    t = plain["trainer"]
    per_epoch = schedule.steps_per_epoch(len(datasets.train), world_size,
                                         plain["data"]["batch_size"],
                                         t["accumulate_grad_batches"])
    run_steps = schedule.total_steps(t["epochs"], t["max_steps"], per_epoch)
    schedule.check(plain, run_steps)
    scheduler, _ = schedule.build_scheduler(plain.get("scheduler"), optimizer, run_steps,
                                            per_epoch)  # a bad scheduler fails here too
    if source is not None:  # and a checkpoint of another optimizer (SGD state for AdamW) too
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise ConfigError(f"trainer.resume={cfg.trainer.resume!r}: the checkpoint's "
                              f"optimizer state does not fit optim ({plain['optim']['_target_']}"
                              f"; {type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
                              ) from None
        if state.get("scheduler") and scheduler is not None:
            try:
                scheduler.load_state_dict(state["scheduler"])
            except (RuntimeError, ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"trainer.resume={cfg.trainer.resume!r}: the checkpoint's "
                                  f"scheduler state does not fit scheduler ("
                                  f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
                                  ) from None
    return RankInputs(cfg=plain, job_dir=job_dir, log_file=job_log_file(), device=device,
                      backend=backend,
                      datasets=datasets, model=model, objective=objective,
                      hparams=_hparams(plain), t_start=t_start)
