"""The console (stdin, stdout, stderr) as a convenience that can never cost the run's record.

The job folder is the record (``status.json``, ``errors/``, ``metrics.json``); what reaches a
terminal or a pipe is a copy for whoever watches. A write to a console that is gone must
therefore never raise into the code that writes the record: a reader that closed its pipe
(``| head -c 1``, ``| true``: ``BrokenPipeError``, EPIPE), descriptors closed at start
(``>&- 2>&-``), a terminal that hung up (EIO), a full disk under a redirected log (ENOSPC).

:func:`protect_console` is called first thing by the entry point (:mod:`ddp_exp.cli.entry`)
and by every rank:

- a standard descriptor closed at start is opened on ``os.devnull``, so that no file the run
  opens later (the job log, a temp file of ``status.json``) takes descriptor 1 or 2 and gets
  what torch's C++ code or a child process writes there;
- ``sys.stdout`` and ``sys.stderr`` become :class:`SafeStream`: a write or flush that fails
  with ``OSError`` (or on a closed file) is dropped, and the descriptor is pointed at
  ``os.devnull`` for the rest of the process, so that later writes (Python's, C++'s, a forked
  rank's, the interpreter's own flush at exit, which would turn the exit status into 120)
  cannot fail again.

Python ignores SIGPIPE, so a write to a closed pipe is an ``EPIPE`` error here, never a signal;
exit statuses are the run's own, the same as without a pipe.

May import nothing of ddp_exp.
"""

from __future__ import annotations

import io
import os
import sys
from typing import Any, TextIO

STANDARD_FDS = (0, 1, 2)


def _to_devnull(fd: int) -> None:
    """Point descriptor ``fd`` at ``os.devnull`` (reading and writing)."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        if null != fd:
            os.dup2(null, fd)
    finally:
        if null != fd:
            os.close(null)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


class SafeStream(io.TextIOBase):
    """A text stream over ``stream`` whose ``write`` and ``flush`` never raise: the first
    failure (``OSError``: EPIPE, EBADF, EIO, ENOSPC; ``ValueError``: a closed file) drops the
    text and sends the stream's descriptor to ``os.devnull`` from then on. Every other
    attribute (``isatty``, ``fileno``, ``encoding``, ``buffer``) is the wrapped stream's, so
    tqdm, logging and ``print`` see the console they expect."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self._stream = stream
        self.lost: BaseException | None = None  # the error that ended this console, if any

    @property
    def wrapped(self) -> TextIO:
        """The stream this one protects."""
        return self._stream

    def _give_up(self, exc: BaseException) -> None:
        """The console is gone: later writes go to ``os.devnull``; pending text is dropped."""
        if self.lost is None:
            self.lost = exc
        try:
            fd = self._stream.fileno()
        except (OSError, ValueError, AttributeError):
            return
        try:
            _to_devnull(fd)
            # The text still buffered for the dead console is written to os.devnull now.
            self._stream.flush()
        except (OSError, ValueError):
            pass

    def write(self, text: str) -> int:  # noqa: D102 - io.TextIOBase's
        try:
            return self._stream.write(text)
        except (OSError, ValueError) as exc:
            self._give_up(exc)
            return len(text)

    def writelines(self, lines: Any) -> None:  # noqa: D102
        for line in lines:
            self.write(line)

    def flush(self) -> None:  # noqa: D102
        try:
            self._stream.flush()
        except (OSError, ValueError) as exc:
            self._give_up(exc)

    def close(self) -> None:  # noqa: D102 - the process's console is not ours to close
        self.flush()

    @property
    def closed(self) -> bool:  # noqa: D102
        return False

    def writable(self) -> bool:  # noqa: D102
        return True

    def isatty(self) -> bool:  # noqa: D102
        try:
            return self._stream.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:  # noqa: D102
        return self._stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]  # noqa: D102
        return self._stream.encoding

    @property
    def errors(self) -> str | None:  # type: ignore[override]  # noqa: D102
        return self._stream.errors

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _reopened(fd: int, current: TextIO | None) -> TextIO:
    """``current``, or a new line-buffered text stream on ``fd`` where Python found the
    descriptor closed at start (``sys.stdout`` is then None)."""
    if current is not None:
        return current
    return open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace",
                closefd=False)


def protect_console() -> None:
    """Make the console unable to fail the run (this module's docstring): closed standard
    descriptors are opened on ``os.devnull``; ``sys.stdout`` and ``sys.stderr`` become
    :class:`SafeStream`. Idempotent: a forked rank inherits its launcher's and keeps them."""
    for fd in STANDARD_FDS:
        if not _is_open(fd):
            _to_devnull(fd)
    if sys.stdin is None:
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - the process's
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if not isinstance(stream, SafeStream):
            setattr(sys, name, SafeStream(_reopened(fd, stream)))
