"""Where ``ddp-exp prepare`` writes (:mod:`ddp_exp.data.prepare_text`): its work folder beside
``--out`` (:class:`WorkFolder`), the leftovers of killed prepares (:func:`remove_leftovers`),
the one line for an ``--out`` that cannot be written (:func:`out_error`), and the ``data.path=``
override it prints, quoted to work pasted into a shell (:func:`shell_override`).

Leftovers of a killed prepare (``kill -9``, a lost machine): the work folder is
``.<name of out>.<8 characters>`` and its lock ``.<name of out>.<8 characters>.lock`` beside
it, ``flock``-ed by the prepare that writes the folder for as long as it exists (created
before the folder, removed after it is renamed or deleted). Each prepare first removes, beside
its ``out``, every such folder (and ``.old`` folder, and lock) whose lock it can take (its
prepare is gone: the kernel drops a dead process's locks; Linux's NFS client takes them on the
server, so a prepare running on another machine is seen) or whose lock file is missing (a
leftover of a ddp_exp before the locks; a prepare of this version never has a work folder
without its lock). A folder another prepare still writes is never removed.

May use: :mod:`ddp_exp.config` (``ConfigError``), :mod:`ddp_exp.io.files` (a full disk);
Hydra's override parser (:func:`hydra_value`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shlex
import shutil

from ddp_exp.config.errors import ConfigError
from ddp_exp.io.files import is_disk_full


class _WriteFailed(Exception):
    """An ``OSError`` of writing the work folder, carried to :class:`WorkFolder`'s exit (which
    measures and removes the folder before it names the cause: :func:`out_error`)."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


@contextlib.contextmanager
def writing():
    """Around a write into the work folder: its ``OSError`` is the output's fault, not a
    source's (reads stay outside)."""
    try:
        yield
    except OSError as e:
        raise _WriteFailed(e) from e


class WorkFolder:
    """The folder a prepare writes beside ``out``, its lock, and the folders made above it (the
    module docstring says the names and the rule for leftovers).

    Entering removes dead prepares' leftovers (:func:`remove_leftovers`), makes the missing
    folders above ``out``, the lock (held until exit) and the folder (mode as ``mkdir``'s under
    the umask: it becomes ``out``). :meth:`land` renames it to ``out``. Leaving on an error
    removes the folder, the lock and the folders made above ``out``.

    Raises:
        ConfigError: ``out`` cannot be written (:func:`out_error`), on entering or for a write
            inside (:func:`writing`).
    """

    def __init__(self, out: str):
        self.out = out
        self.target = os.path.abspath(out)
        self.parent, self.name = os.path.split(self.target)
        self.path: str | None = None
        self.lock: str | None = None
        self.lock_fd: int | None = None
        self.made: list[str] = []

    def __enter__(self) -> WorkFolder:
        try:
            self._create()
        except OSError as e:
            self._remove(self.made)
            raise out_error(self.out, e) from None
        return self

    def __exit__(self, kind, exc, tb) -> None:
        written = _tree_bytes(self.path) if exc is not None and self.path else None
        self._remove(self.made if exc is not None else [])
        if isinstance(exc, _WriteFailed):
            raise out_error(self.out, exc.error, written) from None

    def land(self) -> None:
        """Rename the folder to ``out``, replacing an earlier prepared folder there (moved to
        ``<folder>.old`` first, under the same lock, and put back if the rename fails)."""
        assert self.path is not None
        with writing():
            if os.path.isdir(self.target):
                old = self.path + ".old"
                os.replace(self.target, old)
                try:
                    os.replace(self.path, self.target)
                except OSError:
                    os.replace(old, self.target)
                    raise
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(self.path, self.target)

    def _create(self) -> None:
        missing, folder = [], self.parent
        while not os.path.exists(folder) and os.path.dirname(folder) != folder:
            missing.append(folder)
            folder = os.path.dirname(folder)
        for folder in reversed(missing):
            os.mkdir(folder)
            self.made.append(folder)
        remove_leftovers(self.parent, self.name)
        while True:
            lock = os.path.join(self.parent, f".{self.name}.{secrets.token_hex(4)}.lock")
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
            except FileExistsError:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(fd, lock):  # not unlinked as a stale lock before it was taken
                break
            os.close(fd)
        self.lock, self.lock_fd = lock, fd
        self.path = lock[:-len(".lock")]
        os.mkdir(self.path)

    def _remove(self, made: list[str]) -> None:
        if self.path is not None:
            for path in (self.path, self.path + ".old"):
                shutil.rmtree(path, ignore_errors=True)
        if self.lock is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.lock)
        if self.lock_fd is not None:
            os.close(self.lock_fd)
        self.path = self.lock = self.lock_fd = None
        for folder in reversed(made):  # the folders made above out, innermost first
            try:
                os.rmdir(folder)
            except OSError:
                break


def remove_leftovers(parent: str, name: str) -> list[str]:
    """Remove the work folders, ``.old`` folders and locks of dead prepares of ``out`` =
    ``parent/name`` (the module docstring's rule: a lock that can be taken or is missing);
    returns the paths removed. A folder whose lock another prepare holds is kept."""
    pattern = re.compile(rf"\.{re.escape(name)}\.([a-z0-9_]{{8}})(\.old|\.lock)?")
    try:
        keys = sorted({m.group(1) for n in os.listdir(parent) if (m := pattern.fullmatch(n))})
    except OSError:
        return []
    removed = []
    for key in keys:
        base = os.path.join(parent, f".{name}.{key}")
        try:
            fd = os.open(base + ".lock", os.O_RDONLY)
        except FileNotFoundError:
            fd = None  # no lock: no prepare of this version writes it
        except OSError:
            continue  # cannot tell: kept
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # held: a prepare still writes it
                if not _same_file(fd, base + ".lock"):
                    continue  # removed meanwhile by another prepare's clean-up
            for path in (base, base + ".old"):
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
            if fd is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(base + ".lock")
                    removed.append(base + ".lock")
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` is still the file open as ``fd`` (a lock file not unlinked since)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def _tree_bytes(path: str) -> int:
    """The bytes of the files under ``path``."""
    total = 0
    for root, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, n)).st_size
    return total


def out_error(out: str, error: OSError, written: int | None = None) -> ConfigError:
    """The one line for ``--out`` that cannot be written: it lies under a file, its disk is
    full (the bytes ``written`` before it filled, those free now), it is not writable, or it
    cannot be created (``/proc/x``); each with the cause and the fix."""
    target, existing = os.path.abspath(out), os.path.abspath(out)
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if existing != target and not os.path.isdir(existing):
        return ConfigError(f"--out={out} lies under {existing}, a file, not a folder: give "
                           "--out a path in a folder")
    cause = error.strerror or str(error)
    if is_disk_full(error):
        free = shutil.disk_usage(existing).free if os.path.isdir(existing) else 0
        done = "" if written is None else f"{_size(written)} written before it filled, "
        return ConfigError(f"--out={out}: the disk that holds it is full ({cause}; {done}"
                           f"{_size(free)} free there now): free space there, or give --out a "
                           "folder on another disk")
    folder = existing if os.path.isdir(existing) else os.path.dirname(existing)
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ConfigError(f"--out={out} is not writable ({cause} in {folder}): give --out a "
                           "folder you can write in")
    return ConfigError(f"--out={out} cannot be created ({cause} in {folder}): give --out a "
                       "folder that can be created and written")


def _size(count: int) -> str:
    """``1,295 bytes``, ``12.3 MB``: a size for a line (MB = 10^6 bytes)."""
    return (f"{count:,} byte{'' if count == 1 else 's'}" if count < 10**6
            else f"{count / 1e6:,.1f} MB")


def shell_override(key: str, value: str) -> str:
    """``key=value`` as one word that works pasted into a POSIX shell: the value quoted for
    Hydra's override grammar where it needs it (:func:`hydra_value`), the whole word quoted for
    the shell (``shlex.quote``). ``data.path=/tmp/prep`` stays as it is."""
    return shlex.quote(f"{key}={hydra_value(value)}")


def hydra_value(value: str) -> str:
    """``value`` as Hydra's override grammar reads back the same string: as it is where Hydra's
    own parser gives it back (no whitespace; ``123``, ``true``, ``a,b``, ``dür`` or ``(x)``
    do not), else in double quotes (single where the value holds a ``"`` and no ``'``) with
    the quote and the backslashes before it escaped (Hydra's "Quoted values" rules,
    hydra.cc/docs/advanced/override_grammar/basic)."""
    if value and not any(c.isspace() for c in value):
        from hydra.core.override_parser.overrides_parser import OverridesParser

        try:
            parsed = OverridesParser.create().parse_overrides([f"key={value}"])[0].value()
        except Exception:  # the parser's own errors: not readable as it is
            parsed = None
        if parsed == value and isinstance(parsed, str):
            return value
    quote = "'" if '"' in value and "'" not in value else '"'
    escaped = re.sub(rf"(\\+)(?={quote}|$)", lambda m: m.group(1) * 2, value)
    return quote + escaped.replace(quote, "\\" + quote) + quote
