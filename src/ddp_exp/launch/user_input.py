"""What a user typed, settled once in the Hydra job before any rank starts.

:func:`settle` runs on the composed config just before :func:`ddp_exp.config.checks.validate`, in
the
process that Hydra started (the launcher; under torchrun, every rank before rank 0's config is
adopted), and changes two things, so that ranks receive plain, final values:

* **Paths are relative to the folder the command ran in**, whatever ``hydra.job.chdir`` says
  (Hydra's ``to_absolute_path``; hydra #922, #2414): ``data.path``, ``trainer.resume=<file>``
  and, under ``data``, ``model``, ``loss`` and ``metrics``, every key whose name says it is a
  path (``path``, ``root``, ``dir``, ``file``, ``folder`` or ``*_path``, ``*_dir``, ...) become
  absolute. A key of a user's own ``_target_`` may hold a name rather than a path (a Hugging Face
  dataset id), so it is made absolute only when it names something that exists there, or is
  written ``./...``, ``../...`` or ``~/...``.
* **A ``_target_`` override drops the keys it cannot take.** ``model._target_=mymodel.TinyNet``
  on the default ``model=mlp`` would pass ``hidden_sizes`` and ``dropout`` to ``TinyNet``: the
  arguments of the replaced option's target that the new target's signature does not accept are
  dropped (one log line names them), unless given on the command line. Same for ``data``,
  ``optim`` and ``scheduler``; keys that ddp_exp itself reads (``data.batch_size``,
  ``optim.lr_scaling``, ...) are never arguments of the option's target and stay.

May use: :mod:`ddp_exp.config` (``find_target``, ``command_folder``), :mod:`ddp_exp.config.schema`,
:mod:`ddp_exp.data` (the data keys it reads itself).
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from ddp_exp.config import schema
from ddp_exp.config.compose import check_interpolations, command_folder, task_overrides
from ddp_exp.config.targets import find_target

log = logging.getLogger("ddp_exp")

# Keys that always hold a path (a missing one is reported where it is read, at its absolute path).
SCHEMA_PATH_KEYS = ("data.path",)
# Nodes whose keys of a path-like name are a user's target's arguments.
USER_NODES = ("data", "model", "loss", "metrics")
PATH_NAME = re.compile(r"(^|_)(path|paths|dir|dirs|root|file|files|filename|folder)$")
# Groups whose ``_target_`` a user may replace on the command line.
TARGET_GROUPS = ("data", "model", "optim", "scheduler")


def settle(cfg: DictConfig) -> None:
    """Check the interpolations of ``cfg`` (:func:`ddp_exp.config.compose.check_interpolations`),
    make its paths absolute (:func:`absolute_paths`) and drop the arguments a replaced
    ``_target_`` cannot take (:func:`drop_replaced_keys`), in place. Idempotent."""
    check_interpolations(cfg)  # a ${...} that resolves nowhere: one line naming its key
    absolute_paths(cfg, command_folder())  # first: a node that loses keys loses its schema
    drop_replaced_keys(cfg, _typed_keys())


def absolute_paths(cfg: DictConfig, base: str) -> list[str]:
    """Rewrite the relative paths a user typed as absolute paths under ``base``.

    ``data.path`` of a packaged option (``data=file``, ``data=image_folder``) and
    ``trainer.resume=<file>`` always; under :data:`USER_NODES`, a key of a path-like name
    (:data:`PATH_NAME`) when :func:`_looks_local` says it is a local path.

    Args:
        cfg: the composed config (changed in place).
        base: the folder the command ran in (:func:`command_folder`).

    Returns:
        The keys rewritten, e.g. ``["data.path", "trainer.resume"]``.
    """
    changed = []
    for key in SCHEMA_PATH_KEYS:
        group, _, name = key.partition(".")
        node = cfg.get(group) if group in cfg else None
        fields = getattr(OmegaConf.get_type(node), "__dataclass_fields__", {}) if isinstance(
            node, DictConfig) else {}
        if name in fields and not OmegaConf.is_missing(node, name) and isinstance(
                node[name], str) and node[name]:
            node[name] = _absolute(node[name], base)
            changed.append(key)
    resume = OmegaConf.select(cfg, "trainer.resume", default=None)
    if isinstance(resume, str) and resume not in ("", "auto"):
        OmegaConf.update(cfg, "trainer.resume", _absolute(resume, base), merge=False)
        changed.append("trainer.resume")
    for name in USER_NODES:
        node = cfg.get(name) if name in cfg else None
        if isinstance(node, DictConfig):
            changed += _user_paths(node, name, base, set(changed))
    return changed


def _user_paths(node: DictConfig, prefix: str, base: str, done: set[str]) -> list[str]:
    """The path-named keys under ``node`` (nested nodes included) that :func:`_looks_local`
    takes for local paths, made absolute; keys in ``done`` are left alone."""
    changed = []
    for key in list(node.keys()):
        full = f"{prefix}.{key}"
        if full in done or OmegaConf.is_missing(node, key):
            continue
        if not OmegaConf.is_interpolation(node, key) and isinstance(node[key], DictConfig):
            changed += _user_paths(node[key], full, base, done)
            continue
        if not PATH_NAME.search(str(key)) or OmegaConf.is_interpolation(node, key):
            continue
        raw = node[key]
        if isinstance(raw, str) and _looks_local(raw, base):
            node[key] = _absolute(raw, base)
            changed.append(full)
        elif isinstance(raw, ListConfig) and len(raw) and all(
                isinstance(v, str) and _looks_local(v, base) for v in raw):
            node[key] = [_absolute(v, base) for v in raw]
            changed.append(full)
    return changed


def _looks_local(value: str, base: str) -> bool:
    """True for a relative path that exists under ``base`` or is written as one."""
    if not value or os.path.isabs(value) or "://" in value:
        return False
    if value.startswith(("./", "../", "~")) or value in (".", ".."):
        return True
    return os.path.exists(os.path.join(base, value))


def _absolute(value: str, base: str) -> str:
    return os.path.normpath(os.path.join(base, os.path.expanduser(value)))


def _typed_keys() -> set[str]:
    """The keys set on the command line of this Hydra job (``model.hidden_sizes=[64]`` ->
    ``model.hidden_sizes``); empty outside a Hydra job."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return set()
    return {o.split("=", 1)[0].lstrip("+~") for o in task_overrides(HydraConfig.get())}


def drop_replaced_keys(cfg: DictConfig, typed: set[str] = frozenset()) -> dict[str, list[str]]:
    """Drop the arguments of a packaged option's ``_target_`` that a ``_target_`` given in its
    place does not accept.

    For each group of :data:`TARGET_GROUPS` whose node was composed from a packaged option (its
    schema, :data:`ddp_exp.config.schema.SCHEMAS`) and whose ``_target_`` is not that option's: the
    option's own keys (those not in the group's base schema) that the option's target accepts
    by name and the new target does not (``inspect.signature``; a new target that takes
    ``**kwargs`` accepts every key) are removed, except those in ``typed``. The node becomes a
    plain node of the keys kept. A target that cannot be imported is left to
    :func:`ddp_exp.config.targets.instantiate_node`, which reports it in one line.

    Args:
        cfg: the composed config (changed in place).
        typed: keys set on the command line (``model.hidden_sizes``): never dropped.

    Returns:
        ``{group: [dropped keys]}`` for the groups that lost keys.
    """
    dropped = {}
    for group in TARGET_GROUPS:
        node = cfg.get(group) if group in cfg else None
        if not isinstance(node, DictConfig):
            continue
        option = _packaged_option(group, OmegaConf.get_type(node))
        target = node.get("_target_") if not OmegaConf.is_missing(node, "_target_") else None
        if option is None or not isinstance(target, str) or target == option[1]._target_:
            continue
        name, cls = option
        old, new = _keywords(cls._target_), _keywords(target)
        if old is None or new is None or new is ...:
            continue
        base = _base_fields(group) | _read_by_ddp_exp(group)
        gone = [k for k in node if k not in base and (old is ... or k in old) and k not in new
                and f"{group}.{k}" not in typed]
        if not gone:
            continue
        plain = OmegaConf.to_container(node, resolve=False)
        cfg[group] = {k: v for k, v in plain.items() if k not in gone}
        dropped[group] = gone
        log.info("%s._target_=%s: dropped %s=%s's %s (not arguments of %s)", group, target,
                 group, name, ", ".join(gone), target.rsplit(".", 1)[-1])
    return dropped


def _packaged_option(group: str, node_type: Any) -> tuple[str, Any] | None:
    """``(option name, schema class)`` of the packaged option a node was composed from."""
    for g, name, cls in schema.SCHEMAS:
        if g == group and cls is node_type and name != "base":
            return name, cls
    return None


def _base_fields(group: str) -> set[str]:
    """The keys every option of ``group`` has (its ``base`` schema): ddp_exp's own, or kept."""
    import dataclasses

    for g, name, cls in schema.SCHEMAS:
        if g == group and (name == "base" or (group == "scheduler" and name == "none")):
            return {f.name for f in dataclasses.fields(cls)}
    return {"_target_"}


def _read_by_ddp_exp(group: str) -> set[str]:
    """Keys of ``group`` that ddp_exp reads itself even where a target takes them too
    (``data.task``, ``data.num_classes``): never dropped."""
    if group != "data":
        return set()
    from ddp_exp.data import DESCRIBING_KEYS, PATH_KEYS

    return {*DESCRIBING_KEYS, *PATH_KEYS}


def _keywords(target: Any) -> set[str] | type(...) | None:
    """The keyword names ``target`` accepts, ``...`` when it takes ``**kwargs``, None when it
    cannot be imported or inspected."""
    if not isinstance(target, str):
        return None
    obj = find_target(target)
    if obj is None:
        return None
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return ...
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
