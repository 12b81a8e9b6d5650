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
* A rank of a world that torchrun (or srun) started, which has no launcher of ours to report
  for it: :func:`record_rank_failure` records it as the launcher would and returns the
  :class:`RankFailed` the entry point reports; a collective broken by another rank's failure
  (:func:`is_peer_failure`) is a knock-on effect, not a second failure.
* A world the elastic agent restarted: rank 0 says which rank failed and where the world
  continues (:func:`restart_line`, from the launcher's record in :data:`FAILURES_ENV`).

May use: :mod:`ddp_exp.config` (``ConfigError``), :mod:`ddp_exp.job.folder` (``status.json``, the
job log), :mod:`ddp_exp.io.files` (a full disk named), :mod:`ddp_exp.distributed.process_group`
(``PeerFailed``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

from hydra.core.hydra_config import HydraConfig
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from ddp_exp.compat import messages
from ddp_exp.config.compose import task_overrides
from ddp_exp.config.errors import ConfigError, described
from ddp_exp.distributed.process_group import PeerFailed
from ddp_exp.io.files import naming_the_disk
from ddp_exp.job import folder as jobdir
from ddp_exp.rank import stacks

# "ddp_exp.config.errors.ConfigError: ..." at the start of a traceback's last line.
_DOTTED_TYPE = re.compile(r"^(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*): ")
# The C++ source line gloo's errors start with, a path of torch's build machine:
# "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] ..."
_NATIVE_SOURCE = re.compile(r"(?<=: )\[[^\]\s]+\.(?:cc|cpp|h):\d+\] ")


def failure_detail(message: str) -> str:
    """The line that names a failed rank's error in a message ``"<type>: <text>"`` (the
    format of torch's error files), at most 300 characters: its first line; where the message
    carries another process's traceback (a DataLoader worker's error, re-raised in the rank as
    "Caught ValueError in DataLoader worker process 0. Original Traceback ..."), its last
    line, the original error; DDP's unused-parameter error names the config key
    ``ddp.find_unused_parameters`` (torch's advice names a keyword argument), a collective's
    timeout the key of its limit, ``distributed.timeout_s``. The C++ source line of gloo's
    errors (a path on torch's build machine) is left out."""
    lines = [_NATIVE_SOURCE.sub("", ln.strip(), count=1)
             for ln in str(message).strip().splitlines() if ln.strip()]
    if not lines:
        return "unknown error"
    if messages.collective_timed_out(lines[0]):
        return f"{lines[0][:300]} (the limit is distributed.timeout_s)"
    if messages.unused_parameters(lines[0]):  # torch's advice names a DDP argument, not a key
        return (f"{lines[0].partition(':')[0]}: DDP found parameters of the model that took no "
                "part in the loss (their gradients never came): set ddp.find_unused_parameters"
                "=true, or leave them out of the model (the model's forward may skip them on "
                "some steps); the whole error is in the job log")
    if messages.carries_traceback(lines):  # a traceback's last line names the type in full
        return _DOTTED_TYPE.sub(r"\1: ", lines[-1], count=1)[:300]
    return lines[0][:300]



# A rank process that ended with exit code 0 and no result (its function neither returned nor
# raised): the agent's wait for its result never ended before (issue 42's round 4).
ENDED_WITHOUT_RESULT = ("its process ended with exit code 0 before the run did, without raising "
                        "(os._exit(0) in its code, or exit(0) in a native library's)")


def world_failure(exc: Any) -> tuple[str, bool]:
    """What the launcher reports for a world that failed (torch's ``ChildFailedError``, whose
    first failure is the root cause): ``rank R failed: <type>: <message>``, and whether that
    line says it all: the rank raised a Python exception (recorded in its error file by
    ``@record``: any exception, from ddp_exp or from the user's own Dataset, model, loss or
    transform), or ended without its result (below). Such a failure is
    reported in that one line, its table and traceback going to the job log; a rank that died
    without raising (a signal, ``os._exit``) has no traceback to show and the line is
    ``rank R failed: Signal 9 (SIGKILL) received by PID ...`` or ``exit code N``; one whose
    process ended with exit code 0 before it returned its result (``os._exit(0)``, a native
    library's ``exit(0)``: :func:`ddp_exp.compat.elastic_agent.start_ranks_safely`) says so
    (:data:`ENDED_WITHOUT_RESULT`). A failure that is a collective's timeout ends with where
    the ranks still running were, when the launcher took their stacks
    (``exc.ddp_exp_stacks_note``, :func:`ddp_exp.rank.stacks.keep`): the rank reported waited
    for one of them."""
    rank, failure = exc.get_first_failure()
    message = failure.message
    # @record's error file (ErrorHandler.record_exception) holds {"message": "<type>: ...",
    # "extraInfo": {"py_callstack": ...}}; a rank that wrote none gets a string made up by torch.
    raised = isinstance(message, dict)
    if isinstance(message, dict):
        message = message.get("message", "")
    if failure.exitcode == 0 and not raised:  # the table would say "exitcode 0", no more
        return f"rank {rank} failed: {ENDED_WITHOUT_RESULT}", True
    detail = failure_detail(message) if str(message).strip() else f"exit code {failure.exitcode}"
    # A collective's timeout: where the ranks still running were (ddp_exp.rank.stacks.keep).
    note = getattr(exc, "ddp_exp_stacks_note", "")
    return f"rank {rank} failed: {detail}{f'; {note}' if note else ''}", raised


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
    naming the exception and where its traceback is; a ``SystemExit`` (``sys.exit`` in the
    user's code) as :class:`ExitCalled`'s line. Interrupts (``KeyboardInterrupt``, not an
    ``Exception``) pass untouched."""
    t_start = time.time()
    try:
        yield
    except ConfigError:
        raise
    except (Exception, SystemExit) as caught:
        import traceback

        # sys.exit in the user's code (a model's or Dataset's __init__): the command ended
        # with that exit code (0 too) and no record before.
        exc = (ExitCalled(exit_line(caught, "while the run was being built"))
               if isinstance(caught, SystemExit) else caught)

        log_file = jobdir.job_log_file()
        error = (f"the launcher failed before any rank started: {described(exc)}"
                 f" (the traceback is in {log_file or 'the job log'})")
        if owner:
            with contextlib.suppress(Exception):  # the record must not hide the error
                jobdir.log_to_job_log_only(logging.ERROR, f"{error}\n{traceback.format_exc()}")
                jobdir.write_status(job_dir, "failed", task_overrides(HydraConfig.get()),
                                    time.time() - t_start, error)
        raise BuildFailed(error) from exc


class ExitCalled(RuntimeError):
    """A rank's code called ``sys.exit`` (raised ``SystemExit``) before the run ended: the
    user's Dataset, model, loss or an ``argparse`` in them (or the launcher's, while it built
    the run: :func:`build_failure_recorded`). A rank cannot leave its world
    part-way: the others would wait for it in their next collective. Raised in its place
    (:func:`exit_is_a_failure`), it fails the rank as any exception does, in one line naming
    where the exit was called. (torch's ``@record`` returns None for ``SystemExit(0)``: the
    run was recorded as completed, with no training and no metrics; any other code ended the
    rank with that exit code and no message.)"""


@contextlib.contextmanager
def exit_is_a_failure() -> Iterator[None]:
    """Around a rank's training: a ``SystemExit`` raised inside is raised again as
    :class:`ExitCalled`, ``sys.exit(<code>) was called at <file>:<line> in <function> ...``
    (the innermost frame of its traceback: the caller of ``sys.exit``)."""
    try:
        yield
    except SystemExit as exc:
        raise ExitCalled(exit_line(exc)) from None


def exit_line(exc: SystemExit, when: str = "before the run ended: a rank cannot leave its "
              "world part-way (the other ranks would wait for it)") -> str:
    """The one line of :class:`ExitCalled` for ``exc``: where ``sys.exit`` was called,
    ``when``."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = (f" at {os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno} in "
             f"{tb.tb_frame.f_code.co_name}" if tb is not None else "")
    code = "" if exc.code is None else repr(exc.code)
    return f"sys.exit({code}) was called{where} {when}; raise an exception to stop a run"


PEER_FAILURE_GRACE_S = 5.0


FAILURES_ENV = "DDP_EXP_FAILURES_FILE"  # the launcher's record of failed ranks, per attempt


def is_peer_failure(exc: BaseException) -> bool:
    """True for errors a collective raises because a peer rank went away (gloo/NCCL connection
    closed or reset, a store that is gone), and for
    :class:`ddp_exp.distributed.process_group.PeerFailed`
    (another rank's failure, learnt through a collective), as opposed to an error of this
    rank's own."""
    import torch.distributed as dist

    return isinstance(exc, (dist.DistError, PeerFailed)) or messages.peer_went_away(str(exc))


class RankFailed(Exception):
    """A rank of a world that torchrun (or srun) started failed while training; see
    :func:`record_rank_failure`.

    Attributes:
        line: ``rank R failed: <type>: <first line of the error>``.
        job_dir: the run's folder (rank 0's).
        report: this rank reports the failure (one line on stderr, ``status.json``): the first
            rank of the world to record one (one per node where nodes share no folder).
        peer: this rank's collective broke because another rank failed first.
    """

    def __init__(self, line: str, job_dir: str, report: bool, peer: bool):
        super().__init__(line)
        self.line, self.job_dir, self.report, self.peer = line, job_dir, report, peer


ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # where torch's ErrorHandler writes a rank's error


def record_rank_failure(exc: BaseException, rank: int, job_dir: str) -> RankFailed:
    """Call in the ``except`` block of a rank that torchrun (or srun) started, around its
    training. Does what the built-in launcher's ``@record`` and failure table do: the traceback
    goes to the job log (a peer's failure, :func:`is_peer_failure`, gets one warning line there
    and nothing else: it is a knock-on effect); the error is written to
    ``<job_dir>/errors/rank<R>.json`` and to torchrun's error file (``TORCHELASTIC_ERROR_FILE``:
    its failure summary then names the cause), both in torch's error-file format
    (``ErrorHandler.record_exception``). The rank that creates ``errors/`` first reports the
    failure (``RankFailed.report``): an error that every rank raises together (a diverged
    loss) is reported once.

    Returns:
        The :class:`RankFailed` to raise instead of ``exc``.
    """
    import traceback

    exc = naming_the_disk(exc, job_dir)
    peer = is_peer_failure(exc)
    # The last line, as in the launcher's failure line: a DataLoader worker's error says
    # "Caught ValueError in DataLoader worker process 0." first and the error itself last.
    detail = failure_detail(f"{type(exc).__name__}: {exc}")
    line = f"rank {rank} failed: {detail}"
    if peer:  # a knock-on effect, not a second failure: no traceback
        jobdir.log_to_job_log_only(logging.WARNING, f"rank {rank} stopped: another rank failed "
                                   f"first ({detail})")
        return RankFailed(line, job_dir, False, True)
    errors = os.path.join(job_dir, jobdir.ERRORS_DIR)
    try:
        os.mkdir(errors)  # atomic: exactly one rank creates it
        report = True
    except FileExistsError:
        report = False
    except OSError:  # no folder to record in: rank 0 still reports
        report = rank == 0
    # A collective's timeout: where this node's other ranks still running are (they wait
    # for this one, or it for them: ddp_exp.rank.stacks), asked before torchrun stops them,
    # by the rank that reports (the first to make errors/): two asking at once saw each other
    # in the asking.
    note = stacks.of_node_peers(job_dir, detail) if report else ""  # one rank asks
    line += f"; {note}" if note else ""
    jobdir.log_to_job_log_only(logging.ERROR, f"{line}\n{traceback.format_exc()}")
    with contextlib.suppress(OSError):
        _record_error_file(os.path.join(errors, f"rank{rank}.json"), exc)
    ErrorHandler().record_exception(exc)  # torchrun's file, where torchrun set one
    return RankFailed(line, job_dir, report, False)


def _record_error_file(path: str, exc: BaseException) -> None:
    """torch's ``ErrorHandler.record_exception`` writing its error file to ``path``: it writes
    to the file ``TORCHELASTIC_ERROR_FILE`` names (torch's documented variable), set to ``path``
    for the call (no private method of torch's overridden)."""
    saved = os.environ.get(ERROR_FILE_ENV)
    os.environ[ERROR_FILE_ENV] = path
    try:
        ErrorHandler().record_exception(exc)
    finally:
        if saved is None:
            os.environ.pop(ERROR_FILE_ENV, None)
        else:
            os.environ[ERROR_FILE_ENV] = saved


def restart_line(attempt: int, max_restarts: int, source: str | None,
                 state: dict[str, Any] | None) -> str:
    """The line rank 0 of a world restarted by the elastic agent logs: which restart, which
    rank failed (as the launcher recorded it in the file named by :data:`FAILURES_ENV`;
    a failure on another node is not seen here) and the checkpoint the world continues from.

    Args:
        attempt: ``TORCHELASTIC_RESTART_COUNT`` (1 for the first restart).
        max_restarts: ``launcher.max_restarts``.
        source: the checkpoint this world loaded, or None (no epoch had finished).
        state: its contents (``epoch`` 0-based, ``global_step``; a step checkpoint's
            ``position``: global samples consumed in the epoch after ``epoch``).
    """
    failures = []
    with contextlib.suppress(OSError, ValueError):
        with open(os.environ.get(FAILURES_ENV, "")) as fh:
            failures = json.load(fh)
    failed = "a rank on another node failed"
    if len(failures) >= attempt:
        f = failures[attempt - 1]
        who = (f"rank {f['rank']}" if f.get("rank") is not None
               else f"local rank {f['local_rank']} of this node")
        code = f.get("exitcode")
        how = (f"killed by {signal.Signals(-code).name}" if isinstance(code, int) and code < 0
               and -code in signal.valid_signals() else f"exit code {code}")
        failed = f"{who} failed ({how})"
    if source and state is not None and state.get("position"):  # a step checkpoint
        where = (f"continues from {source} (epoch {state['epoch'] + 2}, {state['position']} "
                 f"samples in, step {state['global_step']})")
    elif source and state is not None:
        where = (f"continues from {source} (epoch {state['epoch'] + 1} done, step "
                 f"{state['global_step']})")
    else:
        where = "starts again from the beginning (no epoch had finished)"
    return f"restart {attempt} of launcher.max_restarts={max_restarts}: {failed}; the world {where}"
