"""The job folder's lifecycle: one Hydra job's output folder from Hydra's ``mkdir`` to its status.

What happens to ``hydra.run.dir`` (or a sweep job's folder) around the training, in order:

* :func:`job_folder_lock`: the entry holds ``.hydra/.ddp_exp.lock`` while a world uses the
  folder, and keeps in it a copy of the ``.hydra/`` record of the run that last held it, put
  back when a run is refused there (:class:`JobFolderBusy`, :class:`AlreadyComplete`): the
  lock and the refusals are :mod:`ddp_exp.job.lock`'s, their names re-exported here;
* what an earlier run left, and whether a new run may start over it
  (:class:`FolderHoldsRun`), is :mod:`ddp_exp.job.earlier_run`'s; :func:`previous_record` gives
  it the record of the run that last held the folder;
* :func:`clear_errors` at the start of a run, :func:`keep_error_files` when a rank failed
  (``errors/rank<R>.json``), :func:`remove_partial_files` once every rank has ended;
* :func:`write_status`: ``status.json`` (completed, failed or interrupted), read back by the
  sweep summary (:mod:`ddp_exp.job.sweep`); :func:`record_unstarted_interrupt` writes it for a
  job stopped after Hydra made its folder and before its task ran;
* :func:`remove_refused_folder`: a single run refused before any rank started leaves no folder
  it created (:class:`NewFoldersCallback` notes which, before Hydra makes them).

May use: :mod:`ddp_exp.io.files` (atomic writes, temp-file clean-up), :mod:`ddp_exp.io.checkpoint`
(the checkpoints folder's name), :mod:`ddp_exp.job.lock`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Sequence
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from ddp_exp.io import checkpoint
from ddp_exp.io.files import atomic_write, best_effort, copy_file, remove_partial
from ddp_exp.job import record
from ddp_exp.job.lock import (  # noqa: F401  (re-exported: the job folder's names, one place)
    HYDRA_RECORD,
    LOCK_FILE,
    AlreadyComplete,
    FolderHoldsRun,
    JobFolderBusy,
    LeaveFolderAlone,
    job_folder_lock,
    lock_file,
    previous_record,
)

log = logging.getLogger("ddp_exp")

STATUS_FILE = "status.json"
ERRORS_DIR = "errors"


# The folders a single run's start creates, noted by NewFoldersCallback before Hydra makes them:
# the run's folder (absolute) -> the topmost folder on its path that did not exist yet, None
# when the run's folder already existed.
_created: dict[str, str | None] = {}


def note_new_folders(job_dir: str) -> None:
    """Note which folders on the path to ``job_dir`` do not exist yet: those that making it
    creates, and that :func:`remove_refused_folder` may remove. Call before the folder is made.
    """
    job_dir = path = os.path.abspath(job_dir)
    top = None
    while not os.path.exists(path):
        top, path = path, os.path.dirname(path)
    _created[job_dir] = top


def existed_before(job_dir: str) -> bool:
    """Whether this single run's folder ``job_dir`` existed before its start made it (noted by
    :class:`NewFoldersCallback`: a ``hydra.run.dir`` given again). False when it is new, or
    not known (a sweep's job, a rank under torchrun)."""
    job_dir = os.path.abspath(job_dir)
    return job_dir in _created and _created[job_dir] is None


class NewFoldersCallback(Callback):
    """Hydra callback (``hydra.callbacks.new_folders`` in ``conf/config.yaml``): at the start of
    a single run, before Hydra makes ``hydra.run.dir``, note which folders this process creates
    (:func:`note_new_folders`). A folder left unnoted is kept by a refused run."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig

        hydra_config = HydraConfig.instance()
        before = hydra_config.cfg
        try:  # set as Hydra's run_job sets it next, so that ${hydra:...} resolves
            hydra_config.set_config(config)
            run_dir = OmegaConf.select(config, "hydra.run.dir")  # ${now:}, run_stamp: cached
        except Exception:  # a resolver's error: Hydra reports it when it makes the folder
            return
        finally:
            hydra_config.cfg = before
        if run_dir is not None:
            note_new_folders(str(run_dir))


def remove_refused_folder(job_dir: str, hydra_subdir: str | None, log_file: str | None) -> bool:
    """Delete the folder of a single run refused before any rank started, when this process
    created it (:class:`NewFoldersCallback`) and it holds only what this run's start made:
    Hydra's ``.hydra/`` record, the job log and the lock file. Parent folders this process
    created on the way and left empty go too (``outputs/runs/<date>/``). A folder that existed
    before (the tasks of a ``launcher.cluster`` job share one; a ``hydra.run.dir`` given
    again), or that holds anything else (an earlier run's outputs, ``status.json``, the user's
    own files), stays as it was.

    Returns:
        True when the folder was removed.
    """
    job_dir = os.path.abspath(job_dir)
    top = _created.get(job_dir)
    if top is None:  # not created by this process, or not known to be
        return False
    made = {LOCK_FILE}
    if hydra_subdir:
        made.add(hydra_subdir)
    if log_file and os.path.dirname(os.path.abspath(log_file)) == job_dir:
        made.add(os.path.basename(log_file))
    try:
        names = set(os.listdir(job_dir))
        record = (set(os.listdir(os.path.join(job_dir, hydra_subdir)))
                  if hydra_subdir and hydra_subdir in names else set())
    except OSError:
        return False
    if not names <= made or not record <= {*HYDRA_RECORD, LOCK_FILE}:
        return False
    shutil.rmtree(job_dir, ignore_errors=True)
    _remove_empty_new_folders(os.path.dirname(job_dir), top)
    return not os.path.exists(job_dir)


def remove_new_empty_folder(path: str) -> None:
    """Remove ``path`` if this process created it (:func:`note_new_folders`) and it is empty,
    and the folders created on the way to it that are left empty: what a sweep refused before
    its first job leaves (:func:`ddp_exp.job.sweep.discard_refused_sweep`)."""
    path = os.path.abspath(path)
    top = _created.get(path)
    if top is not None:
        _remove_empty_new_folders(path, top)


def _remove_empty_new_folders(path: str, top: str) -> None:
    """``os.rmdir`` ``path`` and its parents up to and including ``top`` while they are empty."""
    while path == top or path.startswith(top + os.sep):
        try:
            os.rmdir(path)
        except OSError:
            break
        path = os.path.dirname(path)


def job_log_file() -> str | None:
    """The job log (the root logger's file handler, set up by Hydra), or None."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return handler.baseFilename
    return None


def log_to_job_log_only(level: int, text: str) -> None:
    """Write ``text`` to the job log (``ddp_exp.log``), not to the console."""
    logger = logging.getLogger("ddp_exp")
    record = logger.makeRecord(logger.name, level, __file__, 0, text, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def write_status(job_dir: str, status: str, overrides: Sequence[str], wall_s: float,
                 error: str | None = None, pruned_at_epoch: int | None = None) -> None:
    """Write ``<job_dir>/status.json`` atomically: ``completed``, ``failed`` or
    ``interrupted``; a trial that hydra/sweeper=ddp_optuna's pruner stopped also has
    ``pruned: true`` and ``pruned_at_epoch`` (its status stays ``completed``). Best-effort
    (:func:`ddp_exp.io.files.best_effort`): a status that cannot be written (a full disk) is one
    ``warning:`` line, or none where ``error`` says the disk is full already; the run's exit
    status stays its own."""
    payload = {"status": status, "overrides": list(overrides), "wall_s": wall_s,
               "error": error}
    if pruned_at_epoch is not None:
        payload.update(pruned=True, pruned_at_epoch=pruned_at_epoch)
    text = json.dumps(payload, indent=2) + "\n"
    path = os.path.join(job_dir, STATUS_FILE)
    best_effort(path, lambda: atomic_write(path, lambda fh: fh.write(text.encode())), error)
    best_effort(path, lambda: record.write_end(job_dir, status, wall_s), error)  # run.json


def record_unstarted_interrupt(signal_name: str, job_log: str | None) -> str | None:
    """After Ctrl-C or SIGTERM outside a job's task: write ``status.json`` (``interrupted``)
    into the folder Hydra made for this process's job, if the job's task never ran there.

    Hydra makes a job's folder, its job log (``job_log``, the root logger's file) and
    ``.hydra/`` before it calls the task; a signal in between left the folder without a
    status (a sweep's summary then listed the job as ``incomplete``). Only a folder that holds
    nothing else (the job log, and a folder of Hydra's record files) is written to: one with a
    status, another run's outputs or a lock (a run that may still be going) is left as it is.

    Returns:
        The folder written to, or None.
    """
    if job_log is None:
        return None
    job_dir = os.path.dirname(os.path.abspath(job_log))
    try:
        others = [e for e in os.scandir(job_dir) if e.name != os.path.basename(job_log)]
        record = [e for e in others if e.is_dir() and set(os.listdir(e.path)) <= set(
            HYDRA_RECORD)]
    except OSError:
        return None
    if len(others) > 1 or len(record) != len(others):
        return None
    overrides: list[str] = []
    if record:
        with contextlib.suppress(Exception):
            overrides = [str(o) for o in OmegaConf.load(os.path.join(record[0].path,
                                                                     "overrides.yaml"))]
    why = f"stopped by {signal_name} before the job started"
    log_to_job_log_only(logging.ERROR, why)
    write_status(job_dir, "interrupted", overrides, 0.0, why)
    return job_dir


def clear_errors(job_dir: str) -> None:
    """Delete ``<job_dir>/errors/`` at the start of a run: an earlier attempt's error files
    would contradict this run's status."""
    shutil.rmtree(os.path.join(job_dir, ERRORS_DIR), ignore_errors=True)


def keep_error_files(exc, job_dir: str) -> None:
    """Copy each failed rank's error file (its exception and traceback, written by ``@record``)
    from the agent's temporary folder to ``<job_dir>/errors/rank<R>.json``, and point the
    failure table at the copy: the temporary folder is gone once the launch returns.

    Args:
        exc: torch's ``ChildFailedError`` (its ``failures``: global rank -> ``ProcessFailure``).
    """
    for rank, failure in exc.failures.items():
        if os.path.isfile(failure.error_file):
            kept = os.path.join(job_dir, ERRORS_DIR, f"rank{rank}.json")

            def copy(source: str = failure.error_file, kept: str = kept) -> None:
                os.makedirs(os.path.dirname(kept), exist_ok=True)
                copy_file(source, kept)  # whole or not at all: a full disk left 0 bytes

            # Best-effort: on a full disk the failure's own line says so (R16).
            reported = "no space left on the disk" if _names_full_disk(failure) else None
            if best_effort(kept, copy, reported):
                failure.error_file = kept
            else:
                failure.error_file = f"<not kept: {kept} could not be written>"
        else:  # killed by a signal, or exited without raising: nothing was written
            failure.error_file = "<none: the rank wrote no error file>"


def _names_full_disk(failure: Any) -> bool:
    """Whether a failed rank's recorded message already says its disk is full."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return "no space left on the disk" in str(message)


def remove_partial_files(job_dir: str) -> list[str]:
    """Delete half-written outputs (checkpoints, metrics.json, model.pt temp files) that ranks
    killed mid-write left in the job folder, and a sharded checkpoint's temp folders
    (``checkpoints/sharded/.*.tmp``); the launcher calls it once every rank has ended."""
    from ddp_exp.io.files import remove_partial_trees

    folder = checkpoint.checkpoint_dir(job_dir)
    return (remove_partial(job_dir) + remove_partial(folder)
            + remove_partial_trees(os.path.join(folder, "sharded")))
