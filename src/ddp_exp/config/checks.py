"""Checks and derived values of a composed config, run once before any rank starts:
:func:`validate` checks ranges and relations of the composed config (types were checked by
OmegaConf at composition); :func:`effective_lr`, :func:`global_batch_size` and
:func:`ranks_per_node` are the values derived from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ddp_exp.config import ranges, schema
from ddp_exp.config.compose import group_options, task_overrides
from ddp_exp.config.errors import ConfigError, _check
from ddp_exp.config.user_dir import replaced_hint

OPTIM_OWN_KEYS = ("lr_scaling", "reference_batch_size")  # not arguments of the optimizer


def effective_lr(cfg: Mapping[str, Any]) -> float:
    """The learning rate the optimizer gets: ``optim.lr`` scaled by ``k = global batch /
    optim.reference_batch_size``: times k (``linear``, Goyal et al. 2017, "Accurate, Large
    Minibatch SGD"), times sqrt(k) (``sqrt``, Krizhevsky 2014 / Hoffer et al. 2017), or not."""
    optim = cfg["optim"]
    rule = optim.get("lr_scaling", "none")
    if rule == "none":
        return float(optim["lr"])
    k = global_batch_size(cfg) / optim["reference_batch_size"]
    return float(optim["lr"]) * (k if rule == "linear" else k ** 0.5)


def global_batch_size(cfg: Mapping[str, Any]) -> int:
    """Samples per optimizer step over the world:
    ``data.batch_size x world_size x trainer.accumulate_grad_batches``."""
    return (cfg["data"]["batch_size"] * cfg["world_size"]
            * cfg["trainer"]["accumulate_grad_batches"])


def batch_layout(global_batch: int, world_size: int, max_per_rank: int | None
                 ) -> tuple[int, int]:
    """``data.global_batch_size`` on ``world_size`` ranks: ``(per-rank micro-batch,
    accumulated micro-batches)``, the micro-batch the largest divisor of ``global_batch /
    world_size`` within ``max_per_rank`` (None: no cap), so that their product times the world
    is the global batch exactly. ``global_batch`` must be a multiple of ``world_size``
    (:func:`validate` refuses it otherwise)."""
    share = global_batch // world_size
    if max_per_rank is None or share <= max_per_rank:
        return share, 1
    accumulate = -(-share // max_per_rank)
    while share % accumulate:
        accumulate += 1
    return share // accumulate, accumulate


def apply_global_batch(cfg: Any, world_size: int) -> None:
    """With ``data.global_batch_size`` set, write the per-rank ``data.batch_size`` and
    ``trainer.accumulate_grad_batches`` that give it on ``world_size`` ranks
    (:func:`batch_layout`) into ``cfg`` (a DictConfig or plain dicts); without it, nothing.
    Called where the world's size is known: before any rank starts, and by a rank that finds
    itself in a world of another size (an elastic restart)."""
    data = cfg["data"]
    if data.get("global_batch_size") is None:
        return
    per_rank, accumulate = batch_layout(data["global_batch_size"], world_size,
                                        data.get("max_batch_size_per_rank"))
    data["batch_size"] = per_rank
    cfg["trainer"]["accumulate_grad_batches"] = accumulate


# ------------------------------------------------------------------------------ validation
OPEN_SECTIONS = {"data": ranges.data, "model": ranges.model, "optim": ranges.optim}


def validate(cfg: DictConfig) -> None:
    """Check a composed config (types and names were checked by OmegaConf when Hydra composed
    it): every key is present and known; ``OmegaConf.to_object`` builds the typed config, each
    section's ``__post_init__`` checking its ranges (:mod:`ddp_exp.config.ranges`, also run here
    on a section no dataclass holds); then the relations between keys, all checked here.

    Raises:
        ConfigError: one line naming the first offending key and what would be valid.
    """
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        key = missing[0]
        if key == "data.path":
            hint = ("a folder <class>/<image> of images" if "image" in str(cfg.data._target_)
                    else "a .pt, .npz or .csv file of features and targets")
        elif key == "data._target_":
            hint = "a function or class returning a map-style Dataset"
        else:  # a group deleted with ~data: its options, as for a group given null
            options = group_options(key)
            hint = f"one of {', '.join(options)}" if options else "a value"
        raise ConfigError(f"{key} is required but was not set: add {key}=... ({hint})")

    known = {f.name for f in dataclasses.fields(schema.Config)}
    for key in cfg:
        _check(key in known, str(key), cfg[key], f"not a ddp_exp key (top-level keys: "
               f"{', '.join(sorted(known))})")
    for f in dataclasses.fields(schema.Config):  # typed nodes: a +key=... typo is no new key
        node_schema = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(node_schema) and f.name in cfg:
            keys = [k.name for k in dataclasses.fields(node_schema)]
            for key in cfg[f.name]:
                _check(key in keys, f"{f.name}.{key}", cfg[f.name][key],
                       f"not a key of {f.name} (its keys: {', '.join(keys)})")
    for key in ("_target_", "batch_size", "val_size", "shuffle", "num_workers"):
        _check(key in cfg.data, f"data.{key}", None,
               "every data config needs it (extend schema/data/base)")
    _check("_target_" in cfg.model, "model._target_", None, "a model class, e.g. model=mlp"
           + replaced_hint("model", _choice("model")))
    _check("lr" in cfg.optim, "optim.lr", None, "a non-negative learning rate")

    typed = OmegaConf.to_object(cfg)  # every section's __post_init__: its ranges
    for name, check in OPEN_SECTIONS.items():  # a user's YAML, a target's own +keys
        section = getattr(typed, name)
        check(section if isinstance(section, dict) else vars(section))
    _check_relations(cfg)


def _check_relations(cfg: DictConfig) -> None:
    """The relations between keys (their ranges were checked): the global batch and the world,
    the data loader's workers, the learning-rate scaling, the monitor, the scheduler's keys
    and the world's layout on the nodes."""
    d = cfg.data
    _check_global_batch(cfg, _typed_overrides())
    if d.get("prefetch_factor") is not None:
        _check(d.num_workers > 0, "data.prefetch_factor", d.prefetch_factor,
               "null with data.num_workers=0 (no workers load ahead; torch refuses it too)")
    if cfg.optim.get("lr_scaling", "none") != "none":
        ref = cfg.optim.get("reference_batch_size")
        _check(isinstance(ref, int) and ref >= 1, "optim.reference_batch_size", ref,
               "a positive global batch size")
    t = cfg.trainer
    _check(t.early_stopping_patience is None or t.monitor is not None,
           "trainer.early_stopping_patience", t.early_stopping_patience,
           "needs trainer.monitor (early stopping watches the monitored metric)")
    _check(t.test_weights != "best" or t.monitor is not None, "trainer.test_weights",
           str(t.test_weights), "best needs trainer.monitor (which epoch is best); or last")
    _check_scheduler(cfg.get("scheduler") or {})

    la = cfg.launcher
    _check(cfg.world_size % la.nnodes == 0, "world_size", cfg.world_size,
           f"a multiple of launcher.nnodes={la.nnodes} (the same number of ranks on every node)")
    port = int(la.rdzv_endpoint.rpartition(":")[2])
    # As composed, a cluster preset leaves node_rank to each task of the job
    # (ddp_exp.launch.cluster).
    filled_per_task = la.cluster is not None and la.node_rank is None
    if la.rdzv_backend == "static" and not filled_per_task:
        _check(la.node_rank is not None and 0 <= la.node_rank < la.nnodes, "launcher.node_rank",
               la.node_rank, f"this node's index, 0..{la.nnodes - 1}, with rdzv_backend=static")
        _check(port > 0, "launcher.rdzv_endpoint", la.rdzv_endpoint,
               "HOST:PORT of node 0 with a fixed port every node can reach, with "
               "rdzv_backend=static")
    elif la.rdzv_backend == "c10d":
        _check(la.node_rank is None, "launcher.node_rank", la.node_rank,
               "null with rdzv_backend=c10d (it numbers the nodes itself); add "
               "launcher.rdzv_backend=static to fix each node's rank")
    if la.nnodes > 1 and la.rdzv_backend == "c10d":
        _check(bool(la.rdzv_id), "launcher.rdzv_id", la.rdzv_id,
               "a job id shared by every node, required when launcher.nnodes > 1")
        _check(port > 0, "launcher.rdzv_endpoint", la.rdzv_endpoint,
               "HOST:PORT of the rendezvous with a fixed port every node can reach, when "
               "launcher.nnodes > 1")


def _check_scheduler(s: Mapping[str, Any]) -> None:
    """The scheduler's keys fit the chosen scheduler (:func:`_check_scheduler_keys`); with a
    ``_target_``, ``interval`` is one of :data:`ddp_exp.config.schema.SCHEDULER_INTERVALS` and
    the keys of a user's target that share a built-in schedule's name are in its range."""
    _check_scheduler_keys(s)
    if s.get("_target_") is None:
        return
    _check(s.get("interval") in schema.SCHEDULER_INTERVALS, "scheduler.interval", s.get("interval"),
           f"one of {', '.join(schema.SCHEDULER_INTERVALS)}")
    ranges.scheduler(s)


def _check_scheduler_keys(s: Mapping[str, Any]) -> None:
    """Refuse a ``scheduler.*`` key that the chosen scheduler does not use, rather than ignore
    it: with ``scheduler=none`` (no ``_target_``: a constant learning rate, nothing is stepped)
    any key that differs from the schema's default (``scheduler.interval=batch``,
    ``+scheduler.warmup_steps=5``), with ``cosine`` or ``step`` a key outside its schema
    (:data:`ddp_exp.config.schema.SCHEMAS`). A user's own ``_target_`` receives the keys as its
    arguments and rejects unknown ones when built.

    Raises:
        ConfigError: naming the first such key.
    """
    target = s.get("_target_")
    ours = [(name, {f.name: f.default for f in dataclasses.fields(node)})
            for group, name, node in schema.SCHEMAS if group == "scheduler"]
    found = [(name, defaults) for name, defaults in ours if defaults["_target_"] == target]
    if not found:
        return
    name, defaults = found[0]
    for key in s:
        if target is None:
            unused = key != "_target_" and (key not in defaults or s.get(key) != defaults[key])
            _check(not unused, f"scheduler.{key}", s.get(key), "scheduler=none (a constant "
                   "learning rate) uses no scheduler key; choose a schedule: scheduler=cosine|step")
        else:
            keys = ", ".join(k for k in defaults if k != "_target_")
            _check(key in defaults, f"scheduler.{key}", s.get(key),
                   f"not a key of scheduler={name} (its keys: {keys})")


def check_precision(precision: str, device: str) -> None:
    """``16-mixed`` needs CUDA (fp16 autocast with loss scaling); bf16 autocast runs on CPU
    and GPU.

    Args:
        precision: ``trainer.precision``.
        device: the resolved device type, ``cpu`` or ``cuda``.

    Raises:
        ConfigError: 16-mixed on the CPU.
    """
    if precision == "16-mixed" and device != "cuda":
        raise ConfigError("trainer.precision=16-mixed needs device=cuda; use bf16-mixed or "
                          "32-true on the CPU")


def _choice(group: str) -> str | None:
    """The option of config group ``group`` the running Hydra job chose (None outside one)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return OmegaConf.select(HydraConfig.get(), f"runtime.choices.{group}")


def _typed_overrides() -> list[str]:
    """The command line's overrides of the running Hydra job, unresolved (none outside one):
    ``'trainer.epochs=${oops}' trainer.epochs=1`` resolved the replaced first one here and
    failed in the launcher with a half-made job folder."""
    from hydra.core.hydra_config import HydraConfig

    return task_overrides(HydraConfig.get()) if HydraConfig.initialized() else []


def _check_global_batch(cfg: DictConfig, overrides: list[str] = ()) -> None:
    """``data.global_batch_size`` is a multiple of ``world_size``; with a global batch, the
    per-rank batch and the accumulation are derived, so ``trainer.accumulate_grad_batches``
    must be left at 1 and ``data.batch_size`` not be given on the command line
    (``overrides``, as typed), where it would be silently replaced."""
    d, world = cfg.data, cfg.world_size
    total = d.get("global_batch_size")  # its range, and the cap's: ranges.data
    if total is None:
        return
    typed = [o for o in overrides if o.lstrip("+").partition("=")[0] == "data.batch_size"]
    _check(not typed, "data.batch_size", d.batch_size,
           "not given with data.global_batch_size set (the per-rank batch follows from "
           f"data.global_batch_size={total} / world_size={world}); drop one of the two")
    lower, upper = total // world * world, -(-total // world) * world
    _check(total % world == 0, "data.global_batch_size", total,
           f"a multiple of world_size={world} (every rank takes an equal share), e.g. "
           f"{lower or upper}" + (f" or {upper}" if lower and upper != lower else ""))
    _check(cfg.trainer.accumulate_grad_batches == 1, "trainer.accumulate_grad_batches",
           cfg.trainer.accumulate_grad_batches,
           "1 with data.global_batch_size set (the accumulation follows from "
           "data.max_batch_size_per_rank)")
