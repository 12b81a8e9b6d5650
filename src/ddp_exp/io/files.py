"""Files that are never half-written: temp file in the same folder, fsync, atomic rename; the
background thread that writes the training loop's checkpoints in order; and why a file that
``torch.load`` read could not be loaded (:func:`load_failure`)."""

from __future__ import annotations

import errno
import glob
import json
import os
import queue
import re
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any, BinaryIO

from ddp_exp.compat import messages


def process_umask() -> int:
    """This process's umask, read without changing it where the kernel shows it
    (``/proc/self/status``, Linux 4.7+). Elsewhere it is set to 0 and back (``os.umask`` has
    no read-only form): a file another thread creates in between gets mode 0666. The
    checkpoint writer asked at every file, beside the loop's and TensorBoard's threads."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


# errno values of a full disk: no space left, or the user's quota there used up.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class DiskFull(OSError):
    """A write failed because the disk that holds ``filename`` is full (``ENOSPC``) or the
    user's quota there is used up (``EDQUOT``); ``str()`` is one line naming the path. An
    ``OSError`` from a file object's write names no path (R16, pytorch/pytorch #10577)."""

    def __str__(self) -> str:
        return (f"no space left on the disk that holds {self.filename} ([Errno {self.errno}] "
                f"{self.strerror}): free space there, or give hydra.run.dir a folder on "
                "another disk")


def is_disk_full(exc: BaseException) -> bool:
    """True for an ``OSError`` of a full disk or quota (:data:`DISK_FULL_ERRNOS`)."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def read_text(path: str) -> str:
    """The text of ``path``; ``""`` when it cannot be read (missing, a folder, no permission)."""
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""


def naming_the_disk(exc: BaseException, path: str) -> BaseException:
    """``exc`` itself, or, for a full disk whose error names no file (a write through an open
    file object, TensorBoard's writer thread), a :class:`DiskFull` naming ``path`` (the folder
    written to: the job folder), so that the line a user reads says which disk."""
    if is_disk_full(exc) and not isinstance(exc, DiskFull):
        named = DiskFull(exc.errno, exc.strerror, exc.filename or os.path.abspath(path))
        named.__cause__ = exc
        return named
    return exc


def read_json(path: str) -> Any:
    """The JSON value in ``path``; None when it cannot be read or parsed (missing, partial)."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def atomic_write(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(fh)`` on a temp file beside ``path``, fsync it, then ``os.replace`` it onto
    ``path``; a reader sees the old file or the complete new one, never part of one (POSIX
    rename is atomic within a file system). The temp file is removed if ``write`` fails.
    ``path``'s folder is made first if it does not exist (a resume from another run's
    checkpoint into a fresh job folder wrote ``checkpoints/`` files before any checkpoint).

    Raises:
        DiskFull: the disk (or quota) that holds ``path`` is full; ``path`` keeps what it held.
        OSError: any other failure to write or rename.
    """
    folder = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                   dir=folder)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~process_umask())  # mkstemp makes 0600; give the usual permissions
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if is_disk_full(exc) and not isinstance(exc, DiskFull):
            raise DiskFull(exc.errno, exc.strerror, os.path.abspath(path)) from None
        raise


# ioctl(2) FICLONE (linux/fs.h: _IOW(0x94, 9, int)): a copy-on-write clone of a whole file where
# the file system offers one (btrfs, XFS with reflink, bcachefs, overlayfs on those).
_FICLONE = 0x40049409
_COPY_CHUNK = 1 << 24  # bytes per copy_file_range call


def _copy_into(src: BinaryIO, dst: BinaryIO) -> None:
    """The bytes of ``src`` into the empty ``dst``: a copy-on-write clone (``FICLONE``) where
    the file system offers one, else ``os.copy_file_range`` (in the kernel, no trip through
    Python), else a plain buffered copy (a file system or kernel that offers neither)."""
    try:
        import fcntl

        fcntl.ioctl(dst.fileno(), _FICLONE, src.fileno())
        return
    except (ImportError, OSError):
        pass
    copy_range = getattr(os, "copy_file_range", None)
    if copy_range is not None:
        try:
            while copy_range(src.fileno(), dst.fileno(), _COPY_CHUNK):
                pass
            return
        except OSError as exc:  # EXDEV, EINVAL, ENOSYS, EOPNOTSUPP: not here
            if is_disk_full(exc):
                raise
        src.seek(0)
        dst.seek(0)
        dst.truncate()
    import shutil

    shutil.copyfileobj(src, dst, _COPY_CHUNK)


def copy_file(src: str, dst: str) -> None:
    """Put a copy of ``src`` at ``dst`` atomically (:func:`atomic_write`: a temp file beside
    ``dst``, fsynced, renamed): a file of its own, never a second name of ``src``'s inode, so
    that damage to one (``truncate -s 0``, a copy that stopped) leaves the other loadable. A
    copy-on-write clone where the file system offers one (no data copied), else a copy in the
    kernel (:func:`_copy_into`). Uses no hard link: works where ``os.link`` is refused
    (exFAT, some network mounts; Lightning #18900).

    Raises:
        DiskFull: the disk (or quota) that holds ``dst`` is full; ``dst`` keeps what it held.
        OSError: ``src`` cannot be read, or any other failure to write or rename.
    """
    with open(src, "rb") as source:
        atomic_write(dst, lambda fh: _copy_into(source, fh))


_unwritten_reported: set[str] = set()


def best_effort(path: str, write: Callable[[], None], reported: str | None = None) -> bool:
    """Run ``write()``, the write of a bookkeeping file at ``path`` (``status.json``, an error
    file's copy, a sweep's summary) that must not hide the run's own outcome: an ``OSError``
    (a full disk above all) ends in one ``warning:`` line on stderr naming the path, at most
    one line per process for a full disk, and none where ``reported`` (the run's own error
    line) says already that the disk is full. Returns True when ``write`` succeeded."""
    try:
        write()
        return True
    except OSError as exc:
        full = is_disk_full(exc)
        line = str(exc) if isinstance(exc, DiskFull) else (
            str(DiskFull(exc.errno, exc.strerror, path)) if full else f"{path}: {exc}")
        said = "disk full" in _unwritten_reported
        if full:
            _unwritten_reported.add("disk full")
            if said or (reported and "no space left on the disk" in reported):
                return False
        print(f"warning: {os.path.basename(path)} not written: {line}", file=sys.stderr,
              flush=True)
        return False


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


def remove_partial_trees(folder: str, keep: str | None = None) -> list[str]:
    """Delete the temp folders (``.<name>.tmp``) that writers killed mid-write left in
    ``folder`` (a sharded checkpoint's), but ``keep`` (one being written now). Returns the
    paths removed."""
    import shutil

    removed = []
    for path in glob.glob(os.path.join(folder, ".*.tmp")):
        if os.path.isdir(path) and (keep is None or os.path.normpath(path)
                                    != os.path.normpath(keep)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class BackgroundWriter:
    """Runs file-writing jobs on one background thread, in the order they were submitted, so
    that the caller does not wait for the disk.

    Why: ``os.fsync`` of each epoch's checkpoint blocked rank 0 for 1-5 ms, and the epoch after
    it trained slower, although the fsync itself is outside the loop's clock. Runs pinned to
    one core each, side by side, job folder on this machine's virtio disk while other jobs
    wrote to it: the loop's samples/s 1.6-3.5x higher with the wait here than on rank 0's own
    thread, every pair (docs/benchmarks.md, issue 13). Each file is still fsynced before it is
    renamed into place (:func:`atomic_write`), so a reader, a killed run or a power cut sees
    the previous complete file or the new one.

    The caller snapshots what a job writes before submitting it (e.g. a checkpoint's tensors
    cloned at that moment, held in memory until serialized and written there). A job's
    exception is raised by the next :meth:`submit` or by :meth:`wait` (e.g. ``OSError`` for a
    full disk): one epoch later than a synchronous write, never lost.
    """

    def __init__(self, name: str = "ddp_exp-writer"):
        self._name = name
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._submitted = 0  # jobs handed over (the caller's thread)
        self._done = 0  # jobs run (the writer's thread), under _ran
        self._ran = threading.Condition()
        self._errors: list[BaseException] = []  # failures not raised yet

    def submit(self, job: Callable[[], object]) -> None:
        """Run ``job()`` after every job submitted before it.

        The caller's cost is one queue ``put``: ``ThreadPoolExecutor.submit`` (a ``Future``
        with its ``Condition``, two locks, a semaphore) cost the loop's thread ~15 us warm and
        ~40 us after an epoch's steps, at every epoch's checkpoint (issue 42).

        Raises:
            Exception: the first failure of an earlier job, if one has failed since the last
                check (then ``job`` is not submitted).
        """
        self._raise_failed()
        if self._thread is None:  # the thread starts with the first job
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._serve, args=(self._jobs,),
                                            name=self._name)
            self._thread.start()
        self._submitted += 1
        self._jobs.put(job)  # type: ignore[union-attr]

    def idle(self) -> bool:
        """Whether every submitted job has run (its failure, if any, not raised yet)."""
        return self._done == self._submitted

    def wait(self) -> None:
        """Block until every submitted job has run.

        Raises:
            Exception: the first job's failure, if any (the other jobs have still run).
        """
        with self._ran:
            self._ran.wait_for(self.idle)
        self._raise_failed()

    def close(self) -> None:
        """:meth:`wait`, then stop the thread (a later :meth:`submit` starts a new one)."""
        try:
            self.wait()
        finally:
            if self._thread is not None:
                self._jobs.put(None)  # type: ignore[union-attr]
                self._thread.join()
                self._thread = self._jobs = None

    def _raise_failed(self) -> None:
        if self._errors:
            error = self._errors.pop(0)
            self._errors.clear()  # the first is raised; the others ran after it
            raise error

    def _serve(self, jobs: queue.SimpleQueue) -> None:
        """The writer's thread: run each job in order until :meth:`close`'s ``None``. It also
        ends once the main thread has ended and nothing is queued (a process that exits
        without :meth:`close`, as a ``ThreadPoolExecutor``'s thread does: the jobs submitted
        run first), so that it never holds the interpreter's exit."""
        while True:
            try:
                job = jobs.get(timeout=0.5)
            except queue.Empty:
                if not threading.main_thread().is_alive():
                    return
                continue
            if job is None:
                return
            try:
                job()
            except BaseException as exc:  # raised by the next submit or wait
                self._errors.append(exc)
            with self._ran:
                self._done += 1
                self._ran.notify_all()


_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;]*m")


def load_failure(exc: BaseException) -> str:
    """Why ``torch.load(path, weights_only=True)`` failed, in one line without terminal codes:
    the object that loading refused (torch's own text spans eight lines), a file that is not a
    complete ``torch.save`` file (truncated or corrupt: a zip archive without its directory, a
    read past the end, a legacy pickle that makes no sense), or the error's first sentence."""
    text = _TERMINAL_CODES.sub("", str(exc))
    refused = messages.torch_load_refused(text)
    if refused:
        return (f"it holds a Python object ({refused}) that is not a tensor or a plain "
                "container; files are loaded with weights_only=True, so that loading one runs "
                "no code")
    first = (messages.torch_load_reason(text) or
             next((ln.strip() for ln in text.splitlines() if ln.strip()), "no detail"))
    first = first.split(". ")[0][:200]
    # What the weights-only unpickler raises on bytes that are no pickle (a text file such as
    # /etc/passwd: IndexError from its stack, 71 of 400 fuzzed files; KeyError, EOFError and
    # UnicodeDecodeError from the rest), beside torch's own wording (messages).
    broken = (messages.torch_load_broken(exc, text)
              or isinstance(exc, (EOFError, KeyError, IndexError, UnicodeDecodeError))
              or (isinstance(exc, OSError) and exc.errno == errno.EINVAL))
    if broken:  # the reader's own words (EINVAL, "zip archive") say nothing more to a user
        return "not a complete torch.save file: truncated or corrupt"
    return f"{type(exc).__name__}: {first}"
