"""Who may use a job folder: its lock, the ``.hydra/`` record the lock file keeps, and the
refusals (busy, finished already, holding an earlier run).

:func:`job_folder_lock`: the entry holds ``.hydra/.ddp_exp.lock`` while a world uses the folder
(``filelock``'s ``FileLock``), and keeps in it a copy of the ``.hydra/`` record of the run that
last held it, put back when a run is refused there (:class:`JobFolderBusy`,
:class:`AlreadyComplete`); :func:`previous_record` gives :mod:`ddp_exp.job.earlier_run` the
record of the run that last held the folder. :mod:`ddp_exp.job.folder` re-exports these names.

May use: :mod:`ddp_exp.config` (``ConfigError``), :mod:`ddp_exp.io.files` (atomic writes),
:mod:`ddp_exp.job.outputs` (what a refused run's folder holds).
"""

from __future__ import annotations

import contextlib
import json
import os

from ddp_exp.config.errors import ConfigError
from ddp_exp.io.files import atomic_write, read_text
from ddp_exp.job.outputs import earlier_outputs

LOCK_FILE = ".ddp_exp.lock"
HYDRA_RECORD = ("config.yaml", "hydra.yaml", "overrides.yaml")  # what Hydra writes in .hydra/


class LeaveFolderAlone(ConfigError):
    """An error after which this job must not write into its folder (another run's)."""


class AlreadyComplete(LeaveFolderAlone):
    """``trainer.resume`` points at a run that has already trained all its epochs (or stopped
    early): the single run says so and exits 0, a sweep skips the job."""


class JobFolderBusy(LeaveFolderAlone):
    """Another running job holds the job folder."""


class FolderHoldsRun(LeaveFolderAlone):
    """The job folder holds an earlier run's outputs and ``trainer.resume`` is not set."""


# The .hydra/ record of the run that last held each job folder before this process took its
# lock (job_folder_lock): job folder (absolute) -> record.
_previous_records: dict[str, dict[str, str]] = {}


def previous_record(job_dir: str) -> dict[str, str] | None:
    """The ``.hydra/`` record (file name -> text) of the run that held ``job_dir`` before this
    process took its lock (:func:`job_folder_lock`); None when this process holds no lock
    there (under torchrun, a rank other than 0)."""
    return _previous_records.get(os.path.abspath(job_dir))


@contextlib.contextmanager
def job_folder_lock(job_dir: str, hydra_dir: str | None = None):
    """Hold an exclusive lock on the job folder while a world uses it: ``filelock``'s
    ``FileLock`` (an ``flock``, which ends with the process that holds it, even when killed).

    Hydra rewrites ``hydra_dir`` (``.hydra/``: config, overrides) before any job code runs, so
    the lock file also keeps a copy of the record of the run that last held it: a run refused
    here (folder busy, or nothing left to train) puts that record back, and the folder keeps
    describing what was trained in it. The lock file is ``<hydra_dir>/.ddp_exp.lock`` (in the
    job folder itself only with ``hydra.output_subdir=null``), kept on release
    (``preserve_lock_file``: it holds the record), out of sight, so a finished run's folder
    shows no lock file that would make it look in use.

    Raises:
        JobFolderBusy: another run holds it (two runs given the same ``hydra.run.dir`` would
            mix their event streams, checkpoints and metrics).
        LeaveFolderAlone: the folder's file system cannot lock (no ``flock``: some network
            mounts).
    """
    from filelock import FileLock, Timeout

    os.makedirs(job_dir, exist_ok=True)
    path = lock_file(job_dir, hydra_dir)
    previous = _parse_record(read_text(path)) or _parse_record(read_text(
        os.path.join(job_dir, LOCK_FILE)))  # a folder of an earlier version's run
    # preserve_lock_file: the file outlives the hold (it keeps the record), and no soft-lock
    # fallback writes its own marker over the record.
    lock = FileLock(path, blocking=False, preserve_lock_file=True)
    try:
        lock.acquire()
    except Timeout:
        _restore_record(hydra_dir, previous)
        raise JobFolderBusy(f"hydra.run.dir={job_dir!r} is in use by another running job; "
                            "give this run its own folder") from None
    except OSError as exc:  # no flock there (some network mounts): whose folder is unknown
        _restore_record(hydra_dir, previous)
        raise LeaveFolderAlone(f"hydra.run.dir={job_dir!r}: cannot lock {path} ("
                               f"{exc.strerror or exc}); give the run a folder on a local "
                               "disk") from None
    _previous_records[os.path.abspath(job_dir)] = previous  # for killed_first_epoch
    try:
        _write_record(path, _read_record(hydra_dir))
        yield
    except ConfigError as exc:  # refused before training: the folder's record stays
        if isinstance(exc, LeaveFolderAlone) or (previous and earlier_outputs(job_dir)):
            _restore_record(hydra_dir, previous)
            _write_record(path, previous)
            exc.folder_kept = True  # __main__ then writes no status.json either
        raise
    finally:
        lock.release()


def lock_file(job_dir: str, hydra_dir: str | None) -> str:
    """The job folder's lock file: under ``hydra_dir`` (``.hydra/``) when Hydra made one."""
    folder = hydra_dir if hydra_dir and os.path.isdir(hydra_dir) else job_dir
    return os.path.join(folder, LOCK_FILE)


def _read_record(hydra_dir: str | None) -> dict[str, str]:
    if not hydra_dir or not os.path.isdir(hydra_dir):
        return {}
    record = {}
    for name in sorted(os.listdir(hydra_dir)):
        if name.endswith(".yaml"):
            with open(os.path.join(hydra_dir, name)) as f:
                record[name] = f.read()
    return record


def _parse_record(text: str) -> dict[str, str]:
    try:
        record = json.loads(text) if text.strip() else {}
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _write_record(path: str, record: dict[str, str]) -> None:
    """Write ``record`` into the lock file in place (the same inode: the lock is on it)."""
    with open(path, "w") as fh:
        fh.write(json.dumps(record))


def _restore_record(hydra_dir: str | None, record: dict[str, str]) -> None:
    """Put the previous run's ``.hydra/`` files back (atomically, each)."""
    if not hydra_dir or not record:
        return
    for name, text in record.items():
        atomic_write(os.path.join(hydra_dir, os.path.basename(name)),
                     lambda f, text=text: f.write(text.encode()))


