"""``python -m ddp_exp --help``: the resolvers behind ``conf/hydra/help/ddp_exp.yaml``.

Hydra's help template offers ``$APP_CONFIG_GROUPS``, which lists every config group, ddp_exp's
internal ``schema/*`` groups (the structured configs in :mod:`ddp_exp.schema`) included. The
``ddp_exp.help_groups`` resolver lists the same groups through Hydra's own formatter, without
those; ``ddp_exp.help_keys`` lists the composed config's top-level keys and their values.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

HIDDEN_GROUPS = ("hydra", "schema")


def help_groups() -> str:
    """``group: option, option, ...`` per line for every group a user chooses from (those of
    ``conf/`` and of any ``--config-dir``), as Hydra formats ``$APP_CONFIG_GROUPS``."""
    from hydra.core.global_hydra import GlobalHydra

    hydra = GlobalHydra.instance().hydra
    if hydra is None:  # resolved outside Hydra's --help (e.g. --cfg hydra)
        return ""
    return hydra.format_config_groups(
        lambda group: group.split("/")[0] not in HIDDEN_GROUPS).rstrip("\n")


def help_keys(_root_: DictConfig) -> str:
    """``key: value`` per line for the composed config's top-level values (``world_size``,
    ``seed``, ...), then the names of its nested sections (``data``, ``trainer``, ...)."""
    lines, sections = [], []
    for key in _root_:
        if key == "hydra":
            continue
        node: Any = _root_._get_node(key)
        if isinstance(node, DictConfig) and len(node) > 0:
            sections.append(str(key))
        else:
            value = OmegaConf.to_yaml({key: node}).strip()
            lines.append(value)
    lines.append(f"sections: {', '.join(sections)}")
    return "\n".join(lines)


def register_resolvers() -> None:
    """Register ``ddp_exp.help_groups`` and ``ddp_exp.help_keys`` (once per process)."""
    OmegaConf.register_new_resolver("ddp_exp.help_groups", help_groups, replace=True)
    OmegaConf.register_new_resolver("ddp_exp.help_keys", help_keys, replace=True)
