"""Checks and derived values of a composed config, run once before any rank starts.

:func:`register_configs` hands Hydra the schema (:mod:`ddp_exp.schema`) and the resolvers the
YAML uses; :func:`validate` checks ranges and relations of the composed config (types were
checked by OmegaConf at composition); :func:`effective_lr`, :func:`global_batch_size` and
:func:`ranks_per_node` are the values derived from it. Errors for users are
:class:`ConfigError`: one line naming the key, the bad value and what is valid;
:func:`instantiate_node` turns a failing ``_target_`` into one; :func:`find_target` looks one
up without a word.

Uses :mod:`ddp_exp.schema`; every module that reports a user's config error uses this one.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import os
import sys
from collections.abc import Mapping
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.errors import InstantiationException
from hydra.experimental.callback import Callback
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from ddp_exp import schema
from hydra_plugins import ddp_optuna_sweeper


class ConfigError(ValueError):
    """A user's configuration cannot run; the message is one line naming the key."""


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (:data:`ddp_exp.schema.SCHEMAS`, group
    ``schema``) and register the resolvers ``ddp_exp.ranks_per_node`` and ``ddp_exp.run_stamp``,
    once per process."""
    cs = ConfigStore.instance()
    cs.store(name="ddp_exp_schema", node=schema.Config)
    ddp_optuna_sweeper.register()  # hydra/sweeper=ddp_optuna, also from an editable install
    for group, name, node in schema.SCHEMAS:
        if (group, name) in schema.OPEN_SCHEMAS:
            node = open_node(node)
        cs.store(group=f"schema/{group}", name=name, node=node)
    OmegaConf.register_new_resolver("ddp_exp.ranks_per_node", ranks_per_node, replace=True)
    OmegaConf.register_new_resolver("ddp_exp.run_stamp", run_stamp, use_cache=True,
                                    replace=True)


def open_node(dataclass: type) -> DictConfig:
    """The schema ``dataclass`` as a node that takes keys of its own: each field keeps its
    type (``batch_size=x`` is refused at composition), and a config that extends it may add
    keys, the arguments of a user's ``_target_`` (a data YAML with ``size: 100``); on the
    command line a new key is ``+data.size=100``, which Hydra's error then suggests."""
    typed = OmegaConf.structured(dataclass)
    node = OmegaConf.create({})
    for key in typed:
        node[key] = typed._get_node(key)
    return node


# Packaged config groups whose options set ``hydra.mode`` (a test holds every packaged option
# to this list), and the config sources a composition may read when ``hydra.mode`` is left
# unset: Hydra's own, ``conf/`` and the ConfigStore (provider, scheme://path).
MODE_GROUPS = ("hparams_search",)
OWN_SOURCES = frozenset({("hydra", "pkg://hydra.conf"), ("main", "pkg://ddp_exp.conf"),
                         ("schema", "structured://")})


def mode_left_unset(overrides: list[str], sources: list[tuple[str, str]]) -> bool:
    """True when composing the config with ``overrides`` cannot set ``hydra.mode``: every
    source is ddp_exp's or Hydra's own (``OWN_SOURCES``: no ``--config-dir``, no search-path
    plugin), and no override sets ``hydra.mode`` or the search path, selects a ``hydra/``
    option or an option of ``MODE_GROUPS``, or selects a group ddp_exp does not ship. Then
    Hydra's run-mode question (``Hydra.get_mode``, a whole composition, ~0.1 s) has the answer
    None: ``-m`` decides. Conservative: False sends the question to Hydra.
    """
    if any(source not in OWN_SOURCES for source in sources):
        return False
    groups = _own_groups()
    known = groups | {f.name for f in dataclasses.fields(schema.Config)}
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~").split("@", 1)[0]
        top = key.split("/", 1)[0].split(".", 1)[0]
        if key.startswith(("hydra.mode", "hydra.searchpath", "hydra/")) or key == "hydra":
            return False
        if top in MODE_GROUPS or ("." not in key and top not in known):
            return False
        if "/" in key and top not in groups:
            return False
    return True


def _own_groups() -> set[str]:
    """The config groups of ``conf/`` (its top-level folders)."""
    import importlib.resources

    root = importlib.resources.files("ddp_exp.conf")
    return {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}


def group_options(group: str) -> list[str]:
    """The options ddp_exp ships in config group ``group`` (``conf/<group>/*.yaml``, sorted);
    empty for a name that is no group of ``conf/``."""
    import importlib.resources

    root = importlib.resources.files("ddp_exp.conf")
    if group.startswith(("_", ".")) or not root.joinpath(group).is_dir():
        return []
    return sorted(p.name[:-5] for p in root.joinpath(group).iterdir()
                  if p.name.endswith(".yaml"))


def null_group_line(exc: BaseException, argv: list[str]) -> str | None:
    """One line for ``group=null`` on the command line (``scheduler=null``; Hydra raises a
    ``ValueError``, "Config group override must be a string or a list"): a config group takes
    one of its options; the line names the one that means "none" (``scheduler=none``), or says
    that a preset group is empty unless chosen, or lists the options. None for any other
    error, or when no argument of ``argv`` sets a group (a key without a dot) to null."""
    if not (isinstance(exc, ValueError) and "Config group override must be" in str(exc)):
        return None
    for arg in argv:
        key, sep, value = arg.partition("=")
        group = key.lstrip("+")
        if not sep or "." in group or value.strip().lower() != "null":
            continue
        options = group_options(group)
        if "none" in options:
            hint = f"{group}=none"
        elif group in PRESET_GROUPS:
            hint = f"leave {group} out: no {group} preset is applied unless one is chosen"
        elif options:
            hint = f"choose one of {', '.join(options)}"
        else:
            hint = f"leave {group} out, or choose one of its options"
        return f"{arg}: a config group takes one of its options, not null; {hint}"
    return None


def primary_config_overrides(argv: list[str]) -> list[str]:
    """Overrides appended to ``argv`` when the command names a primary config of the user's own
    (``--config-name``/``-cn``): a Hydra callback (:class:`PrimaryConfigCheck`) that refuses, before
    Hydra creates the run's folder, a primary config whose defaults list lacks ddp_exp's
    ``config``. Hydra's callbacks come from the primary config, so the check is added here;
    ddp_exp's own ``config`` needs none (empty list)."""
    if not any(arg.split("=", 1)[0] in ("--config-name", "-cn") for arg in argv):
        return []
    return [f"++hydra.callbacks.ddp_exp_primary_config._target_={__name__}.PrimaryConfigCheck"]


class PrimaryConfigCheck(Callback):
    """Hydra callback (:func:`primary_config_overrides`) run before a single run's folder or a
    sweep's is made: a composed config without the top-level keys of ddp_exp's schema (a
    ``bare.yaml`` whose defaults list lacks ``config``) ends the command with one line, exit 2.
    Hydra turns an ``Exception`` raised in a callback into a warning, so this prints the line
    and raises ``SystemExit(2)``."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, kwargs.get("config_name"))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, kwargs.get("config_name"))

    @staticmethod
    def _check(config: DictConfig, name: str | None) -> None:
        lacking = [f.name for f in dataclasses.fields(schema.Config) if f.name not in config]
        if not lacking:
            return
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank composes it
            print(f"error: --config-name {name}: the primary config lacks ddp_exp's keys "
                  f"({', '.join(lacking[:4])}{', ...' if len(lacking) > 4 else ''}): a primary "
                  "config of your own must include ddp_exp's, first in its defaults list "
                  "(defaults: [config, <your options>, _self_]); or leave --config-name out and "
                  "give your options with --config-dir", file=sys.stderr, flush=True)
        raise SystemExit(2)


# Groups whose option is null in conf/config.yaml's defaults list: presets applied on demand.
PRESET_GROUPS = ("experiment", "hparams_search", "debug")


def skip_needless_mode_composition() -> None:
    """Answer ``@hydra.main``'s run-mode question without composing when the answer is known.

    Hydra composes the whole config twice per process: once in ``Hydra.get_mode`` only to
    read ``hydra.mode`` (set by no ddp_exp option but ``hparams_search``), then for the job.
    Where :func:`mode_left_unset` holds, the first composition would return None, so this
    returns None without it (~0.1 s of every start-up, issue 13); otherwise Hydra's own
    ``get_mode`` runs. Installed once per process.
    """
    from hydra._internal.hydra import Hydra

    hydra_get_mode = Hydra.get_mode
    if getattr(hydra_get_mode, "ddp_exp_shortcut", False):
        return

    def get_mode(self: Any, config_name: str | None, overrides: list[str]) -> Any:
        sources = [(s.provider, f"{s.scheme()}://{s.path}")
                   for s in self.config_loader.get_sources()]
        if mode_left_unset(list(overrides), sources):
            return None
        return hydra_get_mode(self, config_name, overrides)

    get_mode.ddp_exp_shortcut = True  # type: ignore[attr-defined]
    Hydra.get_mode = get_mode


def task_overrides(hydra_cfg: Any) -> list[str]:
    """The job's command-line overrides (``hydra.overrides.task``) as the user typed them.

    Read unresolved: an override such as ``data.val_size=${oops}`` is a string here, and
    iterating Hydra's list node would resolve it (an ``InterpolationKeyError`` traceback before the
    config's own check could name the key).
    """
    return [str(o) for o in OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)]


def check_interpolations(cfg: DictConfig) -> None:
    """Resolve every ``${...}`` of the job's config once, before anything reads it.

    Raises:
        ConfigError: an interpolation that names no key or fails in its resolver (a typed
            ``data.val_size=${oops}``), in one line naming the key and OmegaConf's reason.
    """
    from omegaconf.errors import InterpolationResolutionError

    try:
        OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as exc:
        reason = (str(exc).strip().splitlines() or [""])[0]
        key = getattr(exc, "full_key", None) or "the config"
        raise ConfigError(f"{key}: {reason} (an interpolation ${{...}} names a key of the "
                          "config, e.g. ${trainer.epochs}, or a resolver such as ${now:%H})"
                          ) from None


def run_stamp(cluster: str | None) -> str:
    """The single-run folder's name under ``outputs/runs/`` (resolver
    ``${ddp_exp.run_stamp:${launcher.cluster}}`` in ``hydra.run.dir``): ``slurm-<SLURM_JOB_ID>``
    for ``launcher.cluster=slurm`` inside a SLURM job, so that every task of the job derives
    the same folder (and a requeued job finds it again); otherwise ``<date>/<time with
    microseconds>``, as Hydra's ``${now:...}`` (cached: one value per process)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if cluster == "slurm" and job_id:
        return f"slurm-{job_id}"
    return datetime.datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f")


def ranks_per_node(world_size: int, nnodes: int) -> int:
    """``world_size / nnodes`` (resolver ``${ddp_exp.ranks_per_node:${world_size},N}``, used by
    the SLURM presets for GPUs per node).

    Raises:
        ConfigError: ``world_size`` is not a multiple of ``nnodes``.
    """
    if nnodes < 1 or world_size % nnodes:
        raise ConfigError(f"world_size={world_size}: must be a multiple of launcher.nnodes="
                          f"{nnodes} (the same number of ranks on every node)")
    return world_size // nnodes


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


# ------------------------------------------------------------------------------ validation
MAX_MONITOR_INTERVAL_S = 3600.0  # the elastic agent's longest wait between two checks


def _check(ok: bool, key: str, value: Any, valid: str) -> None:
    """Raise ``ConfigError("<key>=<value> is invalid: <valid>")`` unless ``ok``; the value is
    written as on the command line (``null``, not Python's ``None``)."""
    if not ok:
        shown = "null" if value is None else repr(value)
        raise ConfigError(f"{key}={shown} is invalid: {valid}")


def validate(cfg: DictConfig) -> None:
    """Check ranges and relations of a composed config (types were checked by OmegaConf).

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
    _check(cfg.world_size >= 1, "world_size", cfg.world_size, "a positive integer (1, 2, 3, ...)")
    _check(cfg.seed >= 0, "seed", cfg.seed, "a non-negative integer")
    d = cfg.data
    for key in ("_target_", "batch_size", "val_size", "shuffle", "num_workers"):
        _check(key in d, f"data.{key}", None,
               "every data config needs it (extend schema/data/base)")
    for key in ("batch_size", "val_size", "num_workers"):  # untyped user YAML included
        value = d[key]
        if key == "val_size" and value is None:  # data=tokens: about 10% of the stream
            continue
        _check(isinstance(value, int) and not isinstance(value, bool), f"data.{key}", value,
               "an integer")
    _check(d.batch_size >= 1, "data.batch_size", d.batch_size, "a positive integer (per rank)")
    _check(d.val_size is None or d.val_size >= 0, "data.val_size", d.val_size,
           "0 (no validation) or a positive count")
    _check(d.num_workers >= 0, "data.num_workers", d.num_workers, "0 or a positive integer")
    test_size = d.get("test_size", 0)
    _check(isinstance(test_size, int) and not isinstance(test_size, bool) and test_size >= 0,
           "data.test_size", test_size, "0 (no test split) or a positive count")
    if "task" in d:
        _check(d.task in schema.TASKS, "data.task", d.task, f"one of {', '.join(schema.TASKS)}")
    if "num_samples" in d:
        _check(d.num_samples >= 2, "data.num_samples", d.num_samples, "an integer >= 2")
    if "num_features" in d:
        _check(d.num_features >= 1, "data.num_features", d.num_features, "a positive integer")
    if d.get("num_classes") is not None:
        _check(d.num_classes != 1 and d.num_classes >= 0, "data.num_classes", d.num_classes,
               "0 (regression) or an integer >= 2")
    if d.get("prefetch_factor") is not None:
        _check(d.prefetch_factor >= 1, "data.prefetch_factor", d.prefetch_factor,
               "null (torch's default, 2) or a positive number of batches per worker")
        _check(d.num_workers > 0, "data.prefetch_factor", d.prefetch_factor,
               "null with data.num_workers=0 (no workers load ahead; torch refuses it too)")
    if "pin_memory" in d:
        _check(d.pin_memory in ("auto", True, False), "data.pin_memory", d.pin_memory,
               "auto (on CUDA only), true or false")
    if "channels" in d:
        _check(d.channels in (1, 3), "data.channels", d.channels, "1 (grey) or 3 (RGB)")
    if d.get("image_size") is not None:
        _check(d.image_size >= 1, "data.image_size", d.image_size,
               "null (the files' size) or a positive side in pixels")

    _check("_target_" in cfg.model, "model._target_", None, "a model class, e.g. model=mlp")
    if "hidden_sizes" in cfg.model:
        sizes = list(cfg.model.hidden_sizes)
        _check(all(s >= 1 for s in sizes), "model.hidden_sizes", sizes, "positive layer widths")
    _check("lr" in cfg.optim and cfg.optim.lr >= 0, "optim.lr", cfg.optim.get("lr"),
           "a non-negative learning rate")
    scaling = cfg.optim.get("lr_scaling", "none")
    _check(scaling in schema.LR_SCALINGS, "optim.lr_scaling", scaling,
           f"one of {', '.join(schema.LR_SCALINGS)}")
    if scaling != "none":
        ref = cfg.optim.get("reference_batch_size")
        _check(isinstance(ref, int) and ref >= 1, "optim.reference_batch_size", ref,
               "a positive global batch size")

    t = cfg.trainer
    _check(t.epochs >= 1, "trainer.epochs", t.epochs, "a positive integer")
    for key in ("limit_val_batches", "peak_flops"):  # null: all batches / no perf/mfu
        _check(t.get(key) is None or t[key] > 0, f"trainer.{key}", t.get(key),
               "null or a positive number")
    _check(t.get("sample_every_n_epochs", 0) >= 0, "trainer.sample_every_n_epochs",
           t.get("sample_every_n_epochs"), "0 (never) or a positive number of epochs")
    _check(t.max_steps is None or t.max_steps >= 1, "trainer.max_steps", t.max_steps,
           "null (no cap) or a positive integer")
    _check(t.log_every_n_steps >= 1, "trainer.log_every_n_steps", t.log_every_n_steps,
           "a positive integer")
    _check(t.accumulate_grad_batches >= 1, "trainer.accumulate_grad_batches",
           t.accumulate_grad_batches, "a positive integer")
    _check(t.checkpoint_every_n_epochs >= 0, "trainer.checkpoint_every_n_epochs",
           t.checkpoint_every_n_epochs, "0 (never) or a positive number of epochs")
    _check(t.log_histograms_every_n_epochs >= 0, "trainer.log_histograms_every_n_epochs",
           t.log_histograms_every_n_epochs, "0 (never) or a positive number of epochs")
    _check(t.keep_checkpoints >= 1, "trainer.keep_checkpoints", t.keep_checkpoints,
           "a positive integer")
    _check(t.progress in schema.PROGRESS_MODES, "trainer.progress", t.progress,
           f"one of {', '.join(schema.PROGRESS_MODES)}")
    _check(t.precision in schema.PRECISIONS, "trainer.precision", t.precision,
           f"one of {', '.join(schema.PRECISIONS)}")
    _validate_recipe(cfg)

    _check(cfg.device in schema.DEVICES, "device", cfg.device,
           f"one of {', '.join(schema.DEVICES)}")
    dist = cfg.distributed
    _check(dist.backend in schema.BACKENDS, "backend", dist.backend,
           f"one of {', '.join(schema.BACKENDS)}")
    _check(dist.timeout_s > 0, "distributed.timeout_s", dist.timeout_s,
           "a positive number of seconds")

    la = cfg.launcher
    _check(la.nnodes >= 1, "launcher.nnodes", la.nnodes, "a positive integer")
    _check(cfg.world_size % la.nnodes == 0, "world_size", cfg.world_size,
           f"a multiple of launcher.nnodes={la.nnodes} (the same number of ranks on every node)")
    host, _, port = la.rdzv_endpoint.rpartition(":")
    _check(bool(host) and port.isdigit() and int(port) < 65536, "launcher.rdzv_endpoint",
           la.rdzv_endpoint, "HOST:PORT, e.g. 127.0.0.1:0 (port 0: a free port, one node only)")
    _check(la.rdzv_backend in schema.RDZV_BACKENDS, "launcher.rdzv_backend", la.rdzv_backend,
           "c10d (elastic: nodes join by launcher.rdzv_id) or static (fixed launcher.node_rank)")
    _check(la.cluster is None or la.cluster in schema.CLUSTERS, "launcher.cluster", la.cluster,
           f"null (nodes from the config) or one of {', '.join(schema.CLUSTERS)}")
    # As composed, a cluster preset leaves node_rank to each task of the job (ddp_exp.cluster).
    filled_per_task = la.cluster is not None and la.node_rank is None
    if la.rdzv_backend == "static" and not filled_per_task:
        _check(la.node_rank is not None and 0 <= la.node_rank < la.nnodes, "launcher.node_rank",
               la.node_rank, f"this node's index, 0..{la.nnodes - 1}, with rdzv_backend=static")
        _check(int(port) > 0, "launcher.rdzv_endpoint", la.rdzv_endpoint,
               "HOST:PORT of node 0 with a fixed port every node can reach, with "
               "rdzv_backend=static")
    elif la.rdzv_backend == "c10d":
        _check(la.node_rank is None, "launcher.node_rank", la.node_rank,
               "null with rdzv_backend=c10d (it numbers the nodes itself); add "
               "launcher.rdzv_backend=static to fix each node's rank")
    if la.nnodes > 1 and la.rdzv_backend == "c10d":
        _check(bool(la.rdzv_id), "launcher.rdzv_id", la.rdzv_id,
               "a job id shared by every node, required when launcher.nnodes > 1")
        _check(int(port) > 0, "launcher.rdzv_endpoint", la.rdzv_endpoint,
               "HOST:PORT of the rendezvous with a fixed port every node can reach, when "
               "launcher.nnodes > 1")
    _check(la.max_restarts >= 0, "launcher.max_restarts", la.max_restarts, "0 or more")
    _check(la.start_method in schema.START_METHODS, "launcher.start_method", la.start_method,
           f"one of {', '.join(schema.START_METHODS)}")
    _check(0 < la.monitor_interval_s <= MAX_MONITOR_INTERVAL_S, "launcher.monitor_interval_s",
           la.monitor_interval_s, f"seconds, > 0 and <= {MAX_MONITOR_INTERVAL_S:g}")
    _check(la.rdzv_timeout_s > 0, "launcher.rdzv_timeout_s", la.rdzv_timeout_s,
           "a positive number of seconds")
    _check(cfg.ddp.bucket_cap_mb > 0, "ddp.bucket_cap_mb", cfg.ddp.bucket_cap_mb, "> 0 MiB")


def _validate_recipe(cfg: DictConfig) -> None:
    """The recipe keys (issue 15) that need no data: clipping, monitor, patience, test weights,
    the scheduler's own ranges. What needs the data's size or metrics is checked by the
    build step (``ddp_exp.build.prepare``)."""
    t = cfg.trainer
    clip = t.gradient_clip_val
    _check(clip is None or clip > 0, "trainer.gradient_clip_val", clip,
           "null (off) or a positive max L2 norm of the gradients")
    _check(t.monitor is None or str(t.monitor).startswith("val/"), "trainer.monitor", t.monitor,
           "null or a validation metric: val/loss, val/accuracy, val/<metric>")
    _check(t.monitor_mode is None or t.monitor_mode in schema.MONITOR_MODES, "trainer.monitor_mode",
           t.monitor_mode, "null (from the metric) or one of min, max")
    patience = t.early_stopping_patience
    _check(patience is None or patience >= 1, "trainer.early_stopping_patience", patience,
           "null (off) or a positive number of epochs")
    _check(patience is None or t.monitor is not None, "trainer.early_stopping_patience",
           patience, "needs trainer.monitor (early stopping watches the monitored metric)")
    _check(t.test_weights is None or t.test_weights in schema.TEST_WEIGHTS, "trainer.test_weights",
           t.test_weights, "null (best when a monitor exists), best or last")
    _check(t.test_weights != "best" or t.monitor is not None, "trainer.test_weights",
           t.test_weights, "best needs trainer.monitor (which epoch is best); or last")
    s = cfg.get("scheduler") or {}
    _check_scheduler_keys(s)
    if s.get("_target_") is None:
        return
    _check(s.get("interval") in schema.SCHEDULER_INTERVALS, "scheduler.interval", s.get("interval"),
           f"one of {', '.join(schema.SCHEDULER_INTERVALS)}")
    if "warmup_steps" in s:
        _check(s.warmup_steps >= 0, "scheduler.warmup_steps", s.warmup_steps,
               "0 or a positive number of optimizer steps")
    if "min_lr" in s:
        _check(s.min_lr >= 0, "scheduler.min_lr", s.min_lr, "a non-negative learning rate")
    if "step_size_epochs" in s:
        _check(s.step_size_epochs >= 1, "scheduler.step_size_epochs", s.step_size_epochs,
               "a positive number of epochs")
    if "gamma" in s:
        _check(s.gamma > 0, "scheduler.gamma", s.gamma, "a positive factor")


def _check_scheduler_keys(s: Mapping[str, Any]) -> None:
    """Refuse a ``scheduler.*`` key that the chosen scheduler does not use, rather than ignore
    it: with ``scheduler=none`` (no ``_target_``: a constant learning rate, nothing is stepped)
    any key that differs from the schema's default (``scheduler.interval=batch``,
    ``+scheduler.warmup_steps=5``), with ``cosine`` or ``step`` a key outside its schema
    (:data:`ddp_exp.schema.SCHEMAS`). A user's own ``_target_`` receives the keys as its
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


def instantiate_node(node: Mapping[str, Any], key: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate(node, **kwargs)`` with errors for users as :class:`ConfigError`.

    ``key`` names the config node (``model``, ``data``, ``optim``) in the message. A ConfigError
    raised by the target itself is passed through unchanged.

    Raises:
        ConfigError: the target cannot be imported, rejects its arguments, or raises ConfigError.
    """
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        target = node.get("_target_")
        if isinstance(target, str):  # an import failure: say which module and why
            locate(target, f"{key}._target_")  # Hydra's text guesses "is it installed?"
        text = str(cause if cause is not None else exc).strip()
        detail = " ".join(text.split())[:300] if text else type(exc).__name__
        raise ConfigError(f"{key}._target_={target!r} failed: {detail}") from exc


def find_target(path: str) -> Any | None:
    """The object a ``_target_`` names (``pkg.module.name``), found as :func:`locate` finds it,
    or None when it cannot be imported; :func:`instantiate_node` then reports that in one line
    naming the key. Logs nothing (Hydra's ``get_object`` logs a failure at ERROR, a multi-line
    record that the launching process printed before the one-line error)."""
    try:
        return locate(path, "_target_")
    except ConfigError:
        return None


def locate(path: str, key: str) -> Any:
    """Import ``pkg.module.Name`` (the object a ``_target_`` names).

    Raises:
        ConfigError: one line naming ``key`` when it cannot be imported: no such module or
            attribute, a module it imports is missing, or importing it raised.
    """
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ImportError as exc:
            missing = getattr(exc, "name", None) or ""
            if cut == 1 or not (module == missing or module.startswith(f"{missing}.")):
                # the path's first module is missing, or something the module imports is
                hint = _where_modules_are(missing) if missing == parts[0] else ""
                raise ConfigError(f"{key}={path!r} cannot be imported ({exc}){hint}") from None
            continue
        except Exception as exc:  # the module exists and raised while it was imported
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise ConfigError(f"{key}={path!r} cannot be imported: importing {module} raised "
                              f"{type(exc).__name__}: {first}") from None
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            return obj
        except AttributeError:
            break
    raise ConfigError(f"{key}={path!r} cannot be imported (no such module or attribute)")


def _where_modules_are(name: str) -> str:
    """The hint for a ``_target_`` whose first module is nowhere: where Python looked."""
    folder = command_folder()
    searched = any(os.path.abspath(p or os.curdir) == folder for p in sys.path)
    if searched:
        where = (f"on PYTHONPATH and in {folder}, the folder the command runs in: run it from "
                 f"the folder that holds {name}.py (or {name}/), or add that folder to "
                 "PYTHONPATH")
    else:  # the ddp-exp console script: its folder is sys.path[0], not the current one
        where = (f"on PYTHONPATH only, not in {folder} (the ddp-exp script does not look in "
                 f"the folder it runs in): use python -m ddp_exp, or add the folder that holds "
                 f"{name}.py (or {name}/) to PYTHONPATH")
    return f"; Python looked for {name} {where}"


def command_folder() -> str:
    """The folder the command ran in: Hydra's original working directory inside a Hydra job
    (the job may have changed into its output folder, ``hydra.job.chdir=true``), else the
    current one."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        cwd = OmegaConf.select(HydraConfig.get(), "runtime.cwd")
        if cwd:
            return str(cwd)
    return os.getcwd()
