"""Which samples a rank serves in an epoch, and in which batches: the positions of its shard
(:func:`shard_order`, ``DistributedSampler``'s order computed as tensors; :class:`ShardFrom`,
a lazy shard from a position on) and their grouping into batches, each keyed by ``(seed,
positions, epoch, stream)`` (:class:`BatchKeys`, the "sampler" of ddp_exp's DataLoader).

Mid-epoch starts (a step checkpoint's position, issue 30): ``start`` slices the epoch's shard,
so nothing before it is read and discarded. With a strided shard, global position ``P`` of the
epoch (``P`` a multiple of the global batch) is every rank's sample ``P / world_size``.

:mod:`ddp_exp.data.loaders` serves the batches (the in-memory ``TrainLoader``, ``KeyedLoader``).

May use: :mod:`ddp_exp.data.seeds` (the streams), torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from ddp_exp.data.seeds import TRAIN


def shard_order(sampler, start: int = 0) -> torch.Tensor:
    """The positions a sampler yields this epoch from its ``start``-th on, as an int64 tensor
    ``[len(sampler) - start]``.

    For a ``DistributedSampler`` they are computed as tensors by the sampler's own rule
    (torch/utils/data/distributed.py, ``__iter__``: ``randperm(n)`` from a generator seeded
    ``seed + epoch``, or ``arange(n)``; padded by repeating the order's start, or cut to a
    multiple of ``num_replicas``; then every ``num_replicas``-th from ``rank``), without the
    Python lists it builds: those cost ~36 bytes per sample in every rank (14 MiB per rank at
    400k samples) and outlive the epoch in Python's allocator. A test holds the result equal to
    ``list(sampler)``. A sampler with a ``shard()`` (:mod:`ddp_exp.data.tokens`) gives its own
    lazily computed shard (``len`` and slices). Any other sampler is listed. ``start`` slices
    the shard (a view for the lazy shard): nothing before it is yielded or read.
    """
    from torch.utils.data import DistributedSampler

    if hasattr(sampler, "shard"):  # computes its positions per slice (ddp_exp.data.tokens)
        shard = sampler.shard()
        return shard if not start else ShardFrom(shard, start)
    if type(sampler) is not DistributedSampler:
        return torch.tensor(list(sampler)[start:], dtype=torch.long)
    n = len(sampler.dataset)
    if sampler.shuffle:
        g = torch.Generator()
        g.manual_seed(sampler.seed + sampler.epoch)
        order = torch.randperm(n, generator=g)
    else:
        order = torch.arange(n)
    total = sampler.total_size
    if total > n:  # drop_last=False: pad with the order's start, repeated as often as needed
        order = torch.cat([order, order.repeat(math.ceil((total - n) / n))[:total - n]])
    first = sampler.rank + start * sampler.num_replicas
    return order[first:total:sampler.num_replicas].clone()


class ShardFrom:
    """A lazy shard (``len`` and slices) from its ``start``-th position on."""

    def __init__(self, shard, start: int):
        self.shard, self.start = shard, min(start, len(shard))

    def __len__(self) -> int:
        return len(self.shard) - self.start

    def __getitem__(self, part: slice):
        first, stop, step = part.indices(len(self))
        return self.shard[self.start + first:self.start + stop:step]


class BatchKeys(Sampler):
    """Groups a sampler's positions into batches, yielding one key ``(seed, positions, epoch,
    stream)`` per batch; ``seed`` (the run's) is None unless the split draws random numbers
    (then each sample's draws are keyed, :func:`sample_keys`).

    Args:
        sampler: positions in the split (a ``DistributedSampler`` or a list).
        batch_size: samples per batch; the last batch may be smaller.
        seed, rank: the run's seed and this rank, for the batch seeds.
        random: whether the batches need a seed.
    """

    def __init__(self, sampler, batch_size: int, seed: int = 0, rank: int = 0,
                 random: bool = False, stream: int = TRAIN):
        self.sampler, self.batch_size = sampler, batch_size
        self.seed, self.rank, self.random, self.stream = seed, rank, random, stream
        self.epoch = 0
        self.start = 0  # the next iteration's first sample of the shard (set_start)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.start = 0
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[int | None, list[int], int, int]]:
        # A tensor, not DistributedSampler's Python lists (~36 bytes a sample in every rank).
        positions = shard_order(self.sampler, self.start)
        self.start = 0
        seed = self.seed if self.random else None
        for start in range(0, len(positions), self.batch_size):
            yield (seed, positions[start:start + self.batch_size].tolist(), self.epoch,
                   self.stream)
