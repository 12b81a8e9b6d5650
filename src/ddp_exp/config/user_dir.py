"""A user's ``--config-dir`` comes before ddp_exp's packaged configs (hydra #2758).

Hydra adds ``--config-dir`` to the config search path after the primary config's own folder
(``pkg://ddp_exp.conf``): a user's ``model/mlp.yaml`` or an edited copy of
``experiment/digits_cnn_recipe.yaml`` was silently ignored for the packaged file of the same
name. :class:`UserConfigDirFirst`, a Hydra ``SearchPathPlugin`` registered by
:func:`ddp_exp.config.compose.register_configs`, puts the user's folder just before ddp_exp's,
so that a config of the same name is the user's, as with any other file a user edits.

One exception: a top-level ``config.yaml`` of the user's folder would then replace ddp_exp's
primary config (and refer to itself where it names ``config`` in its defaults list). Such a
folder keeps Hydra's order, and one warning names the packaged configs its files stay shadowed
by and how to choose the user's primary config (``--config-name``).

May import nothing of ddp_exp above ``config``.
"""

from __future__ import annotations

import importlib.resources
import os
import sys

from hydra.core.config_search_path import ConfigSearchPath, SearchPathQuery
from hydra.plugins.search_path_plugin import SearchPathPlugin

PROVIDER = "ddp_exp: --config-dir, before ddp_exp's"
CONFIG_DIR_FLAGS = ("--config-dir", "-cd")


def config_dir_from_argv(argv: list[str]) -> str | None:
    """The folder given with ``--config-dir``/``-cd`` (``--config-dir X`` or
    ``--config-dir=X``) in ``argv`` (the command's arguments, without the program), as an
    absolute path; None without one. The last one counts, as with argparse."""
    found = None
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag not in CONFIG_DIR_FLAGS:
            continue
        if eq:
            found = value
        elif i + 1 < len(argv):
            found = argv[i + 1]
    return os.path.abspath(found) if found else None


def packaged_configs() -> set[str]:
    """Every config ddp_exp ships, by its path under ``conf/`` (``model/mlp.yaml``)."""
    root = importlib.resources.files("ddp_exp.conf")
    found: set[str] = set()

    def walk(node, prefix: str) -> None:
        for child in node.iterdir():
            if child.is_dir() and not child.name.startswith(("_", ".")):
                walk(child, f"{prefix}{child.name}/")
            elif child.name.endswith(".yaml"):
                found.add(prefix + child.name)

    walk(root, "")
    return found


def shadowed_configs(config_dir: str) -> list[str]:
    """The configs of ``config_dir`` that have a packaged namesake (sorted relative paths)."""
    mine = set()
    for folder, dirs, files in os.walk(config_dir):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        rel = os.path.relpath(folder, config_dir)
        mine.update(os.path.normpath(os.path.join(rel, f)).replace(os.sep, "/")
                    for f in files if f.endswith(".yaml"))
    return sorted(mine & packaged_configs())


def primary_shadow_warning(config_dir: str) -> str | None:
    """The warning for a ``config_dir`` holding a top-level ``config.yaml`` (this module's
    docstring), or None where it holds none."""
    if not os.path.isfile(os.path.join(config_dir, "config.yaml")):
        return None
    others = [c for c in shadowed_configs(config_dir) if c != "config.yaml"]
    also = (f"; so are your {', '.join(others[:4])}{', ...' if len(others) > 4 else ''}, "
            "which ddp_exp's configs of the same name shadow" if others else "")
    return (f"warning: {config_dir}/config.yaml is not read: ddp_exp's primary config has that "
            f"name{also}. Rename yours (e.g. mine.yaml, defaults: [config, <your options>, "
            "_self_]) and add --config-name mine")


def replaced_hint(group: str, choice: str | None) -> str:
    """For an error about config group ``group``: where the command's ``--config-dir`` holds
    ``<group>/<choice>.yaml`` of the same name as a packaged one, the sentence saying that it
    replaces ddp_exp's whole file (a file of one key loses the packaged keys and schema: its
    ``_target_`` above all) and how to keep them; empty otherwise."""
    config_dir = config_dir_from_argv(sys.argv[1:])
    name = f"{group}/{choice}.yaml"
    if not choice or config_dir is None or name not in shadowed_configs(config_dir):
        return ""
    schema = f"/schema/{group}/{choice}@_here_"
    return (f"; your {config_dir}/{name} replaces ddp_exp's {name} whole: copy ddp_exp's and "
            f"edit it, or start yours with its defaults list (defaults: [{schema}, _self_])")


class UserConfigDirFirst(SearchPathPlugin):
    """Puts the command's ``--config-dir`` before ddp_exp's packaged configs in Hydra's search
    path (this module's docstring). Hydra still adds the folder where it always does, after
    them; the first match wins, so that later entry finds nothing of its own."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:  # noqa: D102
        config_dir = config_dir_from_argv(sys.argv[1:])
        if config_dir is None or not os.path.isdir(config_dir):
            return  # none given, or Hydra's own line for a missing folder
        warning = primary_shadow_warning(config_dir)
        if warning is not None:
            if os.environ.get("RANK", "0") == "0":  # under torchrun every rank composes
                print(warning, file=sys.stderr, flush=True)
            return
        search_path.prepend(provider=PROVIDER, path=f"file://{config_dir}",
                            anchor=SearchPathQuery(provider="main"))
