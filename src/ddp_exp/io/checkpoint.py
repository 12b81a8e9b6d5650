"""Checkpoints: written by rank 0 alone, atomically, loaded with ``weights_only=True``.

Layout, in ``<job_dir>/checkpoints/``:

* ``epoch_0000.pt``, ``epoch_0001.pt``, ...: every ``trainer.checkpoint_every_n_epochs`` epochs,
  the newest ``trainer.keep_checkpoints`` kept;
* ``last.pt``: the newest completed epoch, always (what ``trainer.resume=auto`` and elastic
  restarts continue from), or a newer step checkpoint inside an epoch
  (``trainer.checkpoint_every_n_steps`` / ``_minutes``, a preemption: issue 30);
* ``best.pt``: the checkpoint of the best epoch of ``trainer.monitor`` so far (as Lightning's
  ``ModelCheckpoint`` keeps by default: the whole state, so a run can also continue from it;
  written in an epoch that stopped early at ``trainer.max_steps``, it is marked not resumable).
  When the best epoch also writes ``last.pt``, each name is a file of its own (a copy, or a
  copy-on-write clone where the file system offers one), so damage to one leaves the others.

A checkpoint holds the unwrapped model, optimizer, scheduler, grad-scaler and monitor state
(best value, best epoch, epochs without improvement), the completed ``epoch``
(0-based), ``global_step``, the run's ``steps_per_epoch`` and ``run_steps``, every rank's RNG
states and the resolved config (as JSON text, :data:`CONFIG_JSON`, which :func:`load` decodes
into ``config``); a step checkpoint also the ``position`` in the next epoch
(global samples consumed), that epoch's ``epoch_sums`` so far and the ``global_batch_size``:
all that is needed to continue exactly (the sampler's order is a function of seed and epoch,
and starts at the position; a resumed run rebuilds its schedule from its own config and length,
:func:`ddp_exp.train.state.resume_optimizer`, and reads the scheduler's state only for
``ReduceLROnPlateau``'s progress). Files are written to a
temp file, fsynced and renamed (:func:`ddp_exp.io.files.atomic_write`), so a reader, or a run killed
mid-save, sees the previous complete file or the new complete one, never part of one. The loop
serializes each checkpoint at once and writes it on a background thread
(:class:`ddp_exp.io.files.BackgroundWriter`): training goes on while the file is fsynced.
Under ``strategy.checkpoint=sharded`` each name is a small file naming a folder in which every
rank wrote its shard (:mod:`ddp_exp.io.sharded`); :func:`load` resolves it.

May use: :mod:`ddp_exp.config` (``ConfigError``), :mod:`ddp_exp.io.files` (atomic writes),
:mod:`ddp_exp.compat` (torch's wording); what the loop puts into a checkpoint and takes back
is :mod:`ddp_exp.train.state`'s.
"""

from __future__ import annotations

import filecmp
import io
import json
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ddp_exp.compat import messages
from ddp_exp.config.errors import ConfigError
from ddp_exp.io.files import (
    BackgroundWriter,
    atomic_write,
    copy_file,
    load_failure,
    remove_partial,
)

if TYPE_CHECKING:
    import torch

# torch is imported where a checkpoint is made or read, not with this module: the entry's
# --help and --cfg job import the job folder's names (checkpoint_dir) and no torch.
log = logging.getLogger("ddp_exp.checkpoint")

FORMAT = "ddp_exp/checkpoint/v1"
# The resolved config as JSON text (issue 42: one string to pickle at every checkpoint, encoded
# once per run), which load() decodes into "config"; older checkpoints hold the dict there.
CONFIG_JSON = "config_json"
LAST = "last.pt"
BEST = "best.pt"


def checkpoint_dir(job_dir: str) -> str:
    """``<job_dir>/checkpoints``."""
    return os.path.join(job_dir, "checkpoints")


def epoch_path(job_dir: str, epoch: int) -> str:
    """Path of the checkpoint of (0-based) ``epoch``."""
    return os.path.join(checkpoint_dir(job_dir), f"epoch_{epoch:04d}.pt")


def _serialized(payload: dict[str, Any]) -> memoryview:
    """``torch.save(payload)`` in memory (a view of the buffer, not a second copy of it)."""
    import torch

    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getbuffer()


def snapshot(value: Any) -> Any:
    """``value`` as it is now, safe to serialize later while the loop trains on: every tensor
    cloned, every dict, list and tuple rebuilt (a state dict's tensors are the live parameters
    and optimizer buffers; its containers may be the scheduler's own). Other values are
    immutable here (numbers, strings, None). Cloning ~80 KB of digits' state takes ~0.07 ms
    where ``torch.save`` takes ~0.7 ms, which the loop thread no longer waits for.

    Runs on the loop's thread at every checkpoint (issue 42: < 1% of an epoch), so the values
    a state dict is made of are told apart by their exact type first (one lookup), the
    ``isinstance`` chain only for the rest (subclasses, named tuples)."""
    kind = type(value)
    if kind in _IMMUTABLE:
        return value
    if kind is dict or kind is OrderedDict:  # an OrderedDict stays one (a module's state dict)
        return kind([(k, snapshot(v)) for k, v in value.items()])
    if kind is list:
        return [snapshot(v) for v in value]
    tensor = _tensor_type()
    if isinstance(value, tensor):  # a state dict's are detached; a Parameter needs it
        return (value.detach() if value.requires_grad else value).clone()
    if isinstance(value, dict):
        return (OrderedDict if isinstance(value, OrderedDict) else dict)(
            (k, snapshot(v)) for k, v in value.items())
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    if isinstance(value, tuple):
        items = [snapshot(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


_IMMUTABLE = frozenset({int, float, bool, str, bytes, type(None), complex})


def _tensor_type() -> type:
    """``torch.Tensor`` (torch imported where a checkpoint is made, not with this module)."""
    import torch

    return torch.Tensor


# (process id, checkpoint folder) pairs whose killed writers' temp files save() has removed.
_swept: set[tuple[int, str]] = set()


def _write_bytes(path: str, data: memoryview) -> None:
    atomic_write(path, lambda fh: fh.write(data))


def _run(job: Callable[[], object], writer: BackgroundWriter | None) -> None:
    """``job()`` now, or on ``writer``'s thread after the jobs submitted before it."""
    if writer is None:
        job()
    else:
        writer.submit(job)


def epoch_files(folder: str) -> list[tuple[int, str]]:
    """The ``epoch_NNNN.pt`` files in ``folder`` as ``(epoch, path)``, oldest first, ordered by
    the epoch's number, not the name's text: past epoch 9,999 the names grow a digit, and
    ``epoch_10000.pt`` sorts below ``epoch_9999.pt`` as text (so rotation deleted each new file
    as soon as it was written; transformers PR #37260 had the kind). Empty when the folder
    cannot be read."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = ((re.fullmatch(r"epoch_(\d+)\.pt", name), name) for name in names)
    return sorted((int(match.group(1)), os.path.join(folder, name))
                  for match, name in found if match)


def rotate(folder: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` epoch files in ``folder`` (by number:
    :func:`epoch_files`). Returns the paths deleted."""
    old = [path for _, path in epoch_files(folder)[:-keep]] if keep > 0 else []
    for path in old:
        os.unlink(path)
    return old


def land(paths: list[str], write_first: Callable[[str], object],
         copy: Callable[[str, str], object] = copy_file) -> None:
    """Put one checkpoint in place under every name in ``paths``: ``write_first(paths[0])``
    lands it atomically (temp, fsync, rename), then each other name gets a copy of its own
    (:func:`ddp_exp.io.files.copy_file`: a copy-on-write clone where the file system offers one),
    never a second name of the same inode (a hard link: ``truncate -s 0 last.pt`` broke
    ``best.pt`` and the epoch file with it; ``os.link`` is refused on exFAT and some network
    mounts). A kill between two names leaves each name the complete old or new checkpoint.

    The one place a checkpoint lands: a writer of another kind (a folder of shards, issue 40)
    passes its own ``write_first`` and ``copy`` (a tree), and keeps :func:`save`'s names and
    rotation."""
    write_first(paths[0])
    for name in paths[1:]:
        copy(paths[0], name)


def save(job_dir: str, state: dict[str, Any], keep_epoch_file: bool, keep: int,
         writer: BackgroundWriter | None = None, last: bool = True, best: bool = False,
         before_write: Callable[[], object] | None = None,
         late: Callable[[], dict[str, Any]] | None = None, owned: bool = False,
         shards: Any = None) -> str:
    """Write ``state`` under each name it is due: its epoch file (``keep_epoch_file``),
    ``last.pt`` (``last``, and always with an epoch file) and ``best.pt`` (``best``: the epoch
    is the monitor's new best); then delete all but the newest ``keep`` epoch files
    (:func:`rotate`). Call on rank 0 only. The one place that decides what the names become.

    The checkpoint is serialized once and landed once (:func:`land`: the first name written and
    fsynced, each other name a copy of its own), so any one file stays loadable when another
    is damaged. A later write of ``last.pt`` replaces that name only; ``best.pt`` keeps its file.

    With ``writer``, ``state`` is snapshotted before this returns (:func:`snapshot`; not when
    ``owned``: the caller's snapshot, which nothing else holds) and serialized and written on
    its thread, after every write submitted before (call ``writer.wait()`` before reading the
    files); without, all of it happens here. ``late()``, if given, runs on that thread first
    and its fields join the checkpoint (what a collective is still delivering when the loop
    hands the checkpoint over: every rank's RNG states). ``before_write()``, if given, runs
    just before the file is written (on that thread): what must be on disk before the
    checkpoint is (a step checkpoint's TensorBoard events).

    ``shards`` (a sharded checkpoint, :mod:`ddp_exp.io.sharded`): an object whose ``write()``
    writes this rank's shard into its ``temp`` folder (every rank's writer runs it: a
    collective); then ``state`` goes into that folder as ``state.pt``, the folder is renamed
    complete, and each name lands as a small file naming it. Shard folders no name names any
    more are deleted after the names land.

    Returns:
        The path written (the epoch file, else ``last.pt``, else ``best.pt``).

    Raises:
        ValueError: no name is due.
    """
    folder = checkpoint_dir(job_dir)
    names = ([epoch_path(job_dir, state["epoch"])] if keep_epoch_file else []) + [
        os.path.join(folder, name) for name, due in ((LAST, last or keep_epoch_file),
                                                     (BEST, best)) if due]
    if not names:
        raise ValueError("checkpoint.save: neither an epoch file, last.pt nor best.pt is due")
    payload = {"format": FORMAT, **(state if writer is None or owned else snapshot(state))}

    def write() -> None:
        if late is not None:  # first: a collective the other ranks' writers are in
            payload.update(late())
        os.makedirs(folder, exist_ok=True)
        # Left by a writer killed mid-save (an earlier attempt: a new process), looked for at
        # this process's first save into the folder: its own writes finish or remove their
        # temp file (one thread, in order). Each look is a glob, ~0.1 ms of the writer's CPU.
        if (os.getpid(), folder) not in _swept:
            remove_partial(folder)
            _swept.add((os.getpid(), folder))
        if shards is not None:
            from ddp_exp.io import sharded

            sharded.remove_partial_folders(folder, keep=shards.temp)
            shards.write()  # every rank's shard, then DCP's .metadata
        if before_write is not None:
            before_write()
        if shards is not None:
            done = sharded.seal(shards.temp, payload, payload["global_step"])
            data = _serialized(sharded.pointer(folder, done, FORMAT))
        else:
            data = _serialized(payload)
        land(names, lambda path: _write_bytes(path, data))
        if keep_epoch_file:
            rotate(folder, keep)
        if shards is not None or os.path.isdir(os.path.join(folder, "sharded")):
            from ddp_exp.io import sharded

            sharded.collect_garbage(folder)

    _run(write, writer)
    return names[0]


def best_path(job_dir: str) -> str:
    """``<job_dir>/checkpoints/best.pt``: the checkpoint of the best epoch of
    ``trainer.monitor``."""
    return os.path.join(checkpoint_dir(job_dir), BEST)


def repair_best(source: str, state: dict[str, Any]) -> bool:
    """Put ``best.pt`` back where a kill left it behind: when ``source`` is a run's
    ``last.pt`` whose epoch is the monitor's best (``state["monitor"]["best_epoch"]``), its
    ``best.pt`` must hold the same checkpoint; a run killed between the ``last.pt`` rename and
    ``best.pt``'s copy kept an older epoch's ``best.pt`` (and a temp file, which
    :func:`ddp_exp.io.files.remove_partial` deletes). Call in the launching process (rank 0 under
    torchrun) once every check has passed, before any rank starts.

    Returns:
        True when ``best.pt`` was replaced by a copy of ``source``.
    """
    if os.path.basename(source) != LAST or state.get("position"):
        return False  # a step checkpoint (inside an epoch) is never the best epoch's
    best_epoch = (state.get("monitor") or {}).get("best_epoch")
    if best_epoch is None or best_epoch != state.get("epoch"):
        return False
    best = os.path.join(os.path.dirname(source), BEST)
    if os.path.exists(best) and (os.path.samefile(source, best)
                                 or filecmp.cmp(source, best, shallow=False)):
        return False  # the same file, or a copy of it (a copied job folder)
    copy_file(source, best)
    log.info("%s: best.pt is now epoch %d's checkpoint, the monitor's best (a copy of %s)",
             os.path.dirname(source), best_epoch + 1, LAST)
    return True


def load(path: str, key: str = "trainer.resume", map_location: str | torch.device = "cpu"
         ) -> dict[str, Any]:
    """Load and check a checkpoint with ``torch.load(weights_only=True)``. A sharded one (a
    folder, or a name naming one: :mod:`ddp_exp.io.sharded`) gives its training state with
    ``shards``, the folder's absolute path, in place of ``model`` and ``optimizer``.

    Raises:
        ConfigError: missing, unreadable, corrupt or not a ddp_exp checkpoint; ``key`` names
            the config key the path came from.
    """
    if os.path.isdir(path):
        from ddp_exp.io import sharded

        return with_config(sharded.load_state(path, key, FORMAT), path, key)
    if not os.path.isfile(path):
        valid = ("; trainer.resume takes auto (the job folder's last.pt, if any), null, or a "
                 "checkpoint file's path") if key == "trainer.resume" else ""
        raise ConfigError(f"{key}={path!r}: no such checkpoint file{valid}")
    import torch

    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        intact = intact_beside(path)
        raise ConfigError(f"{key}={path!r}: cannot load it as a checkpoint: "
                          f"{load_failure(exc)}" + (
                              f"; an intact checkpoint beside it: trainer.resume={intact}"
                              if intact else "")) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"{key}={path!r}: not a ddp_exp checkpoint (no format {FORMAT!r})")
    if isinstance(state.get("shards"), str):
        from ddp_exp.io import sharded

        return with_config(sharded.resolve(path, state["shards"], key, FORMAT), path, key)
    return with_config(state, path, key)


def with_config(state: dict[str, Any], path: str, key: str = "trainer.resume"
                ) -> dict[str, Any]:
    """``state`` with its resolved config as the dict ``state["config"]``: decoded from the
    JSON text :data:`CONFIG_JSON` that checkpoints since issue 42 hold (which is removed), or
    the dict an older checkpoint holds, as it is.

    Raises:
        ConfigError: the JSON text does not parse as an object (``key``, ``path`` named).
    """
    text = state.pop(CONFIG_JSON, None)
    if text is None:
        return state
    try:
        config = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise ConfigError(f"{key}={path!r}: its {CONFIG_JSON} is not a JSON object: the "
                          "checkpoint is damaged")
    state["config"] = config
    return state


def shards_of(path: str) -> str | None:
    """The sharded checkpoint folder that ``path`` is or names, None for a full checkpoint file
    (read with ``mmap``: a full file's tensors are not read)."""
    if os.path.isdir(path):
        return os.path.abspath(path)
    import torch

    named = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if isinstance(named, dict) and isinstance(named.get("shards"), str):
        return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)),
                                             named["shards"]))
    return None


def intact_beside(path: str) -> str | None:
    """The newest checkpoint in ``path``'s folder that loads (``epoch_NNNN.pt`` newest first,
    then ``best.pt``), other than ``path`` and the files that are ``path`` under another name
    (a hard link, as the previous release made ``best.pt`` of ``last.pt``): what a user could
    resume from when ``path`` is truncated or corrupt (R15). None when there is none."""
    import torch

    folder = os.path.dirname(os.path.abspath(path))
    names = [p for _, p in reversed(epoch_files(folder))] + [os.path.join(folder, BEST)]
    for candidate in names:
        try:
            if os.path.samefile(candidate, path):
                continue
            torch.load(candidate, map_location="cpu", weights_only=True)
        except Exception:  # missing, or broken too: the next one
            continue
        return candidate
    return None


def newest_epoch_file(path: str) -> str | None:
    """The newest ``epoch_NNNN.pt`` in ``path``'s folder (a checkpoint at an epoch's end that
    exists, named as it is; by number: :func:`epoch_files`), or None when there is none."""
    files = epoch_files(os.path.dirname(os.path.abspath(path)))
    return files[-1][1] if files else None


def find_resume(job_dir: str, resume: str | None, restarted: bool) -> str | None:
    """The checkpoint to continue from: ``resume`` as a path, or ``<job_dir>/checkpoints/
    last.pt`` for ``resume=auto`` and after an elastic restart (when it exists)."""
    if resume not in (None, "auto"):
        return os.path.abspath(os.path.expanduser(resume))
    last = os.path.join(checkpoint_dir(job_dir), LAST)
    if (resume == "auto" or restarted) and os.path.isfile(last):
        return last
    return None


# Keys that choose which samples train and which validate (the split is drawn from the seed):
# resuming with another value would move training samples into validation.
SPLIT_KEYS = ("seed", "data.val_size", "data.test_size")


def check_same_split(saved_cfg: dict[str, Any] | None, cfg: dict[str, Any], resume: str,
                     allow_changes: bool) -> None:
    """Refuse to resume with another data split than the checkpoint's.

    Args:
        saved_cfg: the resolved config stored in the checkpoint (``state["config"]``).
        cfg: this run's resolved config.
        resume: ``trainer.resume`` as given (named in the message).
        allow_changes: ``trainer.resume_allow_changes``: the user accepts the change.

    Raises:
        ConfigError: naming the first key of :data:`SPLIT_KEYS` whose value differs (a key
            absent from either config, e.g. from a checkpoint older than the key, is skipped).
    """
    if not saved_cfg:
        return
    for key in SPLIT_KEYS:
        before, now = _lookup(saved_cfg, key), _lookup(cfg, key)
        if _ABSENT not in (before, now) and before != now:
            if allow_changes:  # accepted, but the held-out scores now include trained samples
                log.warning("%s=%s differs from the checkpoint's %s=%s "
                            "(trainer.resume_allow_changes=true): samples trained on may now be "
                            "validated or tested", key, now, key, before)
                continue
            raise ConfigError(f"{key}={now} differs from the checkpoint's {key}={before} "
                              f"(trainer.resume={resume}): another split would move samples "
                              f"between training, validation and test; resume with "
                              f"{key}={before}, or add trainer.resume_allow_changes=true to "
                              "accept it")


_ABSENT = object()


def _lookup(cfg: dict[str, Any], dotted: str) -> Any:
    """``cfg["a"]["b"]`` for ``"a.b"``; :data:`_ABSENT` when a part is missing."""
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def model_mismatch(exc: BaseException, state: dict[str, Any], model_cfg: dict[str, Any]) -> str:
    """Why a checkpoint's ``state["model"]`` does not load into this run's model, in one line:
    the state-dict keys torch names (missing, unexpected, size mismatch for ``key``), and the
    ``model._target_`` the checkpoint was written with when it differs from this run's.
    ``exc`` is what ``load_state_dict`` raised; its first line alone ("Error(s) in loading
    state_dict for CNN:") names no key (:func:`ddp_exp.compat.messages.torch_state_dict_details`
    reads the lines after it; on another torch, or for another error, the text is quoted whole).
    """
    text = str(exc).strip()
    lines = messages.torch_state_dict_details(text)
    if lines is None:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    details = "; ".join(lines) or repr(exc)
    if len(details) > 300:
        details = details[:297] + "..."
    written = ((state.get("config") or {}).get("model") or {}).get("_target_")
    if written and written != model_cfg.get("_target_"):
        details += (f"; the checkpoint was written with model._target_={written}, this run has "
                    f"model._target_={model_cfg.get('_target_')}")
    return details

