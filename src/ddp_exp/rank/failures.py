"""How a failure is reported: one line per kind of failure, the rest in the job log.

* Before any rank starts: a refusal of the input is a :class:`ddp_exp.config.errors.ConfigError`
(one
  line, exit 2, a single run's folder removed); any other exception while the launcher builds
  and probes (:func:`build_failure_recorded`) is a :class:`BuildFailed`: one line, exit 2, the
  run recorded as failed (``status.json``, the traceback in ``ddp_exp.log``).
* A world that failed (torch's ``ChildFailedError``): :func:`world_failure` gives the line
  ``rank R failed: <type>: <message>`` (:func:`failure_detail`) and whether the rank raised; an
  exception in a rank (the user's Dataset, model, loss, or ours) is that one line, a rank
  killed without raising gets torch's failure table.

May use: :mod:`ddp_exp.config` (``ConfigError``), :mod:`ddp_exp.job.folder` (``status.json``, the
job log).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from hydra.core.hydra_config import HydraConfig

from ddp_exp.config.compose import task_overrides
from ddp_exp.config.errors import ConfigError
from ddp_exp.job import folder as jobdir


def failure_detail(message: str) -> str:
    """The line that names a failed rank's error in a message ``"<type>: <text>"`` (the
    format of torch's error files), at most 300 characters: its first line; where the message
    carries another process's traceback (a DataLoader worker's error, re-raised in the rank as
    "Caught ValueError in DataLoader worker process 0. Original Traceback ..."), its last
    line, the original error."""
    lines = [ln.strip() for ln in str(message).strip().splitlines() if ln.strip()]
    if not lines:
        return "unknown error"
    carried = any(ln.startswith(("Original Traceback", "Traceback (most recent call last)"))
                  for ln in lines)
    return (lines[-1] if carried else lines[0])[:300]


def world_failure(exc: Any) -> tuple[str, bool]:
    """What the launcher reports for a world that failed (torch's ``ChildFailedError``, whose
    first failure is the root cause): ``rank R failed: <type>: <message>``, and whether the
    rank raised a Python exception (recorded in its error file by ``@record``: any exception,
    from ddp_exp or from the user's own Dataset, model, loss or transform). Such a failure is
    reported in that one line, its table and traceback going to the job log; a rank that died
    without raising (a signal, ``os._exit``) has no traceback to show and the line is
    ``rank R failed: Signal 9 (SIGKILL) received by PID ...`` or ``exit code N``."""
    rank, failure = exc.get_first_failure()
    message = failure.message
    # @record's error file (ErrorHandler.record_exception) holds {"message": "<type>: ...",
    # "extraInfo": {"py_callstack": ...}}; a rank that wrote none gets a string made up by torch.
    raised = isinstance(message, dict)
    if isinstance(message, dict):
        message = message.get("message", "")
    detail = (failure_detail(message) if str(message).strip()
              else f"exit code {failure.exitcode}")
    return f"rank {rank} failed: {detail}", raised


class BuildFailed(ConfigError):
    """An exception other than a refusal of the input (:class:`ddp_exp.config.errors.ConfigError`)
    while the launcher built and probed the run, before any rank started: a bug of ddp_exp's
    or in the user's own code. The entry point prints it in one line (exit 2); the run's
    folder is kept with what :func:`build_failure_recorded` wrote there."""

    folder_kept = True  # __main__ removes no folder and writes no status.json of its own


@contextlib.contextmanager
def build_failure_recorded(job_dir: str, owner: bool):
    """Around what the launcher builds and probes before any rank starts. A
    :class:`ddp_exp.config.errors.ConfigError` (the user's input refused in one line; a single run's
    folder is then removed) passes as it is. Any other exception is recorded as a failed run
    is: ``status.json`` (``failed``, naming the exception) and its traceback in the job log,
    written by the folder's ``owner``; it is raised again as :class:`BuildFailed`, one line
    naming the exception and where its traceback is. Interrupts (``KeyboardInterrupt``, not
    an ``Exception``) pass untouched."""
    t_start = time.time()
    try:
        yield
    except ConfigError:
        raise
    except Exception as exc:
        import traceback

        first = (str(exc).strip().splitlines() or [""])[0][:300]
        log_file = jobdir.job_log_file()
        error = (f"the launcher failed before any rank started: {type(exc).__name__}: {first}"
                 f" (the traceback is in {log_file or 'the job log'})")
        if owner:
            with contextlib.suppress(Exception):  # the record must not hide the error
                jobdir.log_to_job_log_only(logging.ERROR, f"{error}\n{traceback.format_exc()}")
                jobdir.write_status(job_dir, "failed", task_overrides(HydraConfig.get()),
                                    time.time() - t_start, error)
        raise BuildFailed(error) from exc
