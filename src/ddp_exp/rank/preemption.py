"""Preemption: a scheduler's warning signal turned into a step checkpoint, a ``preempted`` status
and a requeue (``trainer.preempt_signal``; docs/checkpoints.md, "Preemption and requeue"),
and a world that comes back at another size (elastic membership: :func:`world_sizes`).

A cluster warns a job before it stops it (SLURM: ``#SBATCH --signal=USR1@90``; submitit sends
``USR2`` the same way). The signal's default action (``USR1``, ``USR2``) kills a process, and
torch's elastic agent handles only ``TERM``/``INT``/``HUP``/``QUIT`` (and stops the ranks on
them), so:

* the launcher (the agent's process) holds the signal from the moment the config is read
  (:func:`forwarded`): it notes the request and passes the signal on to its ranks
  (``rank_pids``: the agent's rank processes, never their DataLoader workers);
* every rank installs :func:`install` first thing; the handler only notes the request
  (:func:`requested`). The training loop reads it on the collective it runs every
  ``trainer.log_every_n_steps`` steps, so that every rank stops after the same step; rank 0
  writes a step checkpoint and the loop raises its ``Preempted``;
* the rank returns :func:`stopped` to the agent (a clean end: no restart, no failure), the
  launcher raises :class:`JobPreempted`, and the entry point writes ``status.json``
  (``preempted``), requeues the job (``ddp_exp.launch.cluster.requeue``) and exits with
  :data:`EXIT_PREEMPTED`;
* the requeued job finds ``status.json`` saying ``preempted`` in its folder and continues from
  ``checkpoints/last.pt`` (:func:`continue_stopped`: ``trainer.resume=auto``'s semantics).

A signal that comes while the launcher loads the data, before any rank exists, ends the job as
preempted at once (nothing was trained since the last checkpoint).

May use: :mod:`ddp_exp.config` (``ConfigError``), :mod:`ddp_exp.io` (the world-size history).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ddp_exp.config.errors import ConfigError

log = logging.getLogger("ddp_exp")

# sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry".
EXIT_PREEMPTED = 75
AUTO = "auto"
OFF = ("off", "none", "null", "false", "")
# The key a rank's result carries when it stopped for a preemption (:func:`stopped`).
PREEMPTED = "preempted"
# Signals that cannot serve: uncatchable, or the ones a run is stopped or debugged with.
_REFUSED = ("SIGKILL", "SIGSTOP", "SIGINT", "SIGCHLD", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL",
            "SIGABRT", "SIGPIPE")

_requested = False  # this process was asked to stop (a forked rank inherits it)
_installed: int | None = None  # the signal :func:`install` set up in this rank
# USR1 and USR2 end a process by default (a scheduler's warning, ``kill -USR1 <pid>``). Where
# one is not the preemption signal, the job stops on it as on SIGTERM (every rank stopped,
# ``status.json`` interrupted, exit 128+n), never the launcher alone, silently, its ranks left
# training: the entry point's handler at start-up (ddp_exp.cli.signals.stop_on_sigterm), the
# elastic agent's while the ranks run (:func:`torch_signals`), where their action was the
# default (a handler of submitit's or SIG_IGN stays).
STOP_SIGNALS = tuple(n for n in ("SIGUSR1", "SIGUSR2") if hasattr(signal, n))
stopping: set[int] = set()  # those of them this process stops on (a forked rank inherits it)


def signal_number(value: Any, cluster: str | None) -> signal.Signals | None:
    """``trainer.preempt_signal`` as a signal, or None (off).

    Args:
        value: ``auto`` (``SIGUSR1`` under ``launcher.cluster=slurm``, submitit's preemption
            signal, ``SIGUSR2`` unless ``SUBMITIT_PREEMPT_SIGNAL`` says otherwise, under
            ``launcher.cluster=submitit``, else off), null/``off``, or a signal's name with or
            without ``SIG`` (``USR1``, ``SIGUSR2``, ``TERM``, ``HUP``) or its number.
        cluster: ``launcher.cluster``.

    Raises:
        ConfigError: one line naming the key and what is valid.
    """
    if value is None or value is False or str(value).strip().lower() in OFF:
        return None
    text = str(value).strip().upper()
    if text == AUTO.upper():
        if cluster == "slurm":
            return signal.SIGUSR1
        if cluster == "submitit":
            name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").upper()
            return getattr(signal, name if name.startswith("SIG") else f"SIG{name}",
                           signal.SIGUSR2)
        return None
    try:
        sig = (signal.Signals(int(text)) if text.isdigit() else
               signal.Signals[text if text.startswith("SIG") else f"SIG{text}"])
    except (KeyError, ValueError):
        sig = None
    if sig is None or sig.name in _REFUSED or sig.name.startswith("SIGRT"):
        raise ConfigError(f"trainer.preempt_signal={value!r} is invalid: use auto (USR1 under "
                          "launcher.cluster=slurm, submitit's USR2 under launcher=slurm, else "
                          "off), null, or the signal your scheduler sends before it stops the "
                          "job: USR1, USR2, TERM, HUP, ...")
    return sig


class JobPreempted(Exception):
    """The world stopped for a preemption after a step checkpoint; raised by the launcher (or
    a rank under torchrun) to the entry point, which records ``preempted``, requeues and exits
    with :data:`EXIT_PREEMPTED`.

    Attributes:
        line: one line for the console and ``status.json``.
        global_step: the step every rank stopped after (None: before any rank started).
        signum: the signal that asked for it.
    """

    def __init__(self, line: str, global_step: int | None, signum: int | None):
        super().__init__(line)
        self.line, self.global_step, self.signum = line, global_step, signum


def preempted_line(signum: int | None, global_step: int | None, checkpoint: str | None) -> str:
    """``preempted by SIGUSR1 after step 30: checkpoint .../last.pt`` (or, with no step,
    before training started)."""
    name = signal.Signals(signum).name if signum else "the preemption signal"
    if global_step is None:
        return f"preempted by {name} before training started"
    where = f": checkpoint {checkpoint}" if checkpoint else ""
    return f"preempted by {name} after step {global_step}{where}"


# ------------------------------------------------------------------------------ rank side
def install(signum: int | None) -> None:
    """In a rank, first thing: ``signum`` (``trainer.preempt_signal``) only notes a request
    (:func:`requested`) instead of its default action (``USR1`` would kill the rank). A
    request noted before (inherited from the agent) stays. None: nothing. The signals of
    :data:`STOP_SIGNALS` the launcher stops on get their default action back (a rank
    signalled with its launcher ends, as on SIGTERM)."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in stopping - {signum}:  # the launcher's stop: here, their default action again
        signal.signal(sig, signal.SIG_DFL)
    if signum is not None:
        signal.signal(signum, _note)
        _installed = signum


def requested() -> bool:
    """True once this process got the preemption signal (or was forked after its agent got
    it). The loop decides on a collective whether the world stops: read it there only."""
    return _requested


def _note(signum: int, frame: Any) -> None:
    del signum, frame
    global _requested
    _requested = True


def stopped(global_step: int | None, checkpoint: str | None) -> dict[str, Any]:
    """What a rank returns to its agent when the loop stopped for a preemption (after
    ``global_step``, ``checkpoint`` written): a clean return (the agent neither restarts nor
    reports a failure), told apart from final metrics by :data:`PREEMPTED`."""
    return {PREEMPTED: True, "global_step": global_step, "checkpoint": checkpoint,
            "signal": _installed}


def preempted_in(results: dict[int, Any]) -> JobPreempted | None:
    """The :class:`JobPreempted` to raise when any rank's result (the launcher's results by
    rank) is :func:`stopped`'s; None for a world that finished."""
    for rank in sorted(results):
        result = results[rank]
        if isinstance(result, dict) and result.get(PREEMPTED):
            step, signum = result.get("global_step"), result.get("signal")
            return JobPreempted(preempted_line(signum, step, result.get("checkpoint")), step,
                                signum)
    return None


# ---------------------------------------------------------------------------- agent side
class Forwarder:
    """The launcher's hold on the preemption signal (:func:`forwarded`).

    Attributes:
        signum: the signal held.
        previous: the handler it replaced (submitit's, under ``launcher=slurm``), put back on
            exit; ``ddp_exp.launch.cluster.requeue`` calls it for submitit's requeue.
        pid: the launcher's process: a rank forked before it installs its own handler
            inherits this one, and there only notes the request.
    """

    def __init__(self, signum: int, rank_pids: Callable[[], Iterable[int]]):
        self.signum, self.rank_pids, self.pid = signum, rank_pids, os.getpid()
        self.previous: Any = None

    @property
    def requested(self) -> bool:
        return _requested

    def __call__(self, signum: int, frame: Any) -> None:
        _note(signum, frame)
        if os.getpid() != self.pid:  # a rank that has not installed its own handler yet
            return
        self.forward()

    def forward(self) -> None:
        """Pass the signal on to every live rank of this launcher (again after a start of
        the ranks: one forked while the agent forked the others may have missed it)."""
        if not _requested:
            return
        for pid in self.rank_pids():
            with contextlib.suppress(OSError):  # a rank that has just ended
                os.kill(pid, self.signum)


@contextlib.contextmanager
def forwarded(signum: int | None, rank_pids: Callable[[], Iterable[int]]
              ) -> Iterator[Forwarder | None]:
    """While open, in the launcher: ``signum`` notes a preemption request and is passed on to
    the ranks (``rank_pids()``: the PIDs of this launcher's ranks now). The handler it
    replaced is put back on exit. Yields None (and does nothing) for ``signum`` None or off
    the main thread (a sweep launcher's worker thread cannot hold signals)."""
    if signum is None or threading.current_thread() is not threading.main_thread():
        yield None
        return
    reset()  # a request belongs to one job (a sweep runs several in this process)
    forwarder = Forwarder(signum, rank_pids)
    forwarder.previous = signal.signal(signum, forwarder)
    try:
        yield forwarder
    finally:
        previous = forwarder.previous
        if previous is None or (signum in stopping and _requested):
            # the entry point's stop (STOP_SIGNALS) is no requeue handler for
            # ddp_exp.launch.cluster.requeue to call after the preemption
            previous = signal.SIG_DFL
        signal.signal(signum, previous)


TORCH_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def torch_signals(signum: int | None) -> str:
    """``LaunchConfig.signals_to_handle`` for the launch: torch's agent sets its own handler
    (stop the ranks: interrupted) for TERM, INT, HUP and QUIT, and for the USR1/USR2 this
    process stops on (:data:`stopping`), at every start of the ranks; a preemption signal among
    them (``trainer.preempt_signal=TERM``) is left to :func:`forwarded`."""
    name = signal.Signals(signum).name if signum is not None else None
    names = [*TORCH_SIGNALS, *(signal.Signals(s).name for s in sorted(stopping))]
    return ",".join(n for n in names if n != name)


def continue_stopped(cfg: Any, job_dir: str, status: str | None, restart: int = 0) -> bool:
    """With ``trainer.resume`` null, a world that comes back continues from the job folder's
    ``checkpoints/last.pt`` as ``trainer.resume=auto`` does (sets it in ``cfg``; one line says
    why): a requeued job, whose folder's ``status.json`` says ``preempted`` (``status``), and a
    world that torch elastic restarted (``restart``: ``TORCHELASTIC_RESTART_COUNT``; under
    torchrun every rank composes the job again). Returns True when it did."""
    if cfg.trainer.resume is not None or (status != PREEMPTED and restart == 0):
        return False
    cfg.trainer.resume = AUTO
    why = (f"restart {restart} of an elastic world" if restart else
           f"{job_dir} holds a preempted run")
    log.info("%s: continuing it from its last checkpoint (trainer.resume=auto)", why)
    return True


# checkpoints/world_sizes.json: the world sizes a run has trained at, written once it changes.
WORLDS_FILE = "world_sizes.json"


def world_sizes(job_dir: str, world_size: int, state: dict[str, Any] | None, write: bool
                ) -> list[int]:
    """The world sizes this run has trained at, in order, for ``metrics.json`` (issue 30: a
    node left or joined and torch elastic restarted the workers with another ``WORLD_SIZE``, or
    a requeued job got other nodes).

    Args:
        job_dir: the job folder; the history is ``checkpoints/world_sizes.json``, written (on
            ``write``: rank 0) only once the size has changed, so a run that never changed
            size leaves no such file.
        world_size: this world's.
        state: the checkpoint this world continues from (its ``world_size``), None for a fresh
            start.
    """
    from ddp_exp.io.checkpoint import checkpoint_dir
    from ddp_exp.io.files import atomic_write, read_json

    if state is None:
        return [world_size]
    path = os.path.join(checkpoint_dir(job_dir), WORLDS_FILE)
    history = read_json(path)
    if not (isinstance(history, list) and history and all(isinstance(n, int) for n in history)):
        history = [int(state.get("world_size") or world_size)]
    if history[-1] != world_size:
        history = [*history, world_size]
        if write:
            text = json.dumps(history).encode()
            atomic_write(path, lambda fh: fh.write(text))
    return history


def reset() -> None:
    """Forget a request (a process that runs several jobs: the next job starts clean)."""
    global _requested
    _requested = False
