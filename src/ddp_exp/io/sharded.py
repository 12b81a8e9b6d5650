"""Sharded checkpoints (``strategy.checkpoint=sharded``, issue 40): one folder per checkpoint,
written by every rank with ``torch.distributed.checkpoint`` (DCP), landed atomically, and the
small files that name it.

Layout, in ``<job_dir>/checkpoints/``:

* ``sharded/step_00000060/``: one checkpoint. ``.metadata`` (DCP's: which bytes of which file
  hold which slice of each tensor), ``__<rank>_0.distcp`` (each rank's shard of the model and
  optimizer state, as :func:`torch.distributed.checkpoint.state_dict.get_state_dict` gives it:
  parameter names, DTensor slices) and ``state.pt`` (the rest of the training state, rank 0's:
  epoch, step, position, RNG, monitor, scheduler, config; loaded with ``weights_only=True``).
  The folder alone is a checkpoint: ``trainer.resume=<folder>`` and ``ddp-exp sample
  --checkpoint <folder>`` take it.
* ``last.pt``, ``best.pt``, ``epoch_NNNN.pt``: under the same names and rotation as full
  checkpoints (:func:`ddp_exp.io.checkpoint.save`), each a small file ``{"format", "shards":
  "sharded/step_00000060"}`` that names its folder (several names may name one folder).

Atomic: the ranks write into ``sharded/.<tag>.tmp/``; DCP's last collective gathers every
rank's write results to rank 0, which writes ``.metadata``, then ``state.pt`` (fsynced), and
renames the folder to its final name (a new name, never over an existing folder); only then
does a name (``last.pt``) land, atomically, naming it. A kill at any point leaves every name
naming a complete folder: a ``.tmp`` folder is never named, never loaded, and deleted by the
next write or the next start (:func:`remove_partial_folders`); a complete folder no name
names is deleted after the next name lands (:func:`collect_garbage`).

Loading reshards: DCP reads, for each rank's tensors (sharded under FSDP, whole under DDP or in
one process), the slices it needs from whichever files hold them, so a checkpoint of a world of
``a`` ranks loads at ``b`` ranks, under either strategy (:func:`load_model`,
:func:`load_optimizer`; ``no_dist=True`` in a process without a process group).

May use: :mod:`ddp_exp.io.files`, :mod:`ddp_exp.config` (``ConfigError``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
from collections.abc import Iterator
from typing import Any

import torch

from ddp_exp.config.errors import ConfigError
from ddp_exp.io.files import atomic_write, remove_partial_trees

# torch.distributed.checkpoint is imported where a sharded checkpoint is written or read: ~0.5 s
# that a DDP run's launcher never pays.
SHARDED_DIR = "sharded"
STATE_FILE = "state.pt"
METADATA = ".metadata"


def shards_root(checkpoint_folder: str) -> str:
    """``<checkpoints>/sharded``."""
    return os.path.join(checkpoint_folder, SHARDED_DIR)


def temp_folder(checkpoint_folder: str, tag: str) -> str:
    """The folder the ranks write a checkpoint into before it is complete (every rank names
    the same one: ``tag`` is agreed, :func:`ddp_exp.distributed.process_group.side_group`)."""
    return os.path.join(shards_root(checkpoint_folder), f".{tag}.tmp")


def is_complete(folder: str) -> bool:
    """A folder holding a whole sharded checkpoint: DCP's ``.metadata`` and ``state.pt``, and not
    a temp name."""
    name = os.path.basename(os.path.normpath(folder))
    return (not (name.startswith(".") and name.endswith(".tmp"))
            and os.path.isfile(os.path.join(folder, METADATA))
            and os.path.isfile(os.path.join(folder, STATE_FILE)))


def write_shards(tensors: dict[str, Any], folder: str, group: Any) -> None:
    """Every rank: write this rank's shard of ``tensors`` (``{"model": ..., "optimizer": ...}``
    as :func:`get_state_dict` gives them) into ``folder`` (``dcp.save`` over ``group``, a gloo
    group of its own so that it can run on the writer thread while the loop's collectives run).
    On rank 0 it returns once every rank's file is written and fsynced and ``.metadata`` is
    written (DCP gathers the ranks' results to rank 0 before it writes the metadata)."""
    import torch.distributed.checkpoint as dcp

    with _one_error():
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder, sync_files=True),
                 process_group=group)


@contextlib.contextmanager
def _one_error() -> Iterator[None]:
    """DCP's ``CheckpointException`` (a ``BaseException`` whose text is every rank's
    traceback, which no ``except Exception`` catches) becomes the first failing rank's own
    error: a full disk stays an ``OSError`` (one line in ddp_exp's error table), a key that does
    not fit a ``RuntimeError``/``ValueError`` (the callers' one line)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        first = next(iter(exc.failures.values()), None)
        error = first[0] if isinstance(first, tuple) else first
        if isinstance(error, Exception):
            raise error.with_traceback(None) from None
        raise RuntimeError(f"torch.distributed.checkpoint failed: {error!r}") from None


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal(folder: str, state: dict[str, Any], global_step: int) -> str:
    """Rank 0, after :func:`write_shards`: write ``state`` (the rest of the training state) as
    ``state.pt`` into the temp ``folder``, then rename it to ``step_<global_step>`` (``-2``,
    ``-3``, ... when that name is taken: a folder is never replaced). Returns the final path."""
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getbuffer()
    atomic_write(os.path.join(folder, STATE_FILE), lambda fh: fh.write(data))
    _fsync_dir(folder)
    root = os.path.dirname(folder)
    base = os.path.join(root, f"step_{global_step:08d}")
    final, n = base, 1
    while os.path.exists(final):
        n += 1
        final = f"{base}-{n}"
    os.rename(folder, final)
    _fsync_dir(root)
    return final


def pointer(checkpoint_folder: str, folder: str, fmt: str) -> dict[str, Any]:
    """What ``last.pt`` / ``best.pt`` / ``epoch_NNNN.pt`` hold for a sharded checkpoint: the
    format and the folder's path relative to ``checkpoint_folder``."""
    return {"format": fmt, "shards": os.path.relpath(folder, checkpoint_folder)}


def named_folders(checkpoint_folder: str) -> set[str]:
    """The shard folders a name in ``checkpoint_folder`` names (every ``*.pt`` read with
    ``mmap``: a full checkpoint's tensors are not read)."""
    named = set()
    for path in glob.glob(os.path.join(checkpoint_folder, "*.pt")):
        try:
            value = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # a damaged or foreign file names nothing
            continue
        if isinstance(value, dict) and isinstance(value.get("shards"), str):
            named.add(os.path.normpath(os.path.join(checkpoint_folder, value["shards"])))
    return named


def collect_garbage(checkpoint_folder: str) -> list[str]:
    """Delete the complete shard folders that no name names any more (a replaced ``last.pt``'s,
    a rotated epoch file's, a folder whose name never landed). Returns the paths deleted."""
    named = named_folders(checkpoint_folder)
    removed = []
    for path in glob.glob(os.path.join(shards_root(checkpoint_folder), "*")):
        if os.path.isdir(path) and os.path.normpath(path) not in named:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def remove_partial_folders(checkpoint_folder: str, keep: str | None = None) -> list[str]:
    """Delete the temp folders (``sharded/.<tag>.tmp``) that ranks killed mid-write left, but
    ``keep`` (the one being written now). Returns the paths deleted."""
    return remove_partial_trees(shards_root(checkpoint_folder), keep)


def load_state(folder: str, key: str, fmt: str) -> dict[str, Any]:
    """The training state of the sharded checkpoint ``folder`` (``state.pt``), with ``shards``
    its absolute path.

    Raises:
        ConfigError: not a complete sharded checkpoint (a temp folder a kill left, a folder
            without ``.metadata`` or ``state.pt``), or ``state.pt`` does not load.
    """
    folder = os.path.abspath(folder)
    if not is_complete(folder):
        raise ConfigError(f"{key}={folder!r}: not a complete sharded checkpoint (a folder with "
                          f"{METADATA} and {STATE_FILE}; a .tmp folder is one a kill left "
                          "half-written)")
    try:
        state = torch.load(os.path.join(folder, STATE_FILE), map_location="cpu",
                           weights_only=True)
    except Exception as exc:
        raise ConfigError(f"{key}={folder!r}: its {STATE_FILE} does not load "
                          f"({type(exc).__name__})") from None
    if not isinstance(state, dict) or state.get("format") != fmt:
        raise ConfigError(f"{key}={folder!r}: not a ddp_exp checkpoint (no format {fmt!r})")
    state["shards"] = folder
    return state


def resolve(path: str, named: str, key: str, fmt: str) -> dict[str, Any]:
    """The state of the folder that the name ``path`` (``last.pt``) names as ``named``."""
    folder = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), named))
    if not os.path.isdir(folder):
        raise ConfigError(f"{key}={path!r}: it names the sharded checkpoint {folder}, which "
                          "does not exist")
    return load_state(folder, key, fmt)


def _load(folder: str, tensors: dict[str, Any], no_dist: bool) -> None:
    """``dcp.load`` into ``tensors``, its failure one error (:func:`_one_error`)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with _one_error(), warnings.catch_warnings():
        if no_dist:  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=dcp.FileSystemReader(folder), no_dist=no_dist)


def load_model(folder: str, module: torch.nn.Module, no_dist: bool = False) -> None:
    """Load the model of the sharded checkpoint ``folder`` into ``module`` (its parameters as
    they are laid out here: FSDP's shards of this world, or whole tensors), reading only the
    slices this process needs. Every rank calls it (a collective), or one process with
    ``no_dist=True``.

    Raises:
        RuntimeError, ValueError: the checkpoint does not hold this model's tensors (a missing
            key, another shape): DCP's error.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )

    tensors = get_model_state_dict(module)
    _load(folder, {"model": tensors}, no_dist)
    set_model_state_dict(module, tensors)


def load_optimizer(folder: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   no_dist: bool = False) -> None:
    """Load the optimizer state of the sharded checkpoint ``folder`` into ``optimizer`` (over
    ``module``'s parameters, by parameter name), as :func:`load_model` loads the model."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    tensors = get_optimizer_state_dict(module, optimizer)
    _load(folder, {"optimizer": tensors}, no_dist)
    set_optimizer_state_dict(module, optimizer, tensors)


def state_tensors(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}``: this process's part of the model and optimizer
    state as DCP saves it (:func:`torch.distributed.checkpoint.state_dict.get_state_dict`:
    parameter names; FSDP's DTensor shards as they are, no collective). The live tensors:
    snapshot before training on."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(module, optimizer)
    return {"model": model, "optimizer": optim}
