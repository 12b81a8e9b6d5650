"""The versions each borrowed internal was written for, and the check every module of
:mod:`ddp_exp.compat` makes before it relies on one.

A patch or a read of a private attribute, or a match on an upstream message's wording, is used
only when the installed distribution is of the series it was written for (:data:`WRITTEN_FOR`);
on any other version the caller takes the library's stock behaviour, and the process logs one
line saying so (once per borrowed internal). ``tests/test_compat.py`` holds each internal to
what it relies on (the attribute exists with the signature used, the message still reads so),
and each fallback by faking another version (monkeypatch :func:`installed`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import platform
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ddp_exp")

# distribution -> the release series (``major.minor``) the internals used here were read from.
WRITTEN_FOR: dict[str, tuple[str, ...]] = {
    "torch": ("2.13",),
    "hydra-core": ("1.3",),
    "omegaconf": ("2.3",),
    "submitit": ("1.5",),
    # CPython's own (atexit._run_exitfuncs): the versions pyproject's requires-python admits.
    "python": ("3.10", "3.11", "3.12", "3.13"),
}
_told: set[str] = set()


@functools.cache
def _metadata_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed(dist: str) -> str | None:
    """The installed version of ``dist`` (``"2.13.0+cpu"``), ``"python"`` for the interpreter
    (``"3.11.7"``, CPython only: another implementation has none of its internals); None when
    not installed."""
    if dist == "python":
        return (platform.python_version() if platform.python_implementation() == "CPython"
                else None)
    return _metadata_version(dist)


def series(version: str) -> str:
    """``major.minor`` of a version string: ``"2.13.0+cpu"`` -> ``"2.13"``."""
    return ".".join(version.split("+", 1)[0].split(".")[:2])


def written_for(dist: str, what: str, fallback: str) -> bool:
    """True when the installed ``dist`` is of a series in :data:`WRITTEN_FOR`, so that
    ``what`` (the borrowed internal, named in the log) may be used. Otherwise False, after
    logging once per ``what`` and process the line a user or maintainer reads: what was written
    for which version, what is installed, and ``fallback`` (the stock behaviour taken instead).
    """
    version = installed(dist)
    if version is not None and series(version) in WRITTEN_FOR[dist]:
        return True
    if what not in _told:
        _told.add(what)
        log.info("ddp_exp.compat: %s was written for %s %s, found %s: %s", what, dist,
                 " / ".join(f"{s}.x" for s in WRITTEN_FOR[dist]), version or "none", fallback)
    return False


def wrap_once(owner: Any, name: str, wrap: Callable[[Callable], Callable], dist: str,
              what: str, fallback: str) -> bool:
    """Replace ``owner.<name>`` (a library's function or method) by ``wrap(stock)`` in this
    process, where :func:`written_for` (``dist``, ``what``, ``fallback``) allows it; the
    replacement carries ``functools.wraps`` of the stock one (``__wrapped__``). Idempotent.
    Returns True when the replacement is in place."""
    if not written_for(dist, what, fallback):
        return False
    stock = getattr(owner, name)
    if getattr(stock, "_ddp_exp_wrapped", False):
        return True
    replacement = functools.wraps(stock)(wrap(stock))
    replacement._ddp_exp_wrapped = True  # type: ignore[attr-defined]
    setattr(owner, name, replacement)
    return True
