"""Other libraries' message wording that ddp_exp reads: each reader matches only on the version
its wording was read from (:mod:`ddp_exp.compat.versions`), and on any other gives "no match",
so the caller takes its stock path (Hydra's or torch's own report) and the log says so once.

What each buys (issue 27 item 3), by the reader:

* Hydra 1.3 (:func:`hydra_group_given_twice`, :func:`hydra_asking_config`,
  :func:`hydra_null_group`) and OmegaConf 2.3 (:func:`omegaconf_no_deletion`): a mistake on the
  command line is one line naming the fix instead of Hydra's multi-line report or a traceback.
* submitit 1.5 (:func:`submitit_no_srun`): ``launcher=slurm`` off a cluster is one line instead
  of a traceback.
* torch 2.13 (:func:`peer_went_away`): a rank that failed because a peer went away is reported as
  the knock-on effect, not as the failure (a wrong result: the launcher named the wrong rank).
* torch 2.13's ``torch.load`` (:func:`torch_load_refused`, :func:`torch_load_reason`,
  :func:`torch_load_broken`): a checkpoint or data file that does not load is one line naming
  what it holds, instead of torch's eight.
* torch 2.13's DataLoader (:func:`carries_traceback`): a rank failed by an error in a data
  loader's worker is named by the original error, not by "Caught ValueError in DataLoader worker
  process 0." (which names no cause).
* torch 2.13's collective timeouts (:func:`collective_timed_out`): a rank that timed out
  waiting for a stalled peer is reported with where the ranks still running were
  (:mod:`ddp_exp.rank.stacks`), not as the cause alone.
* torch 2.13's agent log (:func:`agent_rank_failure`, :func:`agent_closing_process`): a failed
  rank's traceback is shown once, not twice, the restarted world names the rank that failed, and
  a Ctrl-C ends with one line rather than one "Closing process" line per rank.
* torch 2.13's ``load_state_dict`` (:func:`torch_state_dict_details`): a checkpoint of another
  model is refused in one line naming the keys that differ, not torch's header, which names none.
* Hydra 1.3's "Could not find" (:func:`hydra_missing_configs`): a preset whose plugin is not
  installed (``launcher=slurm`` without the ``slurm`` extra) is refused with the install line.
"""

from __future__ import annotations

import re
from typing import Any

from ddp_exp.compat.versions import written_for

STOCK_REPORT = "the library's own report is shown"

# Hydra 1.3, an override that adds (+group=option) a group the defaults list has already:
# "Multiple values for data. To override a value use 'override data: synthetic'",
# "hydra/launcher appears more than once in the final defaults list".
GROUP_TWICE = re.compile(r"^Multiple values for (\S+)\.|^(\S+) appears more than once in the "
                         r"final defaults list")
# Hydra 1.3, a missing option named by a config's defaults list: "In 'config': Could not find
# 'data/digitz'" (the config that asked for it).
ASKING_CONFIG = re.compile(r"In '([^']+)':")
# Hydra 1.3, ``group=null``: "Config group override must be a string or a list. Got NoneType".
NULL_GROUP = "Config group override must be"
# OmegaConf 2.3, ``~model.hidden_sizes`` on a typed node: "MLPConfig (DictConfig) does not
# support deletion".
NO_DELETION = "does not support deletion"
# submitit 1.5's SlurmExecutor: 'Could not detect "srun", are you indeed on a slurm cluster?'.
NO_SRUN = 'Could not detect "srun"'
# torch 2.13: what a collective raises when a peer rank's process went away (gloo's own words,
# then the C library's for ECONNRESET and EPIPE; NCCL's on CUDA).
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "NCCL communicator was aborted")
# torch 2.13's elastic agent (torch.distributed.elastic.multiprocessing.api): the log record of
# a failed rank ("failed (exitcode: %s) local_rank: %s ...", its first two arguments the exit
# code and the local rank) and of each rank it stops ("Closing process %s via signal %s"; and
# torch.multiprocessing's "Terminating process %s via signal SIGTERM").
RANK_FAILED = "failed (exitcode"
# torch 2.13's DataLoader re-raises a worker's error as "Caught ValueError in DataLoader worker
# process 0.\nOriginal Traceback (most recent call last): ..."; CPython's own traceback header.
CARRIED_TRACEBACK = ("Original Traceback", "Traceback (most recent call last)")
# torch 2.13's torch.load(weights_only=True): an object it refuses ("... WeightsUnpickler error:
# Unsupported global: GLOBAL mod.Class was not an allowed global ..."), and a file that is not a
# whole zip archive ("PytorchStreamReader failed reading zip archive: failed finding central
# directory").
REFUSED_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")
DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
UNPICKLER_REASON = re.compile(r"WeightsUnpickler error: ([^\n]+)")
BROKEN_ARCHIVE = "zip archive"
# torch 2.13's legacy (not zip) loader on a file whose first pickle is not its magic number.
BAD_MAGIC = "Invalid magic number"
STOCK_LOAD = "a file that does not load is named with torch's error's first sentence"
# torch 2.13's elastic agent (torch.distributed.elastic.agent.server.api) on Ctrl-C or SIGTERM:
# "Received %s death signal, shutting down workers" (the entry point's one line says it).
DEATH_SIGNAL = "Received %s death signal"
CLOSING = ("Closing process", "Terminating process", DEATH_SIGNAL)


def hydra_group_given_twice(text: str) -> str | None:
    """The config group Hydra's composition error ``text`` says was given twice (``data`` for
    ``+data=synthetic``), None for any other error or on a Hydra other than 1.3."""
    match = GROUP_TWICE.match(text.strip())
    if match is None or not written_for("hydra-core", "Hydra's 'Multiple values for' wording",
                                        STOCK_REPORT):
        return None
    return match.group(1) or match.group(2)


def hydra_asking_config(text: str) -> str | None:
    """The config whose defaults list asked for a missing option, from Hydra's
    ``MissingConfigException`` text ("In 'launcher/slurm': Could not find ..."); None when the
    text names none, or on a Hydra other than 1.3."""
    match = ASKING_CONFIG.match(text.strip())
    if match is None or not written_for("hydra-core", "Hydra's \"In '<config>':\" wording",
                                        STOCK_REPORT):
        return None
    return match.group(1)


def hydra_null_group(exc: BaseException) -> bool:
    """True for Hydra's error on ``group=null`` (a ``ValueError``); False for any other, or on
    a Hydra other than 1.3."""
    return (isinstance(exc, ValueError) and NULL_GROUP in str(exc)
            and written_for("hydra-core", "Hydra's 'Config group override must be' wording",
                            STOCK_REPORT))


# OmegaConf 2.3's refusals of a value of the wrong type for a typed key.
NOT_CONVERTED = re.compile(r"Value '.*' of type '\w+' could not be converted to (Integer|Float|"
                           r"Boolean)")
NOT_OPTIONAL = re.compile(r"field '[^']*' is not Optional")
NOT_A_LIST = "is not a ListConfig, list or tuple"
NOT_A_BOOL = re.compile(r"Value '.*' is not a valid bool")
EXPECTED = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}


def omegaconf_wrong_type(message: str) -> str | None:
    """What a typed key takes, from OmegaConf's refusal ``message`` of a value of the wrong
    type: "an integer", "a number", "true or false", "a value, not null", "a list in brackets";
    None for any other message, or on an OmegaConf other than 2.3."""
    converted = NOT_CONVERTED.search(message)
    wanted = (EXPECTED[converted.group(1)] if converted else
              "true or false" if NOT_A_BOOL.search(message) else
              "a value, not null" if NOT_OPTIONAL.search(message) else
              "a list in brackets, such as [64,32]" if NOT_A_LIST in message else None)
    if wanted is None or not written_for("omegaconf", "OmegaConf's type-refusal wording",
                                         STOCK_REPORT):
        return None
    return wanted


def omegaconf_no_deletion(message: str) -> bool:
    """True for OmegaConf's refusal to delete a key of a typed node (``~model.hidden_sizes``);
    False for any other message, or on an OmegaConf other than 2.3."""
    return NO_DELETION in message and written_for(
        "omegaconf", "OmegaConf's 'does not support deletion' wording", STOCK_REPORT)


def submitit_no_srun(exc: BaseException) -> bool:
    """True for submitit's error when its SLURM executor finds no ``srun`` on PATH; False for
    any other error, or on a submitit other than 1.5."""
    return (isinstance(exc, RuntimeError) and NO_SRUN in str(exc)
            and written_for("submitit", "submitit's 'Could not detect \"srun\"' wording",
                            STOCK_REPORT))


def peer_went_away(text: str) -> bool:
    """True when a collective's error ``text`` says a peer rank's connection went away (closed,
    reset, a broken pipe, an aborted NCCL communicator); False otherwise, or on a torch other
    than 2.13 (every such error is then this rank's own)."""
    return any(s in text for s in PEER_GONE) and written_for(
        "torch", "gloo's 'Connection closed by peer' wording",
        "a rank whose peer went away is reported as failed itself")


# torch 2.13's collective timeouts: gloo's "Timed out waiting 8000ms for recv operation to
# complete", the store's "wait timeout after 8000ms, keys: ..." and NCCL's watchdog's
# "Watchdog caught collective operation timeout: WorkNCCL(...)".
COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting \d+ms for (recv|send) operation|"
                                r"wait timeout after \d+ms|"
                                r"Watchdog caught collective operation timeout")


def collective_timed_out(text: str) -> bool:
    """True when a rank's error ``text`` says one of its collectives timed out waiting for a
    peer (gloo, the store, NCCL's watchdog), where another rank is the likely cause (it never
    joined); False otherwise, or on a torch other than 2.13 (the failure is reported as the
    rank's own, without the others' stacks: :mod:`ddp_exp.rank.stacks`)."""
    return COLLECTIVE_TIMEOUT.search(text) is not None and written_for(
        "torch", "gloo's 'Timed out waiting ...ms for recv operation' wording",
        "a collective's timeout is reported without where the other ranks were")


def agent_rank_failure(record: Any) -> tuple[Any, Any] | None:
    """``(exit code, local rank)`` from the elastic agent's log record of a failed rank; None
    for any other record, or on a torch other than 2.13 (the agent's record is then shown)."""
    if not str(record.msg).startswith(RANK_FAILED) or not written_for(
            "torch", "the elastic agent's 'failed (exitcode' record",
            "a failed rank's traceback is shown twice, and a restart does not name the rank"):
        return None
    exitcode, local_rank = (tuple(record.args or ()) + (None, None))[:2]
    return exitcode, local_rank


def agent_closing_process(message: str) -> bool:
    """True for the elastic agent's "Closing process <pid> via signal SIGTERM" line (and
    torch.multiprocessing's "Terminating process ..."), logged once per rank it stops, and for
    its "Received 2 death signal, shutting down workers" on a signal; False for any other, or
    on a torch other than 2.13."""
    return str(message).startswith(CLOSING) and written_for(
        "torch", "the elastic agent's 'Closing process' record",
        "each rank stopped is logged (Closing process <pid> via signal SIGTERM)")


def torch_load_refused(text: str) -> str | None:
    """The global (``mod.Class``) that ``torch.load(weights_only=True)`` refused, from its
    error's ``text``; None for any other error, for a "global" that is no dotted Python name
    (a text file that starts with ``c``, pickle's GLOBAL opcode, names lines of text), or on a
    torch other than 2.13."""
    match = REFUSED_GLOBAL.search(text)
    if match is None or not written_for("torch", "torch.load's 'Unsupported global' wording",
                                        STOCK_LOAD):
        return None
    return match.group(1) if DOTTED_NAME.fullmatch(match.group(1)) else None


def torch_load_reason(text: str) -> str | None:
    """The reason ``torch.load(weights_only=True)``'s unpickler gives (the line after
    "WeightsUnpickler error: "); None where the text has none, or on a torch other than 2.13."""
    match = UNPICKLER_REASON.search(text)
    if match is None or not written_for("torch", "torch.load's 'WeightsUnpickler error' wording",
                                        STOCK_LOAD):
        return None
    return match.group(1)


def torch_load_broken(exc: BaseException, text: str) -> bool:
    """True when ``torch.load``'s error ``exc`` (its text ``text``) says the file is no whole
    zip archive, or a legacy file without torch's magic number, or is a
    ``pickle.UnpicklingError`` (a legacy pickle that makes no sense: on torch 2.13 an object
    refused is one too, which :func:`torch_load_refused` names first); False otherwise, or on
    a torch other than 2.13."""
    import pickle

    return (BROKEN_ARCHIVE in text or BAD_MAGIC in text
            or isinstance(exc, pickle.UnpicklingError)) and written_for(
        "torch", "torch.load's 'zip archive' wording", STOCK_LOAD)


# DistributedDataParallel's reducer, at the step after one whose loss some parameter took no
# part in (torch/csrc/distributed/c10d/reducer.cpp).
UNUSED_PARAMETERS = "Expected to have finished reduction in the prior iteration"


def unused_parameters(text: str) -> bool:
    """True when a rank's error ``text`` is DDP's reducer finding parameters that took no part
    in the last step's loss (its advice names a keyword argument of ``DistributedDataParallel``,
    not the config key); False otherwise, or on a torch other than 2.13."""
    return UNUSED_PARAMETERS in text and written_for(
        "torch", "DDP's 'Expected to have finished reduction' wording",
        "DDP's unused-parameter error is shown in torch's words")


def carries_traceback(lines: list[str]) -> bool:
    """True when an error message's ``lines`` (stripped) carry another process's traceback
    (a DataLoader worker's, re-raised in the rank), so that its last line is the original
    error; False otherwise, or on a torch other than 2.13 (the first line is then the one)."""
    return any(ln.startswith(CARRIED_TRACEBACK) for ln in lines) and written_for(
        "torch", "the DataLoader's 'Original Traceback' wording",
        "a rank failed in a DataLoader worker is named by torch's first line")


# torch 2.13's Module.load_state_dict: a header naming the model's class, then one line per
# kind of difference: "Error(s) in loading state_dict for CNN:\n\tMissing key(s) in
# state_dict: \"net.0.weight\", ...\n\tUnexpected key(s) ...\n\tsize mismatch for fc.weight: ...".
STATE_DICT_HEADER = "Error(s) in loading state_dict for "
STOCK_STATE_DICT = ("a checkpoint that does not fit the model is named with torch's error text "
                    "whole, on one line")
# Hydra 1.3's MissingConfigException: "Could not find 'hydra/launcher/submitit_slurm'" (the
# config path of the option asked for; after "In 'launcher/slurm': " when a config asked).
COULD_NOT_FIND = re.compile(r"Could not find '([^']+)'")


def torch_state_dict_details(text: str) -> list[str] | None:
    """The lines after the header of ``load_state_dict``'s error ``text`` ("Missing key(s) in
    state_dict: ...", "Unexpected key(s) ...", "size mismatch for <key>: ..."), stripped, blank
    ones left out; None for a text without the header, or on a torch other than 2.13 (the
    header alone names no key; the caller quotes torch's text whole)."""
    lines = [ln.strip() for ln in text.splitlines()]
    if not lines or not lines[0].startswith(STATE_DICT_HEADER) or not written_for(
            "torch", "load_state_dict's 'Error(s) in loading state_dict' wording",
            STOCK_STATE_DICT):
        return None
    return [ln for ln in lines[1:] if ln]


def hydra_missing_configs(text: str) -> list[str]:
    """The config paths (``hydra/launcher/submitit_slurm``: group, then option) that Hydra's
    error ``text`` says it could not find; empty when it names none, or on a Hydra other than
    1.3 (no install hint is added to Hydra's report)."""
    found = COULD_NOT_FIND.findall(text)
    if not found or not written_for("hydra-core", "Hydra's \"Could not find '<config>'\" wording",
                                    "no install hint for a plugin Hydra's own report names"):
        return []
    return found
