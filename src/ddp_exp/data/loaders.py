"""The rank side of the data path: this rank's training and validation batches.

Training: ``torch.utils.data.DistributedSampler`` over the training split's positions (strided
shards of one seeded permutation per epoch, ``set_epoch`` before each), cut into batches of
``data.batch_size``. Two ways to serve them:

* arrays in memory with ``data.num_workers == 0`` (:class:`TrainLoader`): batches are cut from
  tensors already on the rank's device by one ``index_select``: no per-sample ``__getitem__``,
  no collate, no host-to-device copy per step.
* everything else (:class:`KeyedLoader`): torch's ``DataLoader`` whose "sampler"
  (:class:`~ddp_exp.data.sampling.BatchKeys`) yields one key per batch, ``(seed, positions)``,
  and whose dataset (:class:`BatchFetch`) reads and collates the whole batch in a worker: one
  message per batch between rank and worker, not one per sample.

Randomness (augmentation, a user's transform, draws in a user's ``__getitem__``) is keyed per
sample of lazy data: each sample's key derives from (``seed``, epoch, the sample's index in
its split, the split's stream) alone (:func:`sample_keys`); the item is read with torch's,
Python's and NumPy's global RNGs seeded from its key (put back after the batch), and the
built-in augmentation draws its parameters from the keys (:mod:`ddp_exp.data.image_batch`). So
the draws differ between samples and epochs, are the same in every rerun, whatever
``num_workers``, ``prefetch_factor``, worker scheduling, the rank or the world size that serves
the sample, and resume exactly mid-epoch and in a world of another size (issue 30).

Mid-epoch starts (a step checkpoint's position, issue 30): ``set_start(k)`` before an epoch's
iteration makes it begin at the rank's ``k``-th sample of the epoch's shard, a slice of the
epoch's order (:func:`~ddp_exp.data.sampling.shard_order`'s ``start``): nothing is read and
discarded. With a strided shard, global position ``P`` of the epoch (``P`` a multiple of the
global batch) is every rank's sample ``P / world_size``.

torch's own worker seeding (a base seed from the loader's generator, continued by persistent
workers across epochs, the same on every rank that seeds torch alike) is not used for the
draws, and each loader has a generator of its own so that it never draws from the rank's RNG.

Validation (:meth:`RankData.val_batches`): samples ``rank, rank + world_size, ...`` of the
validation split, unpadded (a rank's shard may be empty), in order, through the same kind of
loader.

Training policy for a training set not divisible by ``world_size``: DistributedSampler's padding,
i.e. the first ``world_size - N % world_size`` samples of the epoch's permutation are served
twice, so every rank runs the same number of steps and DDP's all-reduces line up; the repeats
(each the last sample of its rank, :attr:`RankData.duplicate_last`) count zero in the loss, the
gradient and ``train/num_samples`` (:mod:`ddp_exp.train.loop`), so training is exact for any size.
Validation is never padded: each sample is evaluated exactly once across the world.

May use: :mod:`ddp_exp.data.sampling` (the shard's positions, the batches' keys),
:mod:`ddp_exp.data.seeds`, :mod:`ddp_exp.data.parent_death` (a worker ends with its rank),
torch; the splits it serves come from :mod:`ddp_exp.data.splits`, by
interface.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from ddp_exp.data.parent_death import die_with_parent
from ddp_exp.data.sampling import BatchKeys, shard_order
from ddp_exp.data.seeds import TEST, TRAIN, VAL, batch_seed, sample_keys, seeded  # noqa: F401

if TYPE_CHECKING:
    from ddp_exp.config.schema import DataConfig

EVAL_BATCH_SIZE = 512  # in-memory validation: larger batches, same per-sample losses
LOADER_STREAM = 2**32 - 1  # batch_seed's "batch" for the loader's own generator
# The in-memory loader's gather (bytes): small next to the data, large enough that one gather
# serves hundreds of steps (a digits rank's whole epoch shard is 0.2 MiB).
GATHER_BYTES = 4 * 2**20


class TrainLoader:
    """This rank's training batches ``(x [B, ...], y [B] or [B, k])`` from tensors in memory,
    one epoch per iteration.

    ``sampler`` is the rank's ``DistributedSampler``; call its ``set_epoch`` before iterating.
    ``x`` and ``y`` are the whole training set, on the rank's device. The last batch of an
    epoch may be smaller.

    Each epoch gathers the rank's shard in the sampler's order, a chunk of whole batches at a
    time (one ``index_select`` per tensor and chunk, :data:`GATHER_BYTES` at most unless one
    batch is larger), and yields slices of the chunk (views: nothing is copied per step). So
    the gather's cost is spread over many steps and its memory stays a few MiB per rank,
    whatever the data's size: the data itself is the one copy per node that forked ranks
    share. The batches hold the same values as gathering each batch by itself.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, sampler, batch_size: int):
        self.x, self.y, self.sampler, self.batch_size = x, y, sampler, batch_size
        self.start = 0  # the next iteration's first sample of the shard (set_start)

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        self.start = 0

    def set_start(self, samples: int) -> None:
        """Begin the next iteration at the shard's sample ``samples`` (a multiple of the
        batch size): the rest of an epoch a step checkpoint interrupted."""
        self.start = samples

    def chunk_rows(self) -> int:
        """Samples per gather: the most whole batches within :data:`GATHER_BYTES`, at least
        one batch."""
        row_bytes = sum(t[:1].numel() * t.element_size() for t in (self.x, self.y))
        return max(1, GATHER_BYTES // max(1, row_bytes * self.batch_size)) * self.batch_size

    def __iter__(self) -> Iterator:
        order = shard_order(self.sampler, self.start).to(self.x.device)
        self.start = 0
        size, rows = self.batch_size, self.chunk_rows()
        for first in range(0, len(order), rows):
            chunk = order[first:first + rows]
            xs, ys = self.x.index_select(0, chunk), self.y.index_select(0, chunk)
            for start in range(0, len(chunk), size):
                yield xs[start:start + size], ys[start:start + size]


class BatchFetch(torch.utils.data.Dataset):
    """What the DataLoader indexes: key ``(seed, positions[, epoch[, stream]])`` -> the
    collated batch ``split.batch(positions)``; when ``seed`` is not None, with each sample's
    key (:func:`sample_keys`, ``keys=``) under :func:`seeded` (the process's RNGs put back
    after); a split whose windows move per epoch (``epoch_batches``,
    :mod:`ddp_exp.data.tokens`) gets the epoch."""

    def __init__(self, split):
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, key: tuple):
        seed, positions = key[0], key[1]
        epoch = key[2] if len(key) > 2 else 0
        extra = {"epoch": epoch} if getattr(self.split, "epoch_batches", False) else {}
        if seed is None:
            return self.split.batch(positions, **extra)
        keys = sample_keys(seed, epoch, positions, key[3] if len(key) > 3 else TRAIN)
        with seeded(None):  # each sample seeds its own draws; the process's RNGs come back
            return self.split.batch(positions, keys=keys, **extra)


class KeyedLoader:
    """Batches of a split served by :class:`BatchFetch`: in this process (``num_workers=0``)
    or by torch's DataLoader with worker processes. Iterating runs one epoch."""

    def __init__(self, split, keys: BatchKeys, workers: dict[str, Any], seed: int, rank: int):
        self.keys = keys
        self.fetch = BatchFetch(split)
        self.loader = None
        self.generator = torch.Generator()
        self.base = (seed, rank)
        if workers["num_workers"] > 0:
            # Each worker ends with this rank, also one that started after the rank died.
            self.loader = DataLoader(self.fetch, batch_size=None, sampler=keys,
                                     generator=self.generator,
                                     worker_init_fn=partial(die_with_parent, parent=os.getpid()),
                                     **workers)

    def __len__(self) -> int:
        return len(self.keys)

    def set_epoch(self, epoch: int) -> None:
        self.keys.set_epoch(epoch)
        # The loader draws its workers' base seed from this generator, never the rank's RNG.
        self.generator.manual_seed(batch_seed(*self.base, epoch, LOADER_STREAM))

    def set_start(self, samples: int) -> None:
        """Begin the next iteration at the shard's sample ``samples`` (see
        :meth:`TrainLoader.set_start`)."""
        self.keys.start = samples

    def __iter__(self) -> Iterator:
        if self.loader is not None:
            yield from self.loader
            return
        for key in self.keys:
            yield self.fetch[key]


def loader_options(data: DataConfig, device: torch.device) -> dict[str, Any]:
    """DataLoader keyword arguments from ``data.num_workers``, ``data.persistent_workers``
    (null: true with workers), ``data.prefetch_factor`` (null: torch's default, 2) and
    ``data.pin_memory`` (``auto``: on CUDA only; page-locked batches make the step's
    ``non_blocking=True`` copies asynchronous)."""
    workers = data.num_workers
    options: dict[str, Any] = {"num_workers": workers}
    pin = data.pin_memory
    # Pinning is the workers' job (their batches are copied into page-locked memory by the
    # loader's pin thread); without workers batches are made in the step's own thread.
    options["pin_memory"] = workers > 0 and device.type == "cuda" and pin in ("auto", True)
    if workers > 0:
        persistent = data.persistent_workers
        options["persistent_workers"] = True if persistent is None else bool(persistent)
        if data.prefetch_factor is not None:
            options["prefetch_factor"] = data.prefetch_factor
    return options


def placement(device: torch.device, num_workers: int, in_memory: bool = True
              ) -> tuple[bool, bool]:
    """Where a rank keeps its training set: ``(move_batches, on_device)``.

    * arrays in memory with ``num_workers == 0``: the whole set is copied to ``device`` once,
      and batches are cut there by index: no host-to-device copy per step (on a GPU the set
      costs its size in device memory).
    * otherwise batches are made on the host (workers cannot share CUDA tensors; lazy data is
      read there) and the step copies each to the device (``non_blocking=True``).
    """
    on_device = in_memory and num_workers == 0
    return not on_device and device.type != "cpu", on_device


def val_batches(x, y, rank: int, world_size: int, batch_size: int) -> Iterator:
    """Yield this rank's validation batches of in-memory tensors: samples ``rank, rank +
    world_size, ...``, unpadded. A rank may get no sample at all (``val_size < world_size``)."""
    shard = slice(rank, None, world_size)
    xs, ys = x[shard], y[shard]
    for start in range(0, len(xs), batch_size):
        yield xs[start:start + batch_size], ys[start:start + batch_size]


class RankData:
    """This rank's view of the data: the training sampler and loader, and its validation batches.

    Args:
        datasets: the training/validation split (:class:`ddp_exp.data.splits.Datasets`).
        data: ``cfg.data``, typed (:class:`ddp_exp.config.schema.DataConfig`: the keys every
            dataset has).
        seed: the run's seed (sampler permutations, batch seeds).
        rank, world_size: this rank's place.
        device: the rank's device.

    Attributes:
        sampler: the training ``DistributedSampler``.
        train: iterable over one epoch's batches, with ``len`` and ``set_epoch``.
        move_batches: True when the step must copy batches to ``device``.
    """

    def __init__(self, datasets, data: DataConfig, seed: int, rank: int,
                 world_size: int, device: torch.device):
        from torch.utils.data import DistributedSampler

        self.rank, self.world_size, self.device = rank, world_size, device
        self.batch_size = data.batch_size
        train = datasets.train
        make = getattr(train, "make_sampler", None)  # data=tokens: an order computed per batch
        self.sampler = (make(world_size, rank, data.shuffle, seed) if make is not None
                        else DistributedSampler(range(len(train)), num_replicas=world_size,
                                                rank=rank, shuffle=data.shuffle, seed=seed,
                                                drop_last=False))
        # DistributedSampler repeats the start of the epoch's order to fill the last ranks'
        # shards: this rank's last sample is such a duplicate (counted zero for per-element
        # targets, ddp_exp.train.loop).
        total = self.sampler.total_size
        self.padded = total - len(train)  # the world's repeated samples per epoch
        self.duplicate_last = total > len(train) and rank + total - world_size >= len(train)
        self.move_batches, on_device = placement(device, data.num_workers,
                                                 datasets.in_memory)
        self.val_loader = None
        if on_device:  # one synchronous copy of each split; none per step
            x, y = (torch.from_numpy(a).to(device) for a in (train.features, train.targets))
            self.train: Any = TrainLoader(x, y, self.sampler, self.batch_size)
        else:
            keys = BatchKeys(self.sampler, self.batch_size, seed, rank, train.random)
            self.train = KeyedLoader(train, keys, loader_options(data, device), seed, rank)
        self.in_memory, self.seed, self.options = (datasets.in_memory, seed,
                                                   loader_options(data, device))
        val = datasets.val
        if datasets.in_memory:  # on the device once: validated every epoch
            self.val_x, self.val_y = (torch.from_numpy(a).to(device)
                                      for a in (val.features, val.targets))
        else:
            self.val_loader = self._shard_loader(val, VAL)

    def _shard_loader(self, split, stream: int) -> KeyedLoader:
        shard = list(range(self.rank, len(split), self.world_size))
        keys = BatchKeys(shard, self.batch_size, self.seed, self.rank, split.random, stream)
        return KeyedLoader(split, keys, self.options, self.seed, self.rank)

    def val_batches(self, epoch: int = 0) -> Iterator:
        """This rank's validation batches (unpadded strided shard), on the host or the device;
        lazy items that draw random numbers draw the epoch's own."""
        if self.val_loader is None:
            return val_batches(self.val_x, self.val_y, self.rank, self.world_size,
                               EVAL_BATCH_SIZE)
        self.val_loader.set_epoch(epoch)
        return iter(self.val_loader)

    def eval_batches(self, split) -> Iterator:
        """This rank's unpadded strided shard of another held-out split (the test split),
        evaluated once: in-memory tensors are copied to the device for the pass."""
        if self.in_memory:
            x, y = (torch.from_numpy(a).to(self.device) for a in (split.features, split.targets))
            return val_batches(x, y, self.rank, self.world_size, EVAL_BATCH_SIZE)
        loader = self._shard_loader(split, TEST)
        loader.set_epoch(0)
        return iter(loader)
