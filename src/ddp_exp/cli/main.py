"""``python -m ddp_exp [overrides]`` / ``ddp-exp``: the Hydra entry point.

One Hydra job is one training world (:func:`ddp_exp.launch.elastic.run_job`); ``-m`` sweeps run one
world
per job. Errors in the user's input end the process with one line on stderr naming the key and
what is valid, exit status 2; a rank that raised (any exception: the user's Dataset or model,
a diverged loss, ddp_exp's own) ends it with one line, ``error: rank R failed: <type>:
<message>``, exit status 1, the failure table and traceback in the job log (under torchrun:
one line, then torchrun's table); a rank killed without raising (a signal) ends it with
PyTorch's elastic failure summary. Resuming a finished run says so, exit 0. A job stopped by
its scheduler's warning (``trainer.preempt_signal``) after a step checkpoint says so in one line,
``status.json`` ``preempted``, requeues itself (SLURM, submitit) and exits with status 75
(:data:`ddp_exp.rank.preemption.EXIT_PREEMPTED`, sysexits' EX_TEMPFAIL).
``HYDRA_FULL_ERROR=1`` shows full tracebacks instead.

May use: :mod:`ddp_exp.config`, :mod:`ddp_exp.rank.failures` (a failed world's line, a
failed rank's record under torchrun),
:mod:`ddp_exp.cli.usage` (``--help``), :mod:`ddp_exp.launch.cluster` (which task owns the folder),
:mod:`ddp_exp.job.folder`, :mod:`ddp_exp.launch.elastic`, :mod:`ddp_exp.launch.torchrun`,
:mod:`ddp_exp.job.sweep`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import os
import signal
import sys
import threading
import time
from typing import TypeVar


def _interrupted_while_importing(signum: int, frame: object) -> None:
    """Ctrl-C while the imports below run (torch's takes seconds): nothing has been made yet,
    so end at once with the line a later Ctrl-C gets, not a traceback from inside an import."""
    print("interrupted (SIGINT)", file=sys.stderr, flush=True)
    os._exit(128 + signal.SIGINT)


if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored
    signal.signal(signal.SIGINT, _interrupted_while_importing)

import hydra
from omegaconf import DictConfig

from ddp_exp.cli.usage import register_resolvers
from ddp_exp.compat import messages
from ddp_exp.compat.interpreter import exit_handlers
from ddp_exp.compat.submitit import local_job_processes
from ddp_exp.config.compose import (
    null_group_line,
    primary_config_overrides,
    register_configs,
    task_overrides,
)
from ddp_exp.config.errors import ConfigError
from ddp_exp.io.files import DiskFull, is_disk_full
from ddp_exp.job import sweep
from ddp_exp.job.folder import (
    AlreadyComplete,
    LeaveFolderAlone,
    job_folder_lock,
    job_log_file,
    log_to_job_log_only,
    record_unstarted_interrupt,
    remove_refused_folder,
    write_status,
)
from ddp_exp.job.sweep import (
    SweepFailed,
    objective,
    raise_if_failed,
    recorded_val_loss,
    summarize_interrupted,
)
from ddp_exp.launch.cluster import owns_folder, requeue
from ddp_exp.launch.elastic import run_job
from ddp_exp.launch.torchrun import (
    MULTIRUN_UNDER_TORCHRUN,
    asks_for_multirun,
    ignore_leftover_torchrun_variables,
    multirun_flag_first,
    torchrun_overrides,
    under_torchrun,
)
from ddp_exp.launch.user_input import TARGET_GROUPS
from ddp_exp.rank.failures import PEER_FAILURE_GRACE_S, RankFailed, world_failure
from ddp_exp.rank.preemption import EXIT_PREEMPTED, JobPreempted

log = logging.getLogger("ddp_exp")

EXIT_CONFIG_ERROR = 2
EXIT_RANK_FAILED = 1
TORCHRUN_REPORT_GRACE_S = 15.0
MULTIRUN_REFUSAL_GRACE_S = 2.0

register_configs()
register_resolvers()


@hydra.main(version_base="1.3", config_path="pkg://ddp_exp.conf", config_name="config")
def _task(cfg: DictConfig) -> float | None:
    """Run one job; returns the final ``val/loss`` (what Hydra sweepers minimise).

    A failed job records ``status.json`` in its folder. A single run then exits non-zero; in a
    multirun the job returns NaN so the other jobs go on, and the summary callback fails the
    sweep at the end. Ctrl-C / SIGTERM stops the whole sweep.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:  # for a signal that comes between this job and the next
        sweep.active_sweep_dir = hc.sweep.dir
    # Under torchrun rank 0 reports; in a submitit job of several tasks, task 0.
    main_process = _is_rank0() and owns_folder(cfg)
    t_start = time.time()
    error, code = None, 0
    job_dir, overrides = hc.runtime.output_dir, task_overrides(hc)
    try:
        hydra_dir = (os.path.join(job_dir, hc.output_subdir) if hc.output_subdir is not None
                     else None)
        with job_folder_lock(job_dir, hydra_dir) if main_process else contextlib.nullcontext():
            final = run_job(cfg)
    except LeaveFolderAlone as exc:  # finished already, or another run's: write nothing there
        if isinstance(exc, AlreadyComplete) and hc.mode == RunMode.MULTIRUN:
            # A sweep run again with trainer.resume=auto skips its finished jobs and goes on.
            log.info("job %s already trained all its epochs: skipped (%s)", hc.job.num, job_dir)
            return objective(recorded_val_loss(job_dir), hc.sweeper)
        complete = isinstance(exc, AlreadyComplete)
        if main_process:  # a finished run is no error: a requeued finished job ends as done
            print(str(exc) if complete else f"error: {exc}", file=sys.stderr, flush=True)
        if hc.mode == RunMode.MULTIRUN and hc.job.num == 0:  # the sweep stops before any job
            sweep.discard_refused_sweep()
        raise SystemExit(0 if complete else EXIT_CONFIG_ERROR) from None
    except ConfigError as exc:
        if main_process:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        error, code = str(exc), EXIT_CONFIG_ERROR
        # Refused in a folder that holds an earlier run: its status.json stays that run's.
        main_process = main_process and not getattr(exc, "folder_kept", False)
        if main_process and hc.mode == RunMode.MULTIRUN:  # the job's folder stays: say why
            log.error("error: %s", exc)
        elif main_process and remove_refused_folder(job_dir, hc.output_subdir, job_log_file()):
            raise SystemExit(code) from None  # a single run that never started leaves nothing
    except JobPreempted as exc:  # every rank stopped after a step checkpoint (issue 30)
        if main_process:  # the status first: a requeue may end this process at once
            write_status(job_dir, "preempted", overrides, time.time() - t_start, exc.line)
            log_to_job_log_only(logging.WARNING, exc.line)
            print(exc.line, file=sys.stderr, flush=True)
            requeued = requeue(cfg, exc.signum)
            if requeued:
                print(requeued, file=sys.stderr, flush=True)
        raise SystemExit(EXIT_PREEMPTED) from None
    except RankFailed as exc:  # under torchrun or srun: this process was a failed rank
        if exc.report:
            print(f"error: {exc.line}", file=sys.stderr, flush=True)
            write_status(exc.job_dir, "failed", overrides, time.time() - t_start, exc.line)
        else:  # let the first failed rank report and exit first: torchrun names it the cause
            time.sleep(PEER_FAILURE_GRACE_S)
        raise SystemExit(EXIT_RANK_FAILED) from None
    except (RendezvousError, DistError) as exc:  # the launcher's rendezvous, not a rank
        line = _rendezvous_line(exc, cfg)
        if main_process:
            print(f"error: {line}", file=sys.stderr, flush=True)
        error, code = line, EXIT_RANK_FAILED
    except ChildFailedError as exc:
        error, raised = world_failure(exc)
        code = EXIT_RANK_FAILED
        if raised:  # an exception in a rank (the user's code, or ours): one line
            log_to_job_log_only(logging.ERROR, f"training failed\n{exc.format_msg()}")
            if main_process:
                print(f"error: {error}", file=sys.stderr, flush=True)
        else:
            log.error("training failed\n%s", exc.format_msg())
    except SignalException as exc:  # the elastic agent stopped every rank before raising this
        log.error("stopped by %s: every rank has ended", exc.sigval.name)
        write_status(job_dir, "interrupted", overrides, time.time() - t_start,
                     f"stopped by {exc.sigval.name}")
        if hc.mode == RunMode.MULTIRUN:
            summarize_interrupted(hc.sweep.dir)
        print(f"interrupted ({exc.sigval.name})", file=sys.stderr, flush=True)
        raise SystemExit(128 + int(exc.sigval)) from None
    except (KeyboardInterrupt, Interrupted) as exc:  # before the ranks started (data, model)
        name = exc.sigval.name if isinstance(exc, Interrupted) else "SIGINT"
        # Under torchrun this process is a rank: the signal may come at any point of training.
        when = "" if under_torchrun() else " before training started"
        if main_process:
            log_to_job_log_only(logging.ERROR, f"stopped by {name}{when}")
            write_status(job_dir, "interrupted", overrides, time.time() - t_start,
                         f"stopped by {name}{when}")
        if hc.mode == RunMode.MULTIRUN:
            summarize_interrupted(hc.sweep.dir)
        raise

    if main_process:
        write_status(job_dir, "failed" if error else "completed", overrides,
                     time.time() - t_start, error,
                     None if error or final is None else final.get("pruned_at_epoch"))
    if error is None:
        return objective(None if final is None else final.get("val/loss"), hc.sweeper)
    if hc.mode == RunMode.MULTIRUN:
        return objective(math.nan, hc.sweeper)
    raise SystemExit(code)


def _is_rank0() -> bool:
    """True in the process that reports for the world: rank 0 under torchrun (every rank
    composes the same config and meets the same errors), the only process otherwise."""
    return os.environ.get("RANK", "0") == "0"


def _rendezvous_line(exc: BaseException, cfg: DictConfig) -> str:
    """One line for a rendezvous that failed in this launcher (a node that never came, a port
    taken, two nodes with one node_rank), naming the setting that bounded the wait: under
    torchrun, a rank's wait for its peers is ``distributed.timeout_s``."""
    la = cfg.launcher
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    if under_torchrun():  # this rank waited for its peers at torchrun's store
        return (f"rank {os.environ['RANK']} of torchrun's WORLD_SIZE={os.environ['WORLD_SIZE']} "
                f"did not meet the other ranks at {os.environ.get('MASTER_ADDR')}:"
                f"{os.environ.get('MASTER_PORT')} within distributed.timeout_s="
                f"{cfg.distributed.timeout_s:g} s ({type(exc).__name__}: {first}); every rank "
                "must start within distributed.timeout_s")
    return (f"the {la.rdzv_backend} rendezvous at {la.rdzv_endpoint} failed "
            f"({type(exc).__name__}: {first}); every one of the launcher.nnodes={la.nnodes} "
            "nodes must start within launcher.rdzv_timeout_s with the same endpoint"
            + (" and its own launcher.node_rank" if la.rdzv_backend == "static" else "")
            + " and its own hydra.run.dir")


def _one_line(exc: BaseException) -> str | None:
    """A one-line message for a config value of the wrong type, or None for other errors."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    cause = exc.__cause__
    if not (isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None)):
        return None
    msg = str(getattr(cause, "msg", cause)).splitlines()[0]
    schema = getattr(cause, "object_type", None)
    unknown_key = isinstance(cause, (ConfigAttributeError, ConfigKeyError))
    if unknown_key and dataclasses.is_dataclass(schema):
        keys = [f.name for f in dataclasses.fields(schema) if not f.name.startswith("_")]
        msg += f"; valid keys: {', '.join(keys)}"
        if str(cause.full_key).split(".", 1)[0] in TARGET_GROUPS:  # a _target_ replaced
            msg += f"; an argument of your own _target_ is added with +{cause.full_key}=..."
    elif unknown_key:  # under a free-form node (data.transform, a user's target's arguments)
        msg += f"; to add it, write +{cause.full_key}=..."
    elif messages.omegaconf_no_deletion(msg) and str(cause.full_key).split(".", 1)[0] in (
            TARGET_GROUPS):  # ~model.hidden_sizes, to give model._target_=my.Net
        msg += ("; no need to delete it for your own _target_: one given in its place drops "
                "the keys its signature does not take")
    return f"{cause.full_key}: {msg}"


# Hydra plugins that presets use, and the extra that installs each.
PLUGIN_EXTRAS = {
    "submitit": ("hydra_plugins.hydra_submitit_launcher", "slurm"),
    "joblib": ("hydra_plugins.hydra_joblib_launcher", "sweeps"),
}
# Plugins that presets no longer use, and the line that names the replacement.
REPLACED_PLUGINS = {
    ("hydra/sweeper/optuna'", "hydra/sweeper=optuna:"):
        "hint: hydra/sweeper=optuna (Hydra's Optuna sweeper: optuna<3, no pruning) is replaced "
        "by hydra/sweeper=ddp_optuna, the same keys but sampler.name (pip install -e "
        "'.[optuna]'; see docs/sweeps.md)",
}


def missing_plugin_hint(error_text: str) -> str | None:
    """The install line for a Hydra plugin that ``error_text`` (Hydra's composition error)
    looks for and that is not installed, e.g. ``launcher=slurm`` without the ``slurm`` extra."""
    import importlib.util

    for words, line in REPLACED_PLUGINS.items():
        if any(word in error_text for word in words):
            return line
    for word, (module, extra) in PLUGIN_EXTRAS.items():
        if word not in error_text:
            continue
        try:
            installed = importlib.util.find_spec(module) is not None
        except ImportError:  # find_spec imports the parent, hydra_plugins: no plugin at all
            installed = False
        if not installed:
            return f"hint: this needs Hydra's {word} plugin: pip install -e '.[{extra}]'"
    return None


def _unknown_option_line(exc: BaseException, argv: list[str]) -> str | None:
    """One line for a config group option that does not exist (``data=digitz``), instead of
    Hydra's report over ten lines (the valid options one per line, then its config search
    path); naming the config that asked for it when the command line did not
    (``launcher=slurm`` asks for ``hydra/launcher=submitit_slurm``). None for other errors."""
    from hydra.errors import MissingConfigException

    missing = _caused_by(exc, MissingConfigException)
    if missing is None or not missing.options or not missing.missing_cfg_file:
        return None
    group, _, choice = missing.missing_cfg_file.rpartition("/")
    if not group:
        return None
    asked = messages.hydra_asking_config(str(missing))
    typed = any(arg.lstrip("+~").partition("=")[0] == group for arg in argv)
    # Hydra names its own primary config for an override that a preset's defaults list makes
    # (hparams_search=digits_optuna: /hydra/sweeper: optuna): no clue to a user.
    where = (f" (asked for by {asked})" if asked and not typed
             and asked not in ("config", "hydra/config") else "")
    return (f"{group}={choice}{where}: no such option in config group {group}; valid "
            f"options: {', '.join(missing.options)}")


def _plus_on_a_default(exc: BaseException, argv: list[str]) -> str | None:
    """One line for ``+group=option`` on the command line when ``group`` is in the defaults list
    already (``+experiment=digits_cnn_recipe``, ``+data=synthetic``, ``+hydra/launcher=basic``):
    Hydra's error says "Multiple values" and suggests a defaults-list edit; the fix on the
    command line is to drop the ``+``. None for any other error, or when the group was not
    added with one ``+`` on the command line (two options from the user's own config files)."""
    group = messages.hydra_group_given_twice(str(exc))
    if group is None:
        return None
    added = [arg for arg in argv if arg.startswith("+") and not arg.startswith("++")
             and arg[1:].partition("=")[0] == group]
    if len(added) != 1:
        return None
    choice = added[0][1:]
    return (f"{added[0]}: the group {group} is in the defaults list already (a + adds a group "
            f"that is not); choose its option without the +: {choice}")


def _no_slurm_here(exc: BaseException) -> str | None:
    """One line for submitit's "no srun" error: ``launcher=slurm`` run off a SLURM cluster."""
    if messages.submitit_no_srun(exc):
        return ("launcher=slurm submits to SLURM and this machine has none (no srun on PATH): "
                "run it on the cluster's login node, or try the layout here with "
                "launcher=slurm_local")
    return None


def _empty_output_folder(argv: list[str]) -> str | None:
    """One line for ``hydra.run.dir=''`` / ``hydra.sweep.dir=''`` on the command line: Hydra
    would write the run into the current folder, among the user's own files. Checked before
    Hydra creates anything."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+") in ("hydra.run.dir", "hydra.sweep.dir") and (
                not value.strip().strip("'\"").strip()):
            return (f"{key.lstrip('+')} is empty: it would write the run into the current "
                    "folder; give a folder path, or leave the key out (outputs/...)")
    return None


def _lost_job_line(exc: BaseException) -> str | None:
    """One line for submitit's ``UncompletedJobError`` (``launcher=slurm`` / ``slurm_local``): a
    job ended without returning a result (stopped by a signal, killed, out of memory); its
    folder's ``status.json`` and ``ddp_exp.log`` say what happened to the run inside it."""
    if type(exc).__name__ != "UncompletedJobError":
        return None
    first = " ".join(str(exc).strip().splitlines()[:2])[:400]
    return (f"a sweep job ended without returning a result (submitit: {first}); its job "
            "folder's status.json and ddp_exp.log say what happened to it")


def _disk_full_line(exc: BaseException) -> str | None:
    """One line for a full disk (``ENOSPC``/``EDQUOT``) met outside a rank: Hydra writing its
    ``.hydra/`` record, the launcher's own files (R16). Names the file, or else the job folder
    (``OSError`` of a file object's write names none). None for other errors."""
    if not is_disk_full(exc):
        return None
    if isinstance(exc, DiskFull):
        return str(exc)
    log_file = job_log_file()  # Hydra has reset its config: the job log's folder, or the typed
    typed = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("hydra.run.dir=")]
    folder = (os.path.dirname(log_file) if log_file else
              os.path.abspath(typed[-1]) if typed else "the job folder")
    return str(DiskFull(exc.errno, exc.strerror, exc.filename or folder))


def _output_folder_error(exc: BaseException) -> str | None:
    """One line for Hydra failing to create the run's or the sweep's folder (the path is a
    file, under a file, or not writable); None for any other error, an ``OSError`` of our own
    code included (told apart by the innermost frame of Hydra's or ours)."""
    import traceback

    if not isinstance(exc, OSError) or not exc.filename:
        return None
    hydra_dir = os.path.dirname(hydra.__file__) + os.sep
    ours = os.path.dirname(os.path.abspath(__file__)) + os.sep
    owners = [f.filename for f in traceback.extract_tb(exc.__traceback__)
              if f.filename.startswith((hydra_dir, ours))]
    if not owners or not owners[-1].startswith(hydra_dir):
        return None
    return (f"cannot create the output folder {exc.filename}: {exc.strerror}; set "
            "hydra.run.dir (hydra.sweep.dir with -m) to a folder that can be created and "
            "written")


E = TypeVar("E", bound=BaseException)


def _caused_by(exc: BaseException | None, kind: type[E]) -> E | None:
    """``exc`` or the first exception of type ``kind`` that caused it (through ``__cause__`` /
    ``__context__``), if any."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class Interrupted(BaseException):
    """SIGTERM before the elastic agent installs its own handler (which raises torch's
    ``SignalException``): a ``BaseException``, like ``KeyboardInterrupt``, so that no ``except
    Exception`` on the way (a data loader's error report) takes it for an error."""

    def __init__(self, sigval: signal.Signals):
        super().__init__(sigval.name)
        self.sigval = sigval


def _stop_on_sigterm() -> None:
    """SIGTERM to this process (the one that runs the jobs) raises :class:`Interrupted`:
    SIGTERM during start-up (config, data, model) then ends the job like Ctrl-C, with
    ``status.json`` saying interrupted and, in a sweep, the summary written; Python's default
    would end the process on the spot, leaving no record. Not under torchrun: there this
    process is a rank, and a rank must die on SIGTERM at once, even inside a collective
    (a forked rank inherits its launcher's signal handlers)."""
    if (under_torchrun() or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN):  # ignored stays ignored
        return

    def stop(signum: int, frame) -> None:
        raise Interrupted(signal.Signals(signum))

    signal.signal(signal.SIGTERM, stop)


def main() -> None:
    """Console entry: parse overrides with Hydra, run, and turn errors into exit statuses;
    the process then ends through :func:`exit_now`."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_importing:  # imports done
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # A log record that cannot be written (a full disk under the job log, a closed pipe) is
    # dropped, not printed as '--- Logging error ---' with a traceback; the run's own error
    # line says what failed (R16). The forked ranks inherit it.
    logging.raiseExceptions = False
    leftover = ignore_leftover_torchrun_variables()
    if leftover:  # a shell's variables from an earlier torchrun experiment (R12)
        print(f"warning: ignored {', '.join(leftover)}: set, but no torchrun started this "
              "command (no TORCHELASTIC_RUN_ID); it launches its own world", file=sys.stderr,
              flush=True)
    if under_torchrun() and asks_for_multirun(sys.argv[1:]):
        # Refused before Hydra creates a sweep folder: every rank sees it, rank 0 reports it
        # once; the others give it a moment to print before torchrun stops the world.
        if _is_rank0():
            print(f"error: {MULTIRUN_UNDER_TORCHRUN}", file=sys.stderr, flush=True)
        else:
            time.sleep(MULTIRUN_REFUSAL_GRACE_S)
        raise SystemExit(EXIT_CONFIG_ERROR)
    try:
        _main()
    except SystemExit as exc:
        if exc.code == EXIT_CONFIG_ERROR and under_torchrun() and not _is_rank0():
            # Every torchrun rank hits the same config error and rank 0 alone reports it; a rank
            # that left first made torchrun stop rank 0 before it printed (seen in 1 of 3 runs).
            # Rank 0's exit ends this wait: torchrun then stops the other ranks.
            time.sleep(TORCHRUN_REPORT_GRACE_S)
        exit_now(exc.code)
        raise
    exit_now(0)


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


def _record_unstarted_job(signal_name: str) -> None:
    """A signal that reached us outside a job's task, after Hydra made the job's folder and
    before the task ran: that folder gets ``status.json`` saying interrupted
    (:func:`ddp_exp.job.folder.record_unstarted_interrupt`), as a job stopped inside its task
    does. Rank 0 only under torchrun (the others have no folder)."""
    if _is_rank0():
        with contextlib.suppress(Exception):  # the record must not hide the interrupt
            record_unstarted_interrupt(signal_name, job_log_file())


def _summarize_if_sweep() -> None:
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


def _main() -> None:
    from hydra.errors import HydraException
    from torch.distributed.elastic.multiprocessing.api import SignalException

    sys.argv = multirun_flag_first(sys.argv)  # Hydra's parser takes -m before the overrides
    sys.argv += torchrun_overrides(sys.argv) + primary_config_overrides(sys.argv)
    empty = _empty_output_folder(sys.argv[1:])
    if empty:
        print(f"error: {empty}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG_ERROR)
    _stop_on_sigterm()
    user_wants_traceback = os.environ.get("HYDRA_FULL_ERROR") == "1"
    # Let composition errors reach us instead of Hydra's multi-line report, so that a value of
    # the wrong type (world_size=two) gets one line naming the key.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _task()
        raise_if_failed()
    except SweepFailed as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_RANK_FAILED) from None
    except KeyboardInterrupt:
        if user_wants_traceback:
            raise
        _record_unstarted_job("SIGINT")
        _summarize_if_sweep()
        if _is_rank0():  # under torchrun every rank gets Ctrl-C
            print("interrupted (SIGINT)", file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGINT) from None
    except (SignalException, Interrupted) as exc:  # between the jobs of a sweep, or at start-up
        _record_unstarted_job(exc.sigval.name)
        _summarize_if_sweep()
        print(f"interrupted ({exc.sigval.name})", file=sys.stderr, flush=True)
        raise SystemExit(128 + int(exc.sigval)) from None
    except HydraException as exc:
        if user_wants_traceback:
            raise
        sweep.discard_refused_sweep()  # a multirun's jobs that do not compose: before any job
        line = (_one_line(exc) or _plus_on_a_default(exc, sys.argv[1:])
                or _unknown_option_line(exc, sys.argv[1:]))
        if line is not None:
            hint = missing_plugin_hint(line)
            if _is_rank0():  # under torchrun every rank sees it
                print(f"error: {line}" + (f"; {hint}" if hint else ""), file=sys.stderr,
                      flush=True)
            raise SystemExit(EXIT_CONFIG_ERROR) from None
        if _is_rank0():  # under torchrun every rank sees it
            print(str(exc), file=sys.stderr)
            if exc.__cause__ is not None:
                print(str(exc.__cause__), file=sys.stderr)
            hint = missing_plugin_hint(f"{exc} {exc.__cause__}")
            if hint:
                print(hint, file=sys.stderr)
        # Hydra's own composition errors (an unknown option, a comma list without -m) are the
        # user's input too: the same exit status as ours.
        raise SystemExit(EXIT_CONFIG_ERROR) from None
    except Exception as exc:  # a ConfigError raised where Hydra resolves (a preset's resolver)
        line = (_caused_by(exc, ConfigError) or _no_slurm_here(exc)
                or _output_folder_error(exc) or null_group_line(exc, sys.argv[1:]))
        lost = _lost_job_line(exc) or _disk_full_line(exc)  # not the input's: a job's failure
        if (line or lost) is None or user_wants_traceback:
            raise
        if line:
            sweep.discard_refused_sweep()
        print(f"error: {line or lost}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG_ERROR if line else EXIT_RANK_FAILED) from None
    finally:
        # The run is over: exempt torch's millions of objects from the garbage collections of
        # interpreter shutdown, which otherwise take 1-3 s after every job (measured here).
        gc.freeze()


if __name__ == "__main__":
    main()
