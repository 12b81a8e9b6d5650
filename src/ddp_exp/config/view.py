"""The typed view of a resolved config that every rank reads: :func:`rank_config` turns the
plain dict the launching process sends (``OmegaConf.to_container(cfg, resolve=True)``) into a
:class:`RankConfig` of the schema's dataclasses, so that rank-side code reads attributes
(``cfg.trainer.max_steps``), with the schema's types (Enum members of
:mod:`ddp_exp.config.choices`, ints, a scheduler dataclass) and ranges (each section's
``__post_init__``, :mod:`ddp_exp.config.ranges`), instead of string keys.

The dict stays the stored and transmitted form: it pickles to every rank under any start
method, a checkpoint stores it and is loaded with ``torch.load(weights_only=True)`` (which
refuses any class, the schema's dataclasses and Enums included), the HParams dashboard
flattens it, and ``instantiate`` takes a ``_target_``'s own arguments from it. The view holds
that dict (:attr:`RankConfig.stored`) and the sections that name a ``_target_`` as
``instantiate`` takes them (:attr:`RankConfig.targets`); it is built once where a rank starts
(:func:`ddp_exp.rank.worker.run_rank`), in about a millisecond per section.

Uses :mod:`ddp_exp.config.schema`, :mod:`ddp_exp.config.choices` and OmegaConf.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, get_type_hints

from omegaconf import OmegaConf

from ddp_exp.config import ranges, schema
from ddp_exp.config.choices import Device
from ddp_exp.config.strategy import StrategyConfig

S = TypeVar("S")


def section(kind: type[S], values: Mapping[str, Any] | None) -> S:
    """One section as the schema's dataclass ``kind``: ``OmegaConf.structured(kind)``, the
    section merged over it (keys that are no field of ``kind`` are left out: a target's own
    arguments), ``OmegaConf.to_object``. Absent keys take the schema's defaults.

    Raises:
        omegaconf.errors.ValidationError: a value of the wrong type (``"x"`` for an int,
            ``gpu`` for an Enum key).
        ddp_exp.config.errors.ConfigError: a value out of range (``__post_init__``).
    """
    names = {f.name for f in dataclasses.fields(kind)}  # type: ignore[arg-type]
    given = {k: v for k, v in (values or {}).items() if k in names}
    if kind not in _STRUCTURED:
        _STRUCTURED[kind] = OmegaConf.structured(kind)
    node = OmegaConf.merge(_STRUCTURED[kind], given)  # a new node: the schema's is unchanged
    return OmegaConf.to_object(node)  # type: ignore[return-value]


_STRUCTURED: dict[type, Any] = {}  # OmegaConf.structured(kind), made once per process


def schema_for(group: str, values: Mapping[str, Any] | None, base: type | None) -> type | None:
    """The schema dataclass of ``group`` (``data``, ``model``, ``optim``, ``scheduler``) whose
    ``_target_`` is the section's: its built-in option (``data=tokens``:
    :class:`ddp_exp.config.schema.TokensDataConfig`); ``base`` for another target (a user's)."""
    target = (values or {}).get("_target_")
    for name, _option, kind in schema.SCHEMAS:
        if name == group and target is not None and getattr(kind, "_target_", None) == target:
            return kind
    return base


@dataclass(frozen=True)
class Targets:
    """The sections that name a ``_target_``, as plain dicts, as ``instantiate`` takes them:
    the target's own arguments beside the keys every one has (which the typed sections of
    :class:`RankConfig` hold); the same objects as :attr:`RankConfig.stored`'s sections
    (``metrics`` an empty dict where the config has none)."""

    data: dict[str, Any]
    model: dict[str, Any]
    optim: dict[str, Any]
    scheduler: dict[str, Any] | None  # None: no scheduler
    loss: Any  # None: cross-entropy / MSE by task; or a _target_ node
    metrics: dict[str, Any]


@dataclass(frozen=True)
class RankConfig:
    """The resolved config, typed: each section the schema's dataclass.

    ``data``, ``optim`` and ``scheduler`` are the schema of their ``_target_``'s built-in
    option (:class:`ddp_exp.config.schema.TokensDataConfig`, ``SGDConfig``,
    ``CosineSchedulerConfig`` ...), or the base every one extends (``DataConfig``,
    ``OptimConfig``, ``SchedulerConfig``) for a user's target: its own keys are in
    :attr:`targets` only. ``model`` is the schema of a built-in model, None for a user's (no
    key but ``_target_`` is common to every model). ``scheduler`` is a ``SchedulerConfig``
    with ``_target_`` None where the run has none.
    """

    trainer: schema.TrainerConfig
    data: schema.DataConfig
    model: Any
    optim: schema.OptimConfig
    scheduler: schema.SchedulerConfig
    distributed: schema.DistributedConfig
    launcher: schema.LauncherConfig
    ddp: schema.DDPConfig
    strategy: StrategyConfig
    world_size: int
    seed: int
    device: Device
    print_config: bool
    targets: Targets
    stored: dict[str, Any]  # the dict it was built from: checkpoints, hparams, instantiate

    @functools.cached_property
    def stored_json(self) -> str | None:
        """:attr:`stored` as JSON text, encoded once (a checkpoint stores this one string in
        place of the dict: ``torch.save`` pickled the dict's ~170 objects at every
        checkpoint, issue 42); None where JSON would not give the dict back equal (keys that
        are not strings, bytes values), and the dict is stored as it is."""
        import json

        try:
            text = json.dumps(self.stored, allow_nan=True)
        except (TypeError, ValueError):
            return None
        return text if json.loads(text) == self.stored else None

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over the world: ``data.batch_size x world_size x
        trainer.accumulate_grad_batches`` (as :func:`ddp_exp.config.checks.global_batch_size`)."""
        return self.data.batch_size * self.world_size * self.trainer.accumulate_grad_batches

    @property
    def effective_lr(self) -> float:
        """The learning rate the optimizer gets: ``optim.lr`` scaled by the global batch
        (:func:`ddp_exp.config.checks.effective_lr`, the one place of the rule)."""
        from ddp_exp.config.checks import effective_lr

        return effective_lr(self.stored)


def rank_config(cfg: Mapping[str, Any]) -> RankConfig:
    """The typed view of the resolved config ``cfg`` (plain dicts, as
    ``OmegaConf.to_container(cfg, resolve=True)`` gives them, with or without
    ``enum_to_str``), section by section (:func:`section`).

    Raises:
        omegaconf.errors.ValidationError: a value of the wrong type for its key.
        ddp_exp.config.errors.ConfigError: a value out of range (a section's
            ``__post_init__``, :mod:`ddp_exp.config.ranges`).
    """
    get = cfg.get
    data, model, optim = get("data") or {}, get("model") or {}, get("optim") or {}
    scheduler = get("scheduler") or None
    top: Any = section(_Top, {k: get(k) for k in TOP_KEYS if k in cfg})
    model_schema = schema_for("model", model, None)
    return RankConfig(
        trainer=section(schema.TrainerConfig, get("trainer")),
        data=section(schema_for("data", data, schema.DataConfig), data),
        model=section(model_schema, model) if model_schema is not None else None,
        optim=section(schema_for("optim", optim, schema.OptimConfig), optim),
        scheduler=section(schema_for("scheduler", scheduler, schema.SchedulerConfig),
                          scheduler),
        distributed=section(schema.DistributedConfig, get("distributed")),
        launcher=section(schema.LauncherConfig, get("launcher")),
        ddp=section(schema.DDPConfig, get("ddp")),
        strategy=section(StrategyConfig, get("strategy")),
        world_size=top.world_size, seed=top.seed, device=top.device,
        print_config=top.print_config,
        targets=Targets(data=data, model=model, optim=optim, scheduler=scheduler,
                        loss=get("loss"), metrics=get("metrics") or {}),
        stored=dict(cfg))


def _check_top(self: Any) -> None:
    ranges.top(vars(self))


TOP_KEYS = ("world_size", "seed", "device", "print_config")  # Config's keys that are no section
_HINTS = get_type_hints(schema.Config)
# Those keys of ddp_exp.config.schema.Config, typed, defaulted and checked as it does them.
_Top = dataclasses.make_dataclass(
    "_Top", [(f.name, _HINTS[f.name], dataclasses.field(default=f.default))
             for f in dataclasses.fields(schema.Config) if f.name in TOP_KEYS],
    namespace={"__post_init__": _check_top})
