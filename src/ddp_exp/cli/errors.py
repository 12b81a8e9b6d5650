"""The entry point's errors: each failure users meet, as one line and an exit status.

:data:`ROWS` is the table from exception to line: each row reads one kind of error (Hydra's
composition errors; an exception raised where Hydra resolves, makes folders or launches) and
returns its line, or None when the error is not its kind; the first row that answers wins
(:func:`error_exit`). A new error message is a formatter and a row here, not an ``except`` in
:mod:`ddp_exp.cli.main`. Exit statuses: :data:`EXIT_CONFIG_ERROR` (2) for the user's input,
refused before any rank starts, :data:`EXIT_RANK_FAILED` (1) for a job that failed. Also here:
the rendezvous failure's line (:func:`rendezvous_line`) and the check of an empty output folder
made before Hydra starts (:func:`empty_output_folder`).

May use: :mod:`ddp_exp.config`, :mod:`ddp_exp.io.files` (a full disk), :mod:`ddp_exp.job.folder`
(the job log's folder), :mod:`ddp_exp.launch.torchrun` (a torchrun rank's wait),
:mod:`ddp_exp.launch.user_input` (the groups whose ``_target_`` a user replaces),
:mod:`ddp_exp.compat` (upstream messages).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import hydra
from hydra.errors import HydraException
from omegaconf import DictConfig

import ddp_exp
from ddp_exp.compat import messages
from ddp_exp.config.compose import group_options, null_group_line
from ddp_exp.config.errors import ConfigError, described
from ddp_exp.io.files import DiskFull, is_disk_full
from ddp_exp.job.folder import job_log_file
from ddp_exp.launch.torchrun_env import under_torchrun
from ddp_exp.launch.user_input import TARGET_GROUPS

EXIT_CONFIG_ERROR = 2
EXIT_RANK_FAILED = 1


def rendezvous_line(exc: BaseException, cfg: DictConfig) -> str:
    """One line for a rendezvous that failed in this launcher (a node that never came, a port
    taken, two nodes with one node_rank), naming the setting that bounded the wait: under
    torchrun, a rank's wait for its peers is ``distributed.timeout_s``."""
    la = cfg.launcher
    if under_torchrun():  # this rank waited for its peers at torchrun's store
        return (f"rank {os.environ['RANK']} of torchrun's WORLD_SIZE={os.environ['WORLD_SIZE']} "
                f"did not meet the other ranks at {os.environ.get('MASTER_ADDR')}:"
                f"{os.environ.get('MASTER_PORT')} within distributed.timeout_s="
                f"{cfg.distributed.timeout_s:g} s ({described(exc)}); every rank "
                "must start within distributed.timeout_s")
    return (f"the {la.rdzv_backend} rendezvous at {la.rdzv_endpoint} failed "
            f"({described(exc)}); every one of the launcher.nnodes={la.nnodes} "
            "nodes must start within launcher.rdzv_timeout_s with the same endpoint"
            + (" and its own launcher.node_rank" if la.rdzv_backend == "static" else "")
            + " and its own hydra.run.dir")


def _schema_keys(schema: Any) -> list[str]:
    """The keys a user may give a schema dataclass's section (``_target_`` and the like
    left out)."""
    return [f.name for f in dataclasses.fields(schema) if not f.name.startswith("_")]


def _one_line(exc: BaseException, argv: Sequence[str] = ()) -> str | None:
    """A one-line message for a config value of the wrong type, or None for other errors."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    from ddp_exp.config.choices import refused_choice

    # A name that no member of the key's Enum has: on the command line (the cause), or in a
    # YAML file (Hydra raises its error inside OmegaConf's: the context).
    choice = refused_choice(exc.__cause__ or exc.__context__)
    if choice is not None:
        return choice
    cause = exc.__cause__
    if not (isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None)):
        return None
    msg = str(getattr(cause, "msg", cause)).splitlines()[0]
    wanted = messages.omegaconf_wrong_type(msg)
    if wanted is not None:  # world_size=two: "... could not be converted to Integer"
        value = getattr(cause, "value", None)
        shown = "null" if value is None else repr(str(value))
        return f"{cause.full_key}={shown} is invalid: {wanted}"
    schema = getattr(cause, "object_type", None)
    unknown_key = isinstance(cause, (ConfigAttributeError, ConfigKeyError))
    if unknown_key and dataclasses.is_dataclass(schema):
        msg += f"; valid keys: {', '.join(_schema_keys(schema))}"
        if str(cause.full_key).split(".", 1)[0] in TARGET_GROUPS:  # a _target_ replaced
            msg += f"; an argument of your own _target_ is added with +{cause.full_key}=..."
    elif unknown_key:  # under a free-form node (data.transform, a user's target's arguments)
        msg += f"; to add it, write +{cause.full_key}=..."
    elif messages.omegaconf_no_deletion(msg) and str(cause.full_key).split(".", 1)[0] in (
            TARGET_GROUPS):  # ~model.hidden_sizes, to give model._target_=my.Net
        msg += ("; no need to delete it for your own _target_: one given in its place drops "
                "the keys its signature does not take")
    elif messages.omegaconf_no_deletion(msg):  # ~trainer.epochs: the schema's keys stay
        msg += (f"; a key of ddp_exp's schema cannot be deleted: give it a value instead "
                f"({cause.full_key}=...)")
    return f"{cause.full_key}: {msg}"


def _preset_key_line(exc: BaseException, argv: Sequence[str] = ()) -> str | None:
    """One line for a preset that sets a key the option chosen on the command line does not
    have: ``experiment=gpt_tokens scheduler=none`` (the preset sets ``scheduler.warmup_steps``
    for its own ``scheduler=cosine``). Hydra reported it in four lines, ``In
    'experiment/gpt_tokens': ConfigKeyError raised while composing config: ...`` (its own
    exception raised while handling OmegaConf's, not from it: a fresh user's find). None for
    any other error, and where the key's group was not chosen on the command line (the
    preset's own mistake: :func:`_one_line`'s line)."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    preset = messages.hydra_asking_config(str(exc))
    cause = exc.__cause__ or exc.__context__
    if preset is None or not isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        return None
    key = str(getattr(cause, "full_key", "") or "")
    group = key.split(".", 1)[0]
    chosen = [a for a in argv if a.split("=", 1)[0].lstrip("+") == group and "=" in a]
    schema = getattr(cause, "object_type", None)
    if not chosen or "/" not in preset or not dataclasses.is_dataclass(schema):
        return None
    keys = _schema_keys(schema)
    option = preset.replace("/", "=", 1)
    return (f"{option} sets {key}, which {chosen[-1].lstrip('+')} does not have (its keys: "
            f"{', '.join(keys) or 'none'}): the preset's values are for the option it "
            f"chooses; leave {chosen[-1].lstrip('+')} out, or give your own copy of the preset "
            "(--config-dir) without that key")


def _override_syntax_line(exc: BaseException, argv: Sequence[str] = ()) -> str | None:
    """One line for an override Hydra's grammar cannot parse (``OverrideParseException``):
    a value with a space or a letter outside ASCII (``hydra.run.dir=/tmp/rüns``), an unclosed
    list (``data.batch_size=[1,2``). Hydra printed its parser's words and a caret under the
    place, without ``error:`` (a fresh user's find); the line names the override, Hydra's
    reason and how a value is quoted. None for any other error."""
    from hydra.errors import OverrideParseException

    if not isinstance(exc, OverrideParseException):
        return None
    reason = " ".join(str(exc.message).split("See https://")[0].split())
    reason = reason.replace(f" {exc.override}", "").rstrip(" ^")
    if reason.startswith("LexerNoViableAltException"):  # its words and a caret, no more
        reason = "a character it does not take in an unquoted value"
    return (f"{exc.override}: Hydra cannot parse this override ({reason}); quote a value with "
            "spaces, letters outside ASCII or Hydra's special characters for Hydra, inside "
            "the shell's quotes: \"hydra.run.dir='/tmp/rüns x'\"; a list is [a,b]")


# Hydra plugins that presets use, and the extra that installs each.
PLUGIN_EXTRAS = {
    "submitit": ("hydra_plugins.hydra_submitit_launcher", "slurm"),
    "joblib": ("hydra_plugins.hydra_joblib_launcher", "sweeps"),
}


# Plugins that presets no longer use (the config path Hydra looks for), and the line that names
# the replacement.
REPLACED_PLUGINS = {
    "hydra/sweeper/optuna":
        "hint: hydra/sweeper=optuna (Hydra's Optuna sweeper: optuna<3, no pruning) is replaced "
        "by hydra/sweeper=ddp_optuna, the same keys but sampler.name (pip install -e "
        "'.[optuna]'; see docs/sweeps.md)",
}


# The words of _unknown_option_line: "hydra/launcher=submitit_slurm (asked for by
# launcher/slurm): no such option in config group hydra/launcher; ...".
NO_SUCH_OPTION = re.compile(r"(\S+)=(\S+)(?: \(asked for by [^)]*\))?: no such option in config "
                            r"group ")


def missing_plugin_hint(error_text: str) -> str | None:
    """The install line for a Hydra plugin that ``error_text`` (Hydra's composition error, or
    the line :func:`_unknown_option_line` made of it) looks for and that is not installed, e.g.
    ``launcher=slurm`` without the ``slurm`` extra; the config paths it names are read from
    the one line's words and Hydra's (:func:`ddp_exp.compat.messages.hydra_missing_configs`)."""
    import importlib.util

    paths = [f"{group}/{option}" for group, option in NO_SUCH_OPTION.findall(error_text)]
    paths += messages.hydra_missing_configs(error_text)
    for path in paths:
        if path in REPLACED_PLUGINS:
            return REPLACED_PLUGINS[path]
    for word, (module, extra) in PLUGIN_EXTRAS.items():
        if not any(word in path for path in paths):
            continue
        try:
            installed = importlib.util.find_spec(module) is not None
        except ImportError:  # find_spec imports the parent, hydra_plugins: no plugin at all
            installed = False
        if not installed:
            return f"hint: this needs Hydra's {word} plugin: pip install -e '.[{extra}]'"
    return None


def _unknown_option_line(exc: BaseException, argv: Sequence[str]) -> str | None:
    """One line for a config group option that does not exist (``data=digitz``), instead of
    Hydra's report over ten lines (the valid options one per line, then its config search
    path); naming the config that asked for it when the command line did not
    (``launcher=slurm`` asks for ``hydra/launcher=submitit_slurm``). None for other errors."""
    from hydra.errors import MissingConfigException

    missing = _caused_by(exc, MissingConfigException)
    if missing is None or not missing.missing_cfg_file:
        return None
    group, _, choice = missing.missing_cfg_file.rpartition("/")
    # one option of a list (logger=[csv,foo]): Hydra's "Could not load" names no options
    options = missing.options or _group_options(group)
    if not group or not options:
        return None
    asked = messages.hydra_asking_config(str(missing))
    typed = any(arg.lstrip("+~").partition("=")[0] == group for arg in argv)
    # Hydra names its own primary config for an override that a preset's defaults list makes
    # (hparams_search=digits_optuna: /hydra/sweeper: optuna): no clue to a user.
    where = (f" (asked for by {asked})" if asked and not typed
             and asked not in ("config", "hydra/config") else "")
    return (f"{group}={choice}{where}: no such option in config group {group}; valid "
            f"options: {', '.join(options)}")


def _group_options(group: str) -> list[str]:
    """The options of config ``group``: Hydra's config loader where it still holds the
    composition's search path (in-process, ``hydra.compose``; a ``--config-dir``'s options
    too), else the options ddp_exp ships (:func:`ddp_exp.config.compose.group_options`: the
    command line's Hydra has been cleared after the failed composition)."""
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return sorted(GlobalHydra.instance().config_loader().get_group_options(group))
    return group_options(group)


def _plus_on_a_default(exc: BaseException, argv: Sequence[str]) -> str | None:
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


def _no_slurm_here(exc: BaseException, argv: Sequence[str] = ()) -> str | None:
    """One line for submitit's "no srun" error: ``launcher=slurm`` run off a SLURM cluster."""
    if messages.submitit_no_srun(exc):
        return ("launcher=slurm submits to SLURM and this machine has none (no srun on PATH): "
                "run it on the cluster's login node, or try the layout here with "
                "launcher=slurm_local")
    return None


def empty_output_folder(argv: list[str]) -> str | None:
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


def _lost_job_line(exc: BaseException, argv: Sequence[str] = ()) -> str | None:
    """One line for submitit's ``UncompletedJobError`` (``launcher=slurm`` / ``slurm_local``): a
    job ended without returning a result (stopped by a signal, killed, out of memory); its
    folder's ``status.json`` and ``ddp_exp.log`` say what happened to the run inside it."""
    if type(exc).__name__ != "UncompletedJobError":
        return None
    first = " ".join(str(exc).strip().splitlines()[:2])[:400]
    return (f"a sweep job ended without returning a result (submitit: {first}); its job "
            "folder's status.json and ddp_exp.log say what happened to it")


def _disk_full_line(exc: BaseException, argv: Sequence[str] = ()) -> str | None:
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


def _output_folder_error(exc: BaseException, argv: Sequence[str] = ()) -> str | None:
    """One line for Hydra failing to create the run's or the sweep's folder (the path is a
    file, under a file, or not writable), or to write its first file there (``multirun.yaml``;
    the job log, whose ``OSError`` the logging module raises again as ``ValueError: Unable to
    configure handler 'file'``: an existing read-only folder gave that traceback); None for
    any other error, an ``OSError`` of our own code included (told apart by the innermost
    frame of Hydra's or ours)."""
    import traceback

    error = _caused_by(exc, OSError)
    if error is None or not error.filename:
        return None
    hydra_dir = os.path.dirname(hydra.__file__) + os.sep
    ours = os.path.dirname(os.path.abspath(ddp_exp.__file__)) + os.sep
    owners = [f.filename for f in traceback.extract_tb(exc.__traceback__)
              if f.filename.startswith((hydra_dir, ours))]
    if not owners or not owners[-1].startswith(hydra_dir):
        return None
    path = str(error.filename)
    frames = traceback.extract_tb(error.__traceback__)
    making = bool(frames) and frames[-1].name in ("makedirs", "mkdir")  # the folder itself
    folder = os.path.dirname(path)
    what = (f"cannot create the output folder {path}: {error.strerror}" if making
            else f"cannot write in the output folder {folder}: {error.strerror} "
                 f"({os.path.basename(path)})")
    return (f"{what}; set hydra.run.dir (hydra.sweep.dir with -m) to a folder that can be "
            "created and written")


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


def _hydra_words_line(exc: BaseException, argv: Sequence[str] = ()) -> str | None:
    """One line for Hydra's own several-line reports of the command line: a comma list
    without ``-m`` ("Ambiguous value ...", 4 lines) and a ``--config-name`` that is no config
    ("Cannot find primary config ...", the search path after it: 6 lines)."""
    del argv
    text = str(exc)
    ambiguous = re.match(r"Ambiguous value for argument '([^']*)'", text)
    if ambiguous:
        arg = ambiguous.group(1)
        key, _, value = arg.partition("=")
        return (f"{arg}: a comma list is a sweep or a list: python -m ddp_exp -m {arg} runs "
                f"one job each, {key}=[{value}] is one list value, {key}='{value}' one string")
    primary = re.match(r"Cannot find primary config '([^']*)'", text)
    if primary:
        return (f"--config-name={primary.group(1)}: no such config (ddp_exp's own is config; "
                "a NAME.yaml in a --config-dir folder is found too)")
    return None


def _config_error_line(exc: BaseException, argv: Sequence[str] = ()) -> str | None:
    """The message of a :class:`ddp_exp.config.errors.ConfigError` that raised ``exc`` or caused
    it where Hydra resolves (a preset's resolver); None for other errors."""
    found = _caused_by(exc, ConfigError)
    return None if found is None else str(found)


@dataclass(frozen=True)
class Row:
    """One row of :data:`ROWS`: a kind of error and its line.

    Attributes:
        line: ``(exception, command-line arguments) -> str | None``: the one line (without
            ``error:``), or None when the exception is not this row's kind.
        code: the exit status: :data:`EXIT_CONFIG_ERROR` for the user's input (a sweep about to
            start is discarded), :data:`EXIT_RANK_FAILED` for a job that failed.
        composition: the row reads Hydra's composition errors (``HydraException``), which every
            torchrun rank meets alike: rank 0 alone prints the line, with the install line of a
            Hydra plugin it names (:func:`missing_plugin_hint`). The other rows read any other
            exception, printed by the process that met it.
    """

    line: Callable[[BaseException, Sequence[str]], str | None]
    code: int = EXIT_CONFIG_ERROR
    composition: bool = False


# The exception -> one line table, read top to bottom: the first row with a line wins.
ROWS: tuple[Row, ...] = (
    # Hydra's composition errors: the command line or a config file.
    Row(_override_syntax_line, composition=True),  # hydra.run.dir=/tmp/rüns, [1,2
    Row(_preset_key_line, composition=True),  # experiment=gpt_tokens scheduler=none
    Row(_one_line, composition=True),  # a value of the wrong type, an unknown key
    Row(_plus_on_a_default, composition=True),  # +data=... where data is chosen already
    Row(_unknown_option_line, composition=True),  # data=digitz
    Row(_hydra_words_line, composition=True),  # data=a,b without -m; --config-name nope
    # Raised where Hydra resolves, makes folders or launches: the input's too.
    Row(_config_error_line),  # a ConfigError from a preset's resolver
    Row(_no_slurm_here),  # launcher=slurm off SLURM
    Row(_output_folder_error),  # hydra.run.dir that cannot be made
    Row(null_group_line),  # scheduler=null
    # Not the input's: a job that failed.
    Row(_lost_job_line, EXIT_RANK_FAILED),  # a sweep job submitit lost
    Row(_disk_full_line, EXIT_RANK_FAILED),  # a full disk outside any rank
)


@dataclass(frozen=True)
class ErrorExit:
    """How the entry point ends on an error: ``text`` on stderr, exit status ``code``;
    ``every_rank``: printed by every torchrun rank that meets it, else by rank 0 alone."""

    text: str
    code: int
    every_rank: bool


def error_exit(exc: BaseException, argv: Sequence[str]) -> ErrorExit | None:
    """What the entry point prints for ``exc``, which reached it from Hydra or a job, and its
    exit status: the line of the first row of :data:`ROWS` for the exception's kind that has
    one. A composition error that no row knows is shown in Hydra's own words (its message and
    its cause, several lines), exit 2: an unknown option, a comma list without ``-m``, the
    user's input too. None for any other exception: a bug, whose traceback is shown."""
    composition = isinstance(exc, HydraException)
    for row in ROWS:
        line = row.line(exc, argv) if row.composition == composition else None
        if line:
            hint = missing_plugin_hint(line) if composition else None
            return ErrorExit(f"error: {line}" + (f"; {hint}" if hint else ""), row.code,
                             every_rank=not composition)
    if not composition:
        return None
    text = str(exc) + (f"\n{exc.__cause__}" if exc.__cause__ is not None else "")
    hint = missing_plugin_hint(f"{exc} {exc.__cause__}")
    return ErrorExit(text + (f"\n{hint}" if hint else ""), EXIT_CONFIG_ERROR, every_rank=False)
