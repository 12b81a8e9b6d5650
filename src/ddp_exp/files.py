"""Files that are never half-written: temp file in the same folder, fsync, atomic rename."""

from __future__ import annotations

import glob
import os
import tempfile
from collections.abc import Callable
from typing import BinaryIO


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(fh)`` on a temp file beside ``path``, fsync it, then ``os.replace`` it onto
    ``path``; a reader sees the old file or the complete new one, never part of one (POSIX
    rename is atomic within a file system). The temp file is removed if ``write`` fails."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def temp_name(path: str, tag: str = "") -> str:
    """A temp-file name beside ``path`` that :func:`remove_partial` recognises."""
    return os.path.join(os.path.dirname(os.path.abspath(path)),
                        f".{os.path.basename(path)}.{tag or os.getpid()}.tmp")


def remove_partial(folder: str) -> list[str]:
    """Delete the temp files a killed writer left in ``folder`` (``.<name>.*.tmp``); the
    complete files are untouched. Returns the paths removed."""
    removed = []
    for path in glob.glob(os.path.join(folder, ".*.tmp")):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
