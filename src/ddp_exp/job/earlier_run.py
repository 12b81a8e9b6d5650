"""What an earlier run left in a job folder, and whether a new run may start there.

:func:`refuse_earlier_run` (called by the build step, before any rank starts) refuses to train
afresh over an earlier run's outputs (:class:`ddp_exp.job.folder.FolderHoldsRun`), but for an
attempt of this same run killed before its first ``checkpoints/last.pt``
(:func:`killed_first_epoch`), which ``trainer.resume=auto`` starts afresh; :func:`make_way`
then clears that attempt's files and the temp files a killed writer left, once every other
check has passed. A temp file (``.<name>.<tag>.tmp``) is never an earlier run's output.

May use: :mod:`ddp_exp.job.folder` (the folder's names, its lock's previous record, the refusal),
:mod:`ddp_exp.job.outputs` (:func:`earlier_outputs`, re-exported here),
:mod:`ddp_exp.io.checkpoint` (the checkpoints folder's name).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil

from omegaconf import OmegaConf

from ddp_exp.io import checkpoint
from ddp_exp.io.files import read_text
from ddp_exp.job.folder import (
    ERRORS_DIR,
    LOCK_FILE,
    STATUS_FILE,
    FolderHoldsRun,
    existed_before,
    job_log_file,
    previous_record,
    remove_partial_files,
)
from ddp_exp.job.outputs import earlier_outputs, is_temp, names_in

log = logging.getLogger("ddp_exp")


# What a run of ddp_exp writes into its job folder before its first checkpoints/last.pt (the
# Hydra record and the job log aside, named by Hydra's config): an attempt killed in its first
# epoch left only these.
_FIRST_EPOCH_FILES = {LOCK_FILE, STATUS_FILE, ERRORS_DIR, "tensorboard", "checkpoints",
                      "standardization.json",
                      # the record (ddp_exp.job.record) and the trackers' files (logger=...)
                      "run.json", "run.diff", "trackers.json", "metrics.csv", "mlflow.db",
                      "mlartifacts", "wandb"}


def killed_first_epoch(job_dir: str) -> str | None:
    """Whether ``job_dir`` holds only what an attempt of this same run, stopped before its first
    ``checkpoints/last.pt``, wrote: then ``trainer.resume=auto`` starts the run afresh there.

    The proof, all of it: no ``metrics.json``, ``model.pt`` or complete checkpoint (only temp
    files under ``checkpoints/``); ``status.json`` absent (a kill) or ``interrupted`` /
    ``failed``; nothing in the folder but what ddp_exp and Hydra write there (the ``.hydra/``
    record, the job log, ``tensorboard/`` event files, ``errors/``, ``standardization.json``,
    the lock file); and, where the launching process took the folder's lock
    (:func:`job_folder_lock`), the earlier attempt's ``config.yaml`` equals this run's but for
    ``trainer.resume``. A user's file, a finished or another config's run keep the refusal.

    Returns:
        Why not (one phrase), or None when the folder is such an attempt.
    """
    if any(os.path.isfile(os.path.join(job_dir, n)) for n in ("metrics.json", "model.pt")):
        return "it finished"
    status = run_status(job_dir)
    if status not in (None, "interrupted", "failed"):
        return f"its status.json says {status!r}"
    hydra_subdir, log_file = _hydranames_in()
    allowed = _FIRST_EPOCH_FILES | {n for n in (hydra_subdir, log_file) if n}
    try:
        names = set(os.listdir(job_dir))
        checkpoints = names_in(checkpoint.checkpoint_dir(job_dir))
        events = names_in(os.path.join(job_dir, "tensorboard"))
    except OSError as exc:
        return f"it cannot be read ({exc.strerror})"
    others = sorted(names - allowed)
    if others:
        return f"it holds {others[0]!r}, which ddp_exp did not write"
    # sharded/: folders of a sharded checkpoint, none complete until a name (a .pt) names one
    if not all(is_temp(n) or n == "sharded" for n in checkpoints):
        return "it holds a checkpoint"
    if not all("tfevents" in n for n in events):
        return "tensorboard/ holds files ddp_exp did not write"
    previous = previous_record(job_dir)
    if previous and hydra_subdir and not _same_config(
            previous.get("config.yaml"), read_text(os.path.join(job_dir, hydra_subdir,
                                                                 "config.yaml"))):
        return "it was started with another config"
    return None


def run_status(job_dir: str) -> str | None:
    """``status.json``'s ``status`` in ``job_dir`` (``completed``, ``failed``,
    ``interrupted``), None when there is none, ``unreadable`` when it cannot be read."""
    text = read_text(os.path.join(job_dir, STATUS_FILE))
    if not text:
        return None
    try:
        return str(json.loads(text).get("status"))
    except (ValueError, AttributeError):
        return "unreadable"


def _hydranames_in() -> tuple[str | None, str | None]:
    """The names, in the job folder, of Hydra's record folder and of the job log."""
    from hydra.core.hydra_config import HydraConfig

    subdir = HydraConfig.get().output_subdir if HydraConfig.initialized() else ".hydra"
    log_file = job_log_file()
    return subdir, os.path.basename(log_file) if log_file else None


def _same_config(before: str | None, now: str) -> bool:
    """Two ``.hydra/config.yaml`` texts compose the same run, ``trainer.resume`` aside."""
    if before is None or not now:
        return True  # nothing to compare with
    try:
        a, b = OmegaConf.create(before), OmegaConf.create(now)
        for c in (a, b):
            if OmegaConf.select(c, "trainer") is not None:
                c.trainer.pop("resume", None)
        return OmegaConf.to_container(a) == OmegaConf.to_container(b)
    except Exception:  # an unreadable record: not the same
        return False


def clear_killed_attempt(job_dir: str) -> None:
    """Delete what an attempt killed before its first checkpoint wrote
    (:func:`killed_first_epoch`): its event files, temp files, ``errors/``, ``status.json`` and
    ``standardization.json``; the ``.hydra/`` record and the job log stay."""
    for sub in ("tensorboard", "checkpoints", ERRORS_DIR):
        shutil.rmtree(os.path.join(job_dir, sub), ignore_errors=True)
    for name in (STATUS_FILE, "standardization.json"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(job_dir, name))


def refuse_earlier_run(job_dir: str, resume: str | None, warn: bool = True) -> bool:
    """Refuse to train afresh in a folder that holds an earlier run: its event streams and
    files would mix with this run's. Training on is fine: ``trainer.resume=auto`` with a
    ``checkpoints/last.pt`` to continue from, or ``trainer.resume=<path>``. With
    ``trainer.resume=auto`` and nothing to continue from, it logs one warning
    (:func:`nothing_to_resume_line`) and the run starts fresh, also when the folder holds only
    an attempt of this run killed before its first checkpoint (:func:`killed_first_epoch`).
    Changes nothing: :func:`make_way` does, once every other check has passed. Every process
    that builds the world judges alike (so that all refuse together); ``warn``: this one says
    the warning (the one that owns the folder).

    Returns:
        True when the folder holds such a killed attempt, which :func:`make_way` clears.

    Raises:
        FolderHoldsRun: naming what the earlier run left and how to continue it.
    """
    no_checkpoint = resume == "auto" and not os.path.isfile(
        os.path.join(checkpoint.checkpoint_dir(job_dir), checkpoint.LAST))
    earlier = earlier_outputs(job_dir) if resume is None or no_checkpoint else []
    why_not = killed_first_epoch(job_dir) if earlier and no_checkpoint else "n/a"
    if why_not is None:
        return True
    if earlier:  # training afresh here would mix two runs' event streams and files
        how = (f"trainer.resume=auto finds no checkpoints/last.pt to continue from, and "
               f"{why_not}" if no_checkpoint else "continue it with trainer.resume=auto")
        raise FolderHoldsRun(f"the job folder {job_dir!r} already holds a run "
                             f"({', '.join(earlier)}): {how}; or give this run its own folder "
                             "(hydra.run.dir; hydra.sweep.dir with -m)")
    if no_checkpoint and warn:  # once per world
        log.warning("%s", nothing_to_resume_line(job_dir))
    return False


def make_way(job_dir: str, killed_attempt: bool) -> None:
    """Once the run may start in ``job_dir`` (every check passed, no rank started yet), in
    the process that owns the folder alone (another would delete the temp files the owner is
    writing: seen, a cluster job's node 1 lost its ``run.json`` so): delete a killed
    attempt's files (``killed_attempt``, as :func:`refuse_earlier_run` returned;
    :func:`clear_killed_attempt`), saying so, and the temp files a killed writer left
    (``.<name>.<tag>.tmp``)."""
    if not os.path.isdir(job_dir):
        return
    if killed_attempt:
        earlier = earlier_outputs(job_dir)
        clear_killed_attempt(job_dir)
        log.warning("trainer.resume=auto: %s holds an attempt of this run stopped before its "
                    "first checkpoint (%s): starting the run afresh there", job_dir,
                    ", ".join(earlier))
    remove_partial_files(job_dir)


def nothing_to_resume_line(job_dir: str) -> str:
    """What ``trainer.resume=auto`` says when the job folder has no ``checkpoints/last.pt``:
    it trains from scratch there (a new folder, when ``hydra.run.dir`` was not given: each
    run gets its own timestamped one), and how to resume a run instead. A ``hydra.run.dir``
    that existed already (a run given its folder again, stopped before its first checkpoint)
    is told so: the hint to pass the folder was wrong there (a user, killed at 2 s)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if existed_before(job_dir):
        return (f"trainer.resume=auto: no checkpoints/last.pt in {job_dir} yet (a run there "
                "stopped before its first checkpoint, or none ran): starting fresh there")

    sweep = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    how = ("pass the sweep's folder as hydra.sweep.dir" if sweep
           else "pass its folder as hydra.run.dir")
    return f"trainer.resume=auto: nothing to resume in {job_dir}: starting fresh; to resume a " \
           f"run, {how}"
