"""``python -m ddp_exp --help``: the resolvers behind ``conf/hydra/help/ddp_exp.yaml``.

Hydra's help template offers ``$APP_CONFIG_GROUPS``, which lists every config group, ddp_exp's
internal ``schema/*`` groups (the structured configs in :mod:`ddp_exp.config.schema`) included. The
``ddp_exp.help_groups`` resolver lists the same groups through Hydra's own formatter, without
those; ``ddp_exp.help_keys`` lists the composed config's top-level keys and their values.

Cost: OmegaConf dereferences the help template whenever a later config layer merges onto it,
which is at every composition, not only under ``--help``; Hydra composes twice per job
(``@hydra.main`` asks for the run mode, then composes the job). Listing the groups scans the
whole config repository (1.4-2 s here), so :func:`help_groups` does it only when the command
line asks for help and returns a placeholder otherwise.
"""

from __future__ import annotations

import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf

HIDDEN_GROUPS = ("hydra", "schema")
HELP_FLAGS = ("--help", "-h")  # Hydra's flags that print hydra.help.template


def help_requested(argv: list[str] | None = None) -> bool:
    """True when the command line (``sys.argv`` by default) asks Hydra for ``--help``."""
    return any(arg in HELP_FLAGS for arg in (sys.argv[1:] if argv is None else argv))


# Hydra's flags that print and run no job: help, the config, information, shell completion.
PRINT_ONLY_FLAGS = (*HELP_FLAGS, "--hydra-help", "--cfg", "-c", "--info", "-i",
                    "--shell-completion", "-sc", "--version")


def runs_no_job(argv: list[str] | None = None) -> bool:
    """True when the command line (``sys.argv`` by default) asks Hydra only to print
    (:data:`PRINT_ONLY_FLAGS`): no job runs, so the entry imports no torch (issue 42 item 6:
    ``--help`` and ``--cfg job`` spent 1.3-1.7 s importing it)."""
    return any(arg.split("=")[0] in PRINT_ONLY_FLAGS
               for arg in (sys.argv[1:] if argv is None else argv))


def help_groups() -> str:
    """``group: option, option, ...`` per line for every group a user chooses from (those of
    ``conf/`` and of any ``--config-dir``), as Hydra formats ``$APP_CONFIG_GROUPS``.

    Listed by walking Hydra's config loader (``list_groups``, ``get_group_options``) below the
    groups a user sees only: each query copies the whole config repository (~50 ms here), and
    Hydra's own formatter lists ``hydra/*`` and ``schema/*`` too before filtering (``--help``
    took 2.8 s). Computed once per config loader: the template resolves it more than once."""
    from hydra.core.global_hydra import GlobalHydra

    if not help_requested():  # composing a run: nobody reads it, and it costs seconds
        return "(python -m ddp_exp --help lists them)"
    hydra = GlobalHydra.instance().hydra
    if hydra is None:  # resolved outside Hydra's --help (e.g. --cfg hydra)
        return ""
    loader = hydra.config_loader
    if _LISTED.get("loader") is not loader:
        lines = [f"{group}: {', '.join(sorted(loader.get_group_options(group)))}"
                 for group in sorted(_user_groups(loader))]
        _LISTED.update(loader=loader, text="\n".join(lines))
    return _LISTED["text"]


_LISTED: dict[str, Any] = {}  # help_groups' last listing and the loader it came from


def _user_groups(loader: Any, parent: str = "") -> list[str]:
    """The groups under ``parent`` that hold configs, at any depth, without
    :data:`HIDDEN_GROUPS` (Hydra's ``list_all_config_groups``, pruned at the top)."""
    from hydra.core.object_type import ObjectType

    groups = []
    for name in loader.list_groups(parent):
        if not parent and name in HIDDEN_GROUPS:
            continue
        group = f"{parent}/{name}" if parent else name
        if loader.get_group_options(group, ObjectType.CONFIG):
            groups.append(group)
        if loader.get_group_options(group, ObjectType.GROUP):
            groups.extend(_user_groups(loader, group))
    return groups


def help_keys(_root_: DictConfig) -> str:
    """``key: value`` per line for the composed config's top-level values (``world_size``,
    ``seed``, ...), then the names of its nested sections (``data``, ``trainer``, ...)."""
    lines, sections = [], []
    for key in _root_:
        if key == "hydra":
            continue
        value: Any = (None if OmegaConf.is_interpolation(_root_, key)
                      or OmegaConf.is_missing(_root_, key) else _root_[key])
        if isinstance(value, DictConfig) and len(value) > 0:
            sections.append(str(key))
        else:  # as written: an interpolation unresolved, ??? for a missing value
            lines.append(OmegaConf.to_yaml(OmegaConf.masked_copy(_root_, str(key))).strip())
    lines.append(f"sections: {', '.join(sections)}")
    return "\n".join(lines)


def register_resolvers() -> None:
    """Register ``ddp_exp.help_groups`` and ``ddp_exp.help_keys`` (once per process)."""
    OmegaConf.register_new_resolver("ddp_exp.help_groups", help_groups, replace=True)
    OmegaConf.register_new_resolver("ddp_exp.help_keys", help_keys, replace=True)
