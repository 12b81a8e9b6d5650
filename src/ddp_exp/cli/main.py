"""The command line of ``python -m ddp_exp [overrides]`` / ``ddp-exp`` (started by
:mod:`ddp_exp.cli.entry`), the Hydra task (and the
subcommands ``ddp-exp prepare`` and ``ddp-exp sample``: :mod:`ddp_exp.cli.commands`).

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

May use: :mod:`ddp_exp.cli.errors` (an error's line and exit status), :mod:`ddp_exp.cli.signals`
(signals, the exit), :mod:`ddp_exp.config`, :mod:`ddp_exp.rank.failures` (a failed world's line, a
failed rank's record under torchrun), :mod:`ddp_exp.cli.commands` (subcommands),
:mod:`ddp_exp.cli.usage` (``--help``), :mod:`ddp_exp.launch.cluster` (which task owns the folder),
:mod:`ddp_exp.job.folder`, :mod:`ddp_exp.launch.elastic`, :mod:`ddp_exp.launch.torchrun`,
:mod:`ddp_exp.job.sweep`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import signal
import sys
import time

import hydra
from omegaconf import DictConfig

from ddp_exp.cli.commands import dispatch
from ddp_exp.cli.errors import (
    EXIT_CONFIG_ERROR,
    EXIT_RANK_FAILED,
    empty_output_folder,
    error_exit,
    rendezvous_line,
)
from ddp_exp.cli.flags import flag_among_overrides, flags_first
from ddp_exp.cli.registry import register
from ddp_exp.cli.signals import (
    Interrupted,
    exit_now,
    record_unstarted_job,
    stop_on_sigterm,
    summarize_if_sweep,
)
from ddp_exp.cli.usage import help_requested, runs_no_job
from ddp_exp.compat.hydra_mode import decide_mode_without_composing
from ddp_exp.config.compose import preset_note, primary_config_overrides, task_overrides
from ddp_exp.config.errors import ConfigError
from ddp_exp.job import sweep
from ddp_exp.job.folder import (
    AlreadyComplete,
    LeaveFolderAlone,
    job_folder_lock,
    job_log_file,
    log_to_job_log_only,
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
from ddp_exp.launch.torchrun_env import (
    MULTIRUN_UNDER_TORCHRUN,
    asks_for_multirun,
    ignore_leftover_torchrun_variables,
    is_rank0,
    multirun_flag_first,
    torchrun_overrides,
    under_torchrun,
)
from ddp_exp.rank.preemption import EXIT_PREEMPTED, JobPreempted

log = logging.getLogger("ddp_exp")

TORCHRUN_REPORT_GRACE_S = 15.0
MULTIRUN_REFUSAL_GRACE_S = 2.0

register()  # the schema, the resolvers, the ddp_optuna sweeper
decide_mode_without_composing()  # Hydra composes once per job, not twice (~0.15 s)
if help_requested():  # Hydra lists the config groups twice: each answer once (seconds)
    from ddp_exp.compat.hydra_help import answer_group_options_once

    answer_group_options_once()
if not runs_no_job():  # a job: torch and the world's code now, while a Ctrl-C ends at once
    import ddp_exp.launch.elastic  # noqa: F401  (--help and --cfg job import no torch)
    import ddp_exp.rank.failures  # noqa: F401


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

    # torch and the world's code (imported with this module unless it only prints).
    from ddp_exp.launch.elastic import run_job
    from ddp_exp.rank.failures import PEER_FAILURE_GRACE_S, RankFailed, world_failure

    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:  # for a signal that comes between this job and the next
        sweep.active_sweep_dir = hc.sweep.dir
    # Under torchrun rank 0 reports; in a submitit job of several tasks, task 0.
    main_process = is_rank0() and owns_folder(cfg)
    t_start = time.time()
    error, code = None, 0
    say = None  # the error line for the console, printed once status.json is written
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
        if main_process and hc.mode != RunMode.MULTIRUN:  # "the job folder is unchanged":
            # one this run made (a finished run's checkpoint resumed into a new folder) goes
            remove_refused_folder(job_dir, hc.output_subdir, job_log_file())
        if main_process:  # a finished run is no error: a requeued finished job ends as done
            print(str(exc) if complete else f"error: {exc}", file=sys.stderr, flush=True)
        if hc.mode == RunMode.MULTIRUN and hc.job.num == 0:  # the sweep stops before any job
            sweep.discard_refused_sweep()
        raise SystemExit(0 if complete else EXIT_CONFIG_ERROR) from None
    except ConfigError as exc:
        # A value a preset set, not the user: the line says which preset and how to change it.
        error, code = str(exc) + preset_note(str(exc), hc), EXIT_CONFIG_ERROR
        if main_process:  # printed once status.json is written, or once the folder is gone
            say = f"error: {error}"
        # Refused in a folder that holds an earlier run: its status.json stays that run's.
        main_process = main_process and not getattr(exc, "folder_kept", False)
        if main_process and hc.mode == RunMode.MULTIRUN:  # the job's folder stays: say why
            # in its log alone: the console has the line once, below (it was printed twice)
            log_to_job_log_only(logging.ERROR, f"error: {exc}")
        elif main_process and remove_refused_folder(job_dir, hc.output_subdir, job_log_file()):
            print(say, file=sys.stderr, flush=True)
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
        if exc.report:  # the record first: the console may be gone (ddp_exp.io.console)
            write_status(exc.job_dir, "failed", overrides, time.time() - t_start, exc.line)
            print(f"error: {exc.line}", file=sys.stderr, flush=True)
        else:  # let the first failed rank report and exit first: torchrun names it the cause
            time.sleep(PEER_FAILURE_GRACE_S)
        raise SystemExit(EXIT_RANK_FAILED) from None
    except (RendezvousError, DistError) as exc:  # the launcher's rendezvous, not a rank
        line = rendezvous_line(exc, cfg)
        if main_process:
            say = f"error: {line}"
        error, code = line, EXIT_RANK_FAILED
    except ChildFailedError as exc:
        error, one_line = world_failure(exc)
        code = EXIT_RANK_FAILED
        if one_line:  # an exception in a rank (the user's code, or ours): one line
            log_to_job_log_only(logging.ERROR, f"training failed\n{exc.format_msg()}")
            if main_process:
                say = f"error: {error}"
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

    if error is not None and is_rank0() and not owns_folder(cfg):
        # A task standing for another node (submitit, srun): the owner reports the job, so
        # this task's refusal or rendezvous error was silent, and the owner waited for it.
        log.error("this node's task failed before its ranks started: %s", error)
    if main_process:
        write_status(job_dir, "failed" if error else "completed", overrides,
                     time.time() - t_start, error,
                     None if error or final is None else final.get("pruned_at_epoch"))
    if say:  # after the record: what happens to the console cannot cost status.json
        print(say, file=sys.stderr, flush=True)
    if error is None:
        return objective(None if final is None else final.get("val/loss"), hc.sweeper)
    if hc.mode == RunMode.MULTIRUN:
        return objective(math.nan, hc.sweeper)
    raise SystemExit(code)


def main() -> None:
    """Console entry: parse overrides with Hydra, run, and turn errors into exit statuses;
    the process then ends through :func:`exit_now`. A subcommand (``ddp-exp runs``, ...:
    :data:`ddp_exp.cli.commands.COMMANDS`) runs instead of Hydra."""
    code = dispatch(sys.argv[1:])
    if code is not None:
        raise SystemExit(code)
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
        if is_rank0():
            print(f"error: {MULTIRUN_UNDER_TORCHRUN}", file=sys.stderr, flush=True)
        else:
            time.sleep(MULTIRUN_REFUSAL_GRACE_S)
        raise SystemExit(EXIT_CONFIG_ERROR)
    try:
        _main()
    except SystemExit as exc:
        if exc.code == EXIT_CONFIG_ERROR and under_torchrun() and not is_rank0():
            # Every torchrun rank hits the same config error and rank 0 alone reports it; a rank
            # that left first made torchrun stop rank 0 before it printed (seen in 1 of 3 runs).
            # Rank 0's exit ends this wait: torchrun then stops the other ranks.
            time.sleep(TORCHRUN_REPORT_GRACE_S)
        exit_now(exc.code)
        raise
    exit_now(0)


class _NotRaised(Exception):
    """Stands for torch elastic's ``SignalException`` where no job imported torch."""


def _signal_exception() -> type[BaseException]:
    """torch elastic's ``SignalException`` (the agent stopped by a signal) once a job has
    imported it, else :class:`_NotRaised`: ``--help`` and ``--cfg job`` import no torch."""
    api = sys.modules.get("torch.distributed.elastic.multiprocessing.api")
    return getattr(api, "SignalException", _NotRaised)


def _main() -> None:
    sys.argv = multirun_flag_first(sys.argv)  # Hydra's parser takes -m before the overrides
    refused = empty_output_folder(sys.argv[1:]) or flag_among_overrides(sys.argv[1:])
    if not refused:  # flags after every override: first, so that appended overrides follow
        sys.argv = sys.argv[:1] + flags_first(sys.argv[1:])
    sys.argv += torchrun_overrides(sys.argv) + primary_config_overrides(sys.argv)
    if refused:  # before Hydra parses the command and makes any folder
        if is_rank0():  # under torchrun every rank parses alike
            print(f"error: {refused}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG_ERROR)
    stop_on_sigterm()
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
        record_unstarted_job("SIGINT")
        summarize_if_sweep()
        if is_rank0():  # under torchrun every rank gets Ctrl-C
            print("interrupted (SIGINT)", file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGINT) from None
    except (_signal_exception(), Interrupted) as exc:  # between a sweep's jobs, or at start-up
        record_unstarted_job(exc.sigval.name)
        summarize_if_sweep()
        print(f"interrupted ({exc.sigval.name})", file=sys.stderr, flush=True)
        raise SystemExit(128 + int(exc.sigval)) from None
    except Exception as exc:  # Hydra's, a preset's resolver's, submitit's: one line or a bug
        out = None if user_wants_traceback else error_exit(exc, sys.argv[1:])
        if out is None:
            raise
        if out.code == EXIT_CONFIG_ERROR:  # a multirun's jobs that do not compose: before any job
            sweep.discard_refused_sweep()
        if out.every_rank or is_rank0():  # under torchrun every rank composes alike
            print(out.text, file=sys.stderr, flush=True)
        raise SystemExit(out.code) from None
    finally:
        # The run is over: exempt torch's millions of objects from the garbage collections of
        # interpreter shutdown, which otherwise take 1-3 s after every job (measured here).
        gc.freeze()


if __name__ == "__main__":
    main()
