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
