"""Hydra's side of the configuration: :func:`register_configs` hands Hydra the schema and the
resolvers the YAML uses; the primary config's checks, the task's overrides, interpolation
checks, the run stamp and the command's folder.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import sys
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from ddp_exp.compat import messages
from ddp_exp.compat.omegaconf import open_node
from ddp_exp.config import schema, user_dir
from ddp_exp.config.errors import ConfigError


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (:data:`ddp_exp.config.schema.SCHEMAS`, group
    ``schema``) and register the resolvers ``ddp_exp.ranks_per_node`` and ``ddp_exp.run_stamp``,
    once per process, and the search-path plugin that puts a user's ``--config-dir`` first.
    The sweeper plugin (``hydra/sweeper=ddp_optuna``) is the entry's to register:
    :func:`ddp_exp.cli.registry.register`."""
    cs = ConfigStore.instance()
    cs.store(name="ddp_exp_schema", node=schema.Config)
    # A user's --config-dir before the packaged configs (hydra #2758; ddp_exp.config.user_dir).
    Plugins.instance().register(user_dir.UserConfigDirFirst)
    for group, name, node in schema.SCHEMAS:
        if (group, name) in schema.OPEN_SCHEMAS:
            node = open_node(node)
        cs.store(group=f"schema/{group}", name=name, node=node)
    OmegaConf.register_new_resolver("ddp_exp.ranks_per_node", ranks_per_node, replace=True)
    OmegaConf.register_new_resolver("ddp_exp.run_stamp", run_stamp, use_cache=True,
                                    replace=True)


def group_options(group: str) -> list[str]:
    """The options ddp_exp ships in config group ``group`` (``conf/<group>/*.yaml``, sorted);
    empty for a name that is no group of ``conf/``."""
    import importlib.resources

    root = importlib.resources.files("ddp_exp.conf")
    if group.startswith(("_", ".")) or not root.joinpath(group).is_dir():
        return []
    return sorted(p.name[:-5] for p in root.joinpath(group).iterdir()
                  if p.name.endswith(".yaml"))


# Config groups whose options are presets (``# @package _global_``): each sets keys of others.
PRESET_GROUPS = ("experiment", "debug", "hparams_search")


def preset_note(line: str, hydra_cfg: Any) -> str:
    """For a refusal ``<key>=<value> ...`` of a key the command line did not set, where a
    chosen preset set it (``experiment=gpt_tokens``): ``"; experiment=gpt_tokens sets <key>:
    give <key>=... to override it"``, so that a preset's value refused for this run (its
    ``scheduler.warmup_steps`` longer than a short run) does not read as if the user had typed
    it. ``""`` for any other line. The presets are read from the job's config sources
    (``--config-dir``'s too), file and package ones."""
    match = re.match(r"([A-Za-z_][\w.]*)=", line)
    if match is None:
        return ""
    key = match.group(1)
    if any(arg.lstrip("+~").partition("=")[0] == key for arg in task_overrides(hydra_cfg)):
        return ""
    choices = hydra_cfg.runtime.choices
    for group in PRESET_GROUPS:
        option = choices.get(group)
        node = _option_node(hydra_cfg, group, option) if option else None
        if node is not None and OmegaConf.select(node, key, default=None) is not None:
            return f"; {group}={option} sets {key}: give {key}=... to override it"
    return ""


def _option_node(hydra_cfg: Any, group: str, option: str) -> DictConfig | None:
    """``<group>/<option>.yaml`` of the first of the job's config sources (``file://`` and
    ``pkg://``) that holds it, loaded as it is (its defaults list not composed); None where
    none does or it does not load."""
    import importlib.resources

    for source in hydra_cfg.runtime.config_sources:
        name = f"{group}/{option}.yaml"
        try:
            if source.schema == "file":
                path = os.path.join(source.path, name)
                text = None
                if os.path.isfile(path):
                    with open(path) as fh:
                        text = fh.read()
            elif source.schema == "pkg":
                found = importlib.resources.files(source.path).joinpath(name)
                text = found.read_text() if found.is_file() else None
            else:
                continue
        except (OSError, ImportError, ValueError):
            continue
        if text is not None:
            try:
                node = OmegaConf.create(text)
            except Exception:  # a preset Hydra loaded but OmegaConf alone cannot: no note
                return None
            return node if isinstance(node, DictConfig) else None
    return None


def null_group_line(exc: BaseException, argv: list[str]) -> str | None:
    """One line for ``group=null`` on the command line (``scheduler=null``; Hydra raises a
    ``ValueError``, "Config group override must be a string or a list"): a config group takes
    one of its options; the line names the one that means "none" (``scheduler=none``), or says
    that a preset group is empty unless chosen, or lists the options. None for any other
    error, or when no argument of ``argv`` sets a group (a key without a dot) to null."""
    if not messages.hydra_null_group(exc):
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
