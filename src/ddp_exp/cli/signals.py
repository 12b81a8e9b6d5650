"""The entry point's signals and exit: SIGTERM at start-up, a signal between a sweep's jobs,
and ending the process once the job is over.

SIGTERM before the elastic agent takes it raises :class:`Interrupted`
(:func:`stop_on_sigterm`); a signal that reaches the entry point outside a job's task still
records the job Hydra had started (:func:`record_unstarted_job`) and writes the sweep's summary
(:func:`summarize_if_sweep`, after submitit's local jobs have ended); :func:`exit_now` ends the
process without the interpreter's teardown.

May use: :mod:`ddp_exp.job` (``status.json``, the sweep's summary), :mod:`ddp_exp.launch.torchrun`
(whether this process is a torchrun rank), :mod:`ddp_exp.rank.preemption` (USR1/USR2),
:mod:`ddp_exp.compat` (interpreter and submitit internals).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

from ddp_exp.compat.interpreter import exit_handlers
from ddp_exp.compat.submitit import local_job_processes
from ddp_exp.job import sweep
from ddp_exp.job.folder import job_log_file, record_unstarted_interrupt
from ddp_exp.job.sweep import summarize_interrupted
from ddp_exp.launch.torchrun_env import is_rank0, under_torchrun
from ddp_exp.rank import preemption


class Interrupted(BaseException):
    """SIGTERM before the elastic agent installs its own handler (which raises torch's
    ``SignalException``): a ``BaseException``, like ``KeyboardInterrupt``, so that no ``except
    Exception`` on the way (a data loader's error report) takes it for an error."""

    def __init__(self, sigval: signal.Signals):
        super().__init__(sigval.name)
        self.sigval = sigval


def stop_on_sigterm() -> None:
    """SIGTERM to this process (the one that runs the jobs) raises :class:`Interrupted`:
    SIGTERM during start-up (config, data, model) then ends the job like Ctrl-C, with
    ``status.json`` saying interrupted and, in a sweep, the summary written; Python's default
    would end the process on the spot, leaving no record. Not under torchrun: there this
    process is a rank, and a rank must die on SIGTERM at once, even inside a collective
    (a forked rank inherits its launcher's signal handlers).

    SIGUSR1 and SIGUSR2 stop the job the same way where their action is the default
    (:data:`ddp_exp.rank.preemption.STOP_SIGNALS`: the launcher's agent then stops the ranks
    on them, status ``interrupted``, exit 128+n), unless one is ``trainer.preempt_signal``
    (held from when the config is read). Their default action killed this process alone,
    silently, and left its ranks training."""
    if (under_torchrun() or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN):  # ignored stays ignored
        return

    def stop(signum: int, frame) -> None:
        raise Interrupted(signal.Signals(signum))

    signal.signal(signal.SIGTERM, stop)
    for name in preemption.STOP_SIGNALS:  # their default action would kill this process alone
        sig = getattr(signal, name)
        if signal.getsignal(sig) is signal.SIG_DFL:  # not submitit's handler, not ignored
            signal.signal(sig, stop)
            preemption.stopping.add(sig)


def exit_now(code: int | str | None) -> None:
    """End the process with ``code`` (``SystemExit``'s: None is 0, a message is printed and
    gives 1) without the interpreter's teardown, once the job is over and nothing runs on.

    Python's teardown after a job frees torch's, ``torch._dynamo``'s and Hydra's modules one
    by one: 0.6-1.0 s of every run here (``python -c`` importing them: 3.4-3.9 s against
    2.8-2.9 s ending in ``os._exit``). In a process that was a rank (torchrun, srun), it also
    destroys gloo's C++ objects after the interpreter has begun to die, which aborted a rank
    with "terminate called without an active exception" (SIGABRT) after a finished run.
    Exactly what a normal exit does besides is done first: the ``atexit`` handlers (logging's
    flush and close, multiprocessing's, torch's), then stdout and stderr are flushed.

    Returns (and lets Python exit as usual) while a child process or a non-daemon thread is
    alive (a sweep launcher's worker pool): those are Python's to wait for; and on an
    interpreter whose ``atexit`` it was not written for (:mod:`ddp_exp.compat.interpreter`).
    """
    import multiprocessing

    run_exit_handlers = exit_handlers()  # None on a Python it was not written for
    if run_exit_handlers is None or multiprocessing.active_children() or any(
            t.is_alive() and not t.daemon for t in threading.enumerate()
            if t is not threading.main_thread()):
        return
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0 if code is None else int(code))


LOCAL_JOBS_GRACE_S = 60.0


def _wait_for_local_jobs(timeout_s: float = LOCAL_JOBS_GRACE_S) -> None:
    """After a Ctrl-C of a ``launcher=slurm_local`` sweep: wait until submitit's local jobs
    (this process's children, which got the signal too and stop their ranks) have ended, so
    that none outlives this process and the summary reads their final ``status.json``. Reads
    submitit's table of the jobs it started; does nothing without submitit's local executor."""
    deadline = time.monotonic() + timeout_s
    try:
        for proc in local_job_processes():
            with contextlib.suppress(Exception):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:  # a second Ctrl-C: stop waiting
        pass


def record_unstarted_job(signal_name: str) -> None:
    """A signal that reached us outside a job's task, after Hydra made the job's folder and
    before the task ran: that folder gets ``status.json`` saying interrupted
    (:func:`ddp_exp.job.folder.record_unstarted_interrupt`), as a job stopped inside its task
    does. Rank 0 only under torchrun (the others have no folder)."""
    if is_rank0():
        with contextlib.suppress(Exception):  # the record must not hide the interrupt
            record_unstarted_interrupt(signal_name, job_log_file())


def summarize_if_sweep() -> None:
    """A signal that reached us outside a job's task (while Hydra set up the next job of a
    sweep, or between jobs; Hydra has then reset its config), or while this process waited for
    jobs that run elsewhere: the summary of the jobs that finished is still due, in the sweep
    folder the last job ran in. Does nothing before a sweep's first job (no folder of ours yet)
    or outside a multirun. Waits for submitit's local jobs first (:func:`_wait_for_local_jobs`):
    their final ``status.json`` is what the summary reads."""
    _wait_for_local_jobs()
    if sweep.active_sweep_dir is not None:
        with contextlib.suppress(Exception):  # the summary must not hide the interrupt
            summarize_interrupted(sweep.active_sweep_dir)
