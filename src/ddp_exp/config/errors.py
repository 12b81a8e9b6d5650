"""The error every user-facing configuration refusal raises: :class:`ConfigError`, one line
naming the key, the bad value and what is valid.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A user's configuration cannot run; the message is one line naming the key."""


def _check(ok: bool, key: str, value: Any, valid: str) -> None:
    """Raise ``ConfigError("<key>=<value> is invalid: <valid>")`` unless ``ok``; the value is
    written as on the command line (``null``, not Python's ``None``)."""
    if not ok:
        shown = "null" if value is None else repr(value)
        raise ConfigError(f"{key}={shown} is invalid: {valid}")


def first_line(exc: BaseException | str, limit: int = 300, default: str = "") -> str:
    """The first line of an exception's message (or of a text), stripped and cut at ``limit``
    characters; ``default`` where the message is empty or blank (``str(KeyboardInterrupt())``
    is ``""``: a bare ``splitlines()[0]`` would raise IndexError in the error path itself)."""
    lines = str(exc).strip().splitlines()
    return lines[0].strip()[:limit] if lines else default


def described(exc: BaseException, limit: int = 300) -> str:
    """``<type>: <first line of the message>`` (:func:`first_line`), or the type's name alone
    where the message is empty: how a line names an error it did not expect."""
    first = first_line(exc, limit)
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
