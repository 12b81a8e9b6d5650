"""``_target_`` lookup: :func:`instantiate_node` turns a failing ``_target_`` into one
:class:`~ddp_exp.config.errors.ConfigError` line; :func:`find_target` looks one up without a word;
:func:`locate` names where modules are when one is missing.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate

from ddp_exp.config.compose import command_folder
from ddp_exp.config.errors import ConfigError, described


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
            raise ConfigError(f"{key}={path!r} cannot be imported: importing {module} raised "
                              f"{described(exc)}") from None
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


def check_targets(cfg: Mapping[str, Any], prefix: str = "") -> None:
    """Import every ``_target_`` in ``cfg`` (any depth: ``data``, ``model``, ``optim``,
    ``scheduler``, ``loss``, ``metrics.<name>``, a transform inside ``data``) before the config is
    printed and anything slow starts: a ``_target_`` that cannot be imported is one line and
    nothing else (the printed config came first, then the error, issue 26 item 11d). Logs
    nothing; builds nothing.

    Raises:
        ConfigError: the first ``_target_`` that cannot be imported (:func:`locate`'s line).
    """
    for name, value in cfg.items():
        key = f"{prefix}{name}"
        if name == "_target_" and isinstance(value, str) and "." in value:
            locate(value, key)
        elif isinstance(value, Mapping):
            check_targets(value, f"{key}.")
