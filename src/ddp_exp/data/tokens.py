"""``data=tokens``: a flat token stream cut into windows of ``data.block_size`` tokens.

A window starting at token ``i`` is the input ``tokens[i : i+T]`` and the target
``tokens[i+1 : i+T+1]`` (``T = data.block_size``): a language model predicts every next token.

Sources (:func:`load_tokens`):

* ``data.path`` to a ``.bin`` of raw tokens (nanoGPT's format; ``data.dtype`` uint16 or uint32,
  ``data.vocab_size`` required) or a 1-D integer ``.npy``: read through ``numpy.memmap``, never
  loaded whole, so a file far larger than memory trains;
* ``data.path`` to a folder ``ddp-exp prepare`` wrote (:mod:`ddp_exp.data.prepare_text`): its
  ``meta.json`` gives the vocabulary and dtype (no ``data.vocab_size`` to type; a different one
  is refused), ``train.bin`` is the training stream and ``val.bin`` the validation one (the
  split by document that prepare made), ``tokenizer.json`` decodes samples (a folder of a
  BPE's or a file's tokens without it still trains, with one warning line: no
  ``val/bits_per_byte``, samples as token ids);
* no ``data.path``: the built-in corpus, the English text of the standard library's
  ``pydoc_data.topics`` (ships with CPython, no download) as UTF-8 bytes, vocabulary 256.

Splits (:func:`split_stream`): the stream's tail holds ``data.val_size`` validation windows
(null: about 10% of the stream) then ``data.test_size`` test windows, fixed and non-overlapping,
the same for any ``world_size``. The training region before it is cut into non-overlapping
windows under a shift ``0 <= s < T`` drawn per epoch from ``(seed, epoch)`` alone
(:meth:`TokenSplit.batch` takes the epoch), in the order of :class:`WindowSampler`: a seeded
permutation of the window numbers per epoch (:class:`WindowOrder`, from ``(seed, epoch,
global index)``, computed per batch and never stored), sharded like ``DistributedSampler``
(strided), never drawn from the rank, so a global batch holds the same windows for any world
size.

A token id ``>= vocab_size`` is found in the batch that reads it (no scan of the file at start)
and reported in one line with its position in the stream. A text file given as ``data.path``
(:func:`text_file_line`) is one line naming ``ddp-exp prepare``, not a dtype or vocabulary
complaint.

May use: NumPy, torch, :mod:`ddp_exp.config` (``ConfigError``),
:func:`ddp_exp.data.prepare_out.shell_override` (the override a line names).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import DistributedSampler

from ddp_exp.config.errors import ConfigError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SHIFT_STREAM = 0x5EED  # SeedSequence's extra word for the per-epoch shift
BUILTIN_NAME = "pydoc_data.topics (built-in, byte-level)"
TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst", ".csv", ".tsv", ".json", ".jsonl", ".html",
                 ".xml", ".tex", ".py")
SNIFF_BYTES = 1 << 16  # the head of a file read to tell text from tokens

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TokenStream:
    """A token stream and what it needs to be cut into windows.

    Attributes:
        tokens: 1-D integer array (a ``numpy.memmap`` for files), ``[L]``.
        vocab_size: token ids are ``0 .. vocab_size-1``.
        block_size: tokens per window ``T``.
        source: the file or the built-in corpus's name, for messages.
        byte_level: True when a token is one byte of text (bits per byte are meaningful).
        val_tokens: a prepared folder's ``val.bin`` (its validation and test windows), or
            None (they are the stream's tail).
        tokenizer: the ``tokenizer.json`` that decodes the ids (a prepared folder's), or None;
            the built-in corpus is bytes.
    """

    tokens: np.ndarray
    vocab_size: int
    block_size: int
    source: str
    byte_level: bool = False
    val_tokens: np.ndarray | None = None
    tokenizer: str | None = None


def builtin_corpus() -> np.ndarray:
    """The built-in corpus: ``pydoc_data.topics``' texts in sorted key order, UTF-8 bytes
    ``[L]`` uint8 (about 465 KB; its exact text differs between Python versions)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def load_tokens(path: str | None = None, dtype: str = "uint16", vocab_size: int | None = None,
                block_size: int = 128) -> TokenStream:
    """``data=tokens``' target: open the stream (memory-mapped for files; nothing is scanned).

    Raises:
        ConfigError: an unknown ``data.dtype``, a missing or unreadable file, a text file
            (:func:`text_file_line`), a ``.bin`` whose size is not a multiple of its dtype, a
            ``.npy`` that is not 1-D integer, a file without ``data.vocab_size``, a stream
            shorter than ``block_size + 1`` tokens.
    """
    if block_size < 1:
        raise ConfigError(f"data.block_size={block_size} is invalid: a positive number of tokens")
    if path is None:
        tokens, vocab, source, byte_level = builtin_corpus(), 256, BUILTIN_NAME, True
        if vocab_size not in (None, 256):
            raise ConfigError(f"data.vocab_size={vocab_size} is invalid for the built-in corpus "
                              "(bytes): null or 256")
    elif os.path.isdir(str(path)):
        return _open_prepared(str(path), vocab_size, block_size)
    else:
        text = text_file_line(str(path))
        if text:
            raise ConfigError(text)
        tokens, source, byte_level = _open_file(str(path), dtype), str(path), False
        if vocab_size is None or vocab_size < 1:
            raise ConfigError(f"data.vocab_size={vocab_size} is invalid: a token file needs its "
                              f"vocabulary size (ids 0..vocab_size-1), e.g. "
                              f"data.vocab_size=50304 for GPT-2's tokens ({source})")
        vocab = int(vocab_size)
    if len(tokens) < block_size + 1:
        raise ConfigError(f"data.path={source}: {len(tokens)} tokens, shorter than "
                          f"data.block_size + 1 = {block_size + 1} (one window and its target); "
                          "give a longer stream or a smaller data.block_size")
    return TokenStream(tokens, vocab, int(block_size), source, byte_level)


def _open_prepared(path: str, vocab_size: int | None, block_size: int) -> TokenStream:
    """A folder ``ddp-exp prepare`` wrote: ``train.bin``, ``val.bin`` and ``meta.json``."""
    import json

    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_path):
        raise ConfigError(f"data.path={path} is a folder without meta.json: give a folder that "
                          "ddp-exp prepare wrote (ddp-exp prepare TEXT... --out DIR), or a .bin "
                          "/ .npy file of tokens")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        vocab, dtype = int(meta["vocab_size"]), str(meta["dtype"])
        counts = {name: int(meta[name]["tokens"]) for name in ("train", "val")}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"data.path={path}: meta.json is not a prepared folder's "
                          f"({type(e).__name__}: {e}); prepare the folder again") from None
    if vocab_size is not None and int(vocab_size) != vocab:
        raise ConfigError(f"data.vocab_size={vocab_size} conflicts with {meta_path}'s "
                          f"vocab_size {vocab}: leave data.vocab_size unset (null) for a "
                          "prepared folder")
    streams = {}
    for name in ("train", "val"):
        file = os.path.join(path, f"{name}.bin")
        streams[name] = _open_file(file, dtype)
        if len(streams[name]) != counts[name]:
            raise ConfigError(f"{file}: {len(streams[name])} tokens, but meta.json says "
                              f"{counts[name]} (a truncated or replaced file); prepare again")
    if len(streams["train"]) < block_size + 1:
        raise ConfigError(f"data.path={path}: train.bin holds {len(streams['train'])} tokens, "
                          f"shorter than data.block_size + 1 = {block_size + 1}; give more "
                          "text or a smaller data.block_size")
    tokenizer = os.path.join(path, "tokenizer.json")
    byte_level = meta.get("tokenizer") == "bytes"  # the ids are bytes: decoded without it
    if not os.path.isfile(tokenizer) and not byte_level and _is_first_rank():
        command = meta.get("command")
        log.warning("%s is missing: no val/bits_per_byte and no text samples (token ids "
                    "instead); run ddp-exp prepare again to write it%s", tokenizer,
                    f" (meta.json's command: {shlex.join(map(str, command))})"
                    if isinstance(command, list) and command else "")
    return TokenStream(streams["train"], vocab, int(block_size), path, byte_level=byte_level,
                       val_tokens=streams["val"],
                       tokenizer=tokenizer if os.path.isfile(tokenizer) else None)


def _is_first_rank() -> bool:
    """Whether this process says what every rank would: the launcher (no ``RANK`` yet, its
    ranks are given the built data) or torchrun's rank 0, where each rank builds its own."""
    return os.environ.get("RANK", "0") == "0"


def text_file_line(path: str) -> str | None:
    """The line for a text file given as tokens, naming the command that makes tokens of it;
    None for any other file. Text: the file's first :data:`SNIFF_BYTES` decode as UTF-8 (a
    character cut at the end allowed), hold no NUL byte (a ``uint16`` or ``uint32`` id under
    256 has one) and, unless the name ends in a text suffix (:data:`TEXT_SUFFIXES`), are at
    least 95% printable characters or whitespace. A ``.npy`` is never text."""
    if path.endswith(".npy") or not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError:
        return None
    if not head or b"\0" in head:
        return None
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:  # not just a character cut by the read
            return None
        text = head[:e.start].decode("utf-8")
    printable = sum(c.isprintable() or c.isspace() for c in text)
    if not path.lower().endswith(TEXT_SUFFIXES) and printable < 0.95 * len(text):
        return None
    from ddp_exp.data.prepare_out import shell_override

    stem = os.path.splitext(os.path.basename(os.path.normpath(path)))[0] or "text"
    folder = os.path.join(os.path.dirname(path), f"{stem}_prepared")
    return (f"data.path={path} is a text file (UTF-8), not tokens: prepare it first, "
            f"ddp-exp prepare {shlex.quote(path)} --out {shlex.quote(folder)}, then train with "
            f"{shell_override('data.path', folder)}")


def _open_file(path: str, dtype: str) -> np.ndarray:
    if not os.path.isfile(path):
        raise ConfigError(f"data.path={path} is invalid: no such file (a .bin of tokens or a "
                          "1-D integer .npy)")
    if path.endswith(".npy"):
        try:
            tokens = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as e:
            raise ConfigError(f"data.path={path}: not a readable .npy file ({e})") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ConfigError(f"data.path={path}: a .npy of shape {list(tokens.shape)} and dtype "
                              f"{tokens.dtype}; a token stream is 1-D integer")
        return tokens
    if dtype not in DTYPES:
        raise ConfigError(f"data.dtype={dtype!r} is invalid: one of {', '.join(DTYPES)}")
    size, itemsize = os.path.getsize(path), np.dtype(DTYPES[dtype]).itemsize
    if size % itemsize:
        raise ConfigError(f"data.path={path}: {size} bytes, not a multiple of data.dtype={dtype}'s "
                          f"{itemsize} bytes per token (a truncated file, or another dtype)")
    if size == 0:
        return np.zeros(0, DTYPES[dtype])
    return np.memmap(path, dtype=DTYPES[dtype], mode="r")


@dataclasses.dataclass
class TokenSplit:
    """One split of a token stream: the interface of :class:`ddp_exp.data.lazy.TorchSplit`.

    Validation and test splits (``shifted=False``): window ``p`` starts at
    ``first + p * block_size``. The training split (``shifted=True``): window ``p`` starts at
    ``first + shift(epoch) + p * block_size``, ``0 <= shift < block_size``.
    """

    stream: TokenStream
    first: int
    count: int
    shifted: bool = False
    seed: int = 0
    positions: np.ndarray | None = None  # a subset's window numbers (None: all)

    random = False  # batches draw no random numbers of the global RNGs
    epoch_batches = True  # the loader passes the epoch to batch()
    elementwise = True  # a label per token
    transform = None
    target_width = 1

    def __len__(self) -> int:
        return self.count if self.positions is None else len(self.positions)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.stream.block_size,)

    @property
    def num_classes(self) -> int:
        return self.stream.vocab_size

    @property
    def num_outputs(self) -> int:
        return self.stream.vocab_size

    def make_sampler(self, world_size: int, rank: int, shuffle: bool, seed: int):
        """The training sampler (:func:`window_sampler`): no permutation of every window."""
        return window_sampler(len(self), world_size, rank, shuffle, seed)

    def shift(self, epoch: int) -> int:
        """The training windows' offset this epoch, from ``(seed, epoch)`` only."""
        if not self.shifted:
            return 0
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch, SHIFT_STREAM]))
        return int(rng.integers(self.stream.block_size))

    def starts(self, positions: Sequence[int], epoch: int = 0) -> np.ndarray:
        """Token offsets of the windows at ``positions`` this epoch, int64 ``[B]``."""
        p = np.asarray(positions, dtype=np.int64)
        if self.positions is not None:
            p = self.positions[p]
        return self.first + self.shift(epoch) + p * self.stream.block_size

    def subset(self, positions: np.ndarray) -> TokenSplit:
        """The windows at ``positions`` of this split."""
        base = np.arange(self.count) if self.positions is None else self.positions
        return dataclasses.replace(self, positions=base[np.asarray(positions, dtype=np.int64)])

    def batch(self, positions: Sequence[int], items_read: Any = None, epoch: int = 0):
        """Inputs and targets of the windows at ``positions``: two int64 tensors ``[B, T]``.

        Raises:
            ConfigError: a token id ``>= vocab_size`` (or negative) in these windows, named
                with its position in the stream.
        """
        import torch

        del items_read
        size = self.stream.block_size
        rows = np.stack([np.asarray(self.stream.tokens[s:s + size + 1])
                         for s in self.starts(positions, epoch)]).astype(np.int64)
        bad = (rows >= self.stream.vocab_size) | (rows < 0)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            at = int(self.starts(positions, epoch)[r]) + int(c)
            raise ConfigError(f"data.path={self.stream.source}: token {at} has id {rows[r, c]}, "
                              f"outside the vocabulary 0..{self.stream.vocab_size - 1} "
                              f"(data.vocab_size={self.stream.vocab_size})")
        rows = torch.from_numpy(rows)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def fingerprint(self) -> int:
        """What the nodes of a multi-node world compare: the split's place and size."""
        import zlib

        extra = b"" if self.positions is None else np.ascontiguousarray(self.positions).tobytes()
        return zlib.crc32(extra, zlib.crc32(str((self.stream.source, len(self.stream.tokens),
                                                  self.first, self.count)).encode()))


def split_stream(stream: TokenStream, val_size: int | None, test_size: int, seed: int):
    """Cut ``stream`` into the training, validation and test splits (see the module docstring);
    returns :class:`ddp_exp.data.splits.Datasets`.

    Raises:
        ConfigError: ``data.val_size`` or ``data.test_size`` negative, or so large that no
            training window is left.
    """
    from ddp_exp.data.splits import Datasets

    if stream.val_tokens is not None:
        return _split_prepared(stream, val_size, test_size, seed)
    size, total = stream.block_size, len(stream.tokens)
    windows = (total - 1) // size
    val = max(1, windows // 10) if val_size is None else int(val_size)
    test = int(test_size or 0)
    if val < 0 or test < 0:
        raise ConfigError(f"data.val_size={val_size}, data.test_size={test_size}: windows, >= 0")
    tail = total - 1 - (val + test) * size  # the first held-out window's start
    train = (tail - size) // size if tail > size else 0
    if train < 1:
        raise ConfigError(f"data.val_size={val} and data.test_size={test} windows of "
                          f"data.block_size={size} leave no training window in "
                          f"{stream.source}'s {total} tokens ({windows} windows); hold out fewer")
    return Datasets(train=TokenSplit(stream, 0, train, shifted=True, seed=seed),
                    val=TokenSplit(stream, tail, val),
                    test=TokenSplit(stream, tail + val * size, test))


def _split_prepared(stream: TokenStream, val_size: int | None, test_size: int, seed: int):
    """A prepared folder: training windows from ``train.bin``; ``data.val_size`` validation
    windows (null: every whole window) then ``data.test_size`` test windows from ``val.bin``."""
    from ddp_exp.data.splits import Datasets

    size = stream.block_size
    held = dataclasses.replace(stream, tokens=stream.val_tokens, val_tokens=None,
                               source=os.path.join(stream.source, "val.bin"))
    windows = max(0, (len(held.tokens) - 1) // size)
    test = int(test_size or 0)
    val = windows - test if val_size is None else int(val_size)
    if val < 0 or test < 0 or val + test > windows:
        raise ConfigError(f"data.val_size={val_size} and data.test_size={test_size} windows of "
                          f"data.block_size={size} do not fit {held.source}'s {windows} windows: "
                          "hold out fewer, or prepare with a larger --val-fraction")
    train = (len(stream.tokens) - 1 - size) // size  # room for any shift 0..size-1
    if train < 1:
        raise ConfigError(f"data.path={stream.source}: train.bin's {len(stream.tokens)} tokens "
                          f"hold no shifted window of data.block_size={size} (2 x block_size "
                          "tokens needed); give more text or a smaller data.block_size")
    return Datasets(train=TokenSplit(stream, 0, train, shifted=True, seed=seed),
                    val=TokenSplit(held, 0, val), test=TokenSplit(held, val * size, test))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic): a well-mixed hash."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class WindowOrder:
    """A seeded pseudo-random permutation of ``0 .. n-1`` computed per element, never stored:
    a 4-round Feistel network on ``2k`` bits (``4^k >= n``) with cycle-walking, keys from
    ``(seed, epoch)``. ``order[j]`` for ``j >= n`` is ``order[j - n]`` (DistributedSampler's
    padding: the epoch's start again)."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int, epoch: int, shuffle: bool = True):
        self.n, self.shuffle = n, shuffle
        self.half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
        self.keys = np.random.SeedSequence([seed, epoch, 0x0DE5]).generate_state(
            self.ROUNDS, np.uint64)

    def __call__(self, j: np.ndarray) -> np.ndarray:
        """The permutation at global indices ``j`` (int64 ``[m]``) -> int64 ``[m]``."""
        j = np.asarray(j, dtype=np.int64) % self.n
        if not self.shuffle:
            return j
        x = j.astype(np.uint64)
        todo = np.ones(len(x), bool)
        while todo.any():  # cycle-walk: values of the 4^k domain outside 0..n-1 go round again
            x[todo] = self._feistel(x[todo])
            todo = x >= np.uint64(self.n)
        return x.astype(np.int64)

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        mask = np.uint64((1 << self.half) - 1)
        left, right = x >> np.uint64(self.half), x & mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << np.uint64(self.half)) | right


class LazyShard:
    """One rank's positions of an epoch, ``order[rank], order[rank + W], ...``, computed per
    slice: ``len`` and ``[a:b]`` (an int64 tensor), like the tensor :func:`shard_order` gives."""

    def __init__(self, order: WindowOrder, rank: int, world_size: int, count: int):
        self.order, self.rank, self.world_size, self.count = order, rank, world_size, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, part: slice):
        import torch

        start, stop, step = part.indices(self.count)
        local = np.arange(start, stop, step, dtype=np.int64)
        return torch.from_numpy(self.order(self.rank + local * self.world_size))


class WindowSampler(DistributedSampler):
    """A ``DistributedSampler`` over ``n`` training windows whose epoch order is
    :class:`WindowOrder` (computed per batch, never a permutation of ``n`` in memory) instead of
    ``randperm(n)``; sharding and padding as DistributedSampler's."""

    def shard(self) -> LazyShard:
        """This rank's positions this epoch, computed per slice."""
        order = WindowOrder(len(self.dataset), self.seed, self.epoch, self.shuffle)
        return LazyShard(order, self.rank, self.num_replicas, self.num_samples)

    def __iter__(self):
        shard = self.shard()
        for start in range(0, len(shard), 65536):
            yield from shard[start:start + 65536].tolist()


def window_sampler(n: int, world_size: int, rank: int, shuffle: bool, seed: int
                   ) -> WindowSampler:
    """The training sampler of ``n`` windows for ``rank`` of ``world_size``."""
    return WindowSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=False)
