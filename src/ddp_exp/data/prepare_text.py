"""``ddp-exp prepare``: text to a prepared folder that ``data=tokens data.path=DIR`` trains on.

The folder holds ``train.bin`` and ``val.bin`` (token ids, nanoGPT's raw format, ``uint16``, or
``uint32`` when the vocabulary passes 65,536 ids: never wrapped), ``tokenizer.json``
(:mod:`ddp_exp.data.text_tokenizer`) and ``meta.json`` (vocabulary size, dtype, each split's
tokens, documents and UTF-8 bytes, the sources' SHA-256, the seed and the command).

Steps, streaming (the corpus is never in memory; passes read the sources again):

1. Count the documents and hash the sources (:class:`ddp_exp.data.text_sources.Corpus`).
2. Split by document: ``max(1, round(n * val_fraction))`` documents drawn by a permutation
   seeded from ``seed`` go to validation, the rest to training, each in source order; a
   document is never cut in two.
3. ``bpe``: train a byte-level BPE (Hugging Face ``tokenizers``: GPT-2's pre-tokenizer, the 256
   bytes as its alphabet, ``<|endoftext|>`` special) on the training documents only.
4. Encode the documents in batches (``encode_batch``, on every core), each followed by
   ``<|endoftext|>``, appending to the split's ``.bin``.

Everything is written in a work folder beside ``out``
(:class:`ddp_exp.data.prepare_out.WorkFolder`) and renamed to it at the end: a failed or
interrupted prepare leaves no half-written folder, and the folders it created above ``out``
are removed again. The same command gives byte-identical files. An ``--out`` that cannot be
written (it cannot be created, lies under a file, is not writable, or its disk fills) is one
line naming ``--out``, the path and the cause (:func:`ddp_exp.data.prepare_out.out_error`); a
killed prepare's leftovers are removed by the next one into the same ``out``.

May use: NumPy, tqdm, :mod:`ddp_exp.config` (``ConfigError``), this package's text modules and
:mod:`ddp_exp.data.prepare_out` (the work folder).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import stat
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ddp_exp.config.errors import ConfigError
from ddp_exp.data.prepare_out import WorkFolder, writing
from ddp_exp.data.text_sources import Corpus
from ddp_exp.data.text_tokenizer import END_OF_TEXT, TextTokenizer, require_tokenizers

META_FORMAT = "ddp_exp prepared tokens 1"
BATCH_CHARS = 4 << 20  # characters encoded per encode_batch call
# The 256 bytes, <|endoftext|> and at least 255 merges: a BPE with fewer merges is bytes with a
# handful of pairs (use --tokenizer bytes), and a vocabulary under the byte alphabet is no BPE.
MIN_BPE_VOCAB = 512


@dataclass
class PrepareOptions:
    """What ``ddp-exp prepare`` was asked for (its command-line options)."""

    sources: Sequence[str]
    out: str
    tokenizer: str = "bpe"
    vocab_size: int = 8192
    val_fraction: float = 0.1
    seed: int = 0
    text_key: str = "text"
    documents: str = "file"
    dataset: str | None = None
    split: str = "train"
    progress: bool = True
    command: Sequence[str] = ()


def dtype_for(vocab_size: int) -> str:
    """``uint16`` when every id fits (``vocab_size <= 65536``), else ``uint32``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def check_options(opts: PrepareOptions) -> None:
    """Refuse bad options before reading anything.

    Raises:
        ConfigError: a vocabulary below the byte alphabet plus ``<|endoftext|>``, a
            validation fraction outside ``[0, 1)``, a source that exists but is no regular file
            or folder (a device, a FIFO, a socket: ``/dev/null``) or is a symbolic link to
            nothing, an existing non-empty ``--out`` that is not a prepared folder.
    """
    if opts.tokenizer == "bpe" and opts.vocab_size < MIN_BPE_VOCAB:
        raise ConfigError(f"--vocab-size={opts.vocab_size} is invalid: a byte-level BPE holds "
                          f"the 256 bytes, {END_OF_TEXT} and its merges, at least "
                          f"{MIN_BPE_VOCAB} (e.g. 2000 for a few MB of text, 32000 for GBs); "
                          "--tokenizer bytes for a byte-level vocabulary")
    if opts.tokenizer == "bpe" and opts.vocab_size > 1 << 32:
        raise ConfigError(f"--vocab-size={opts.vocab_size} is invalid: at most 2^32 ids")
    if not 0 <= opts.val_fraction < 1:
        raise ConfigError(f"--val-fraction={opts.val_fraction} is invalid: 0 <= f < 1")
    for source in opts.sources:
        kind = _not_a_file_or_folder(source)
        if kind:
            raise ConfigError(f"{source}: {kind}: give text files, a folder of them, JSON "
                              "lines / CSV / Parquet files")
    if os.path.exists(opts.out) and (not os.path.isdir(opts.out) or (
            os.listdir(opts.out) and not os.path.isfile(os.path.join(opts.out, "meta.json")))):
        raise ConfigError(f"--out={opts.out} exists and is not a prepared folder: give a new "
                          "folder (a prepared one is replaced)")


def _not_a_file_or_folder(path: str) -> str | None:
    """What ``path`` is when it exists but is no regular file or folder (``exists but is a
    character device, not a regular file or folder``), or is a symbolic link to nothing; None
    otherwise (a file, a folder, or nothing there: the source reader's own line)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            return f"a symbolic link to {os.readlink(path)}, which does not exist"
        return None
    except OSError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"))
    kind = next((name for test, name in kinds if test(mode)), "a special file")
    return f"exists but is {kind}, not a regular file or folder"


def prepare(opts: PrepareOptions) -> dict:
    """Run every step (module docstring); returns the ``meta.json`` written.

    Raises:
        ConfigError: bad options (:func:`check_options`), an unreadable, binary or non-UTF-8
            source, a corpus with no text, too few documents to split, a tokenizer file that
            does not load or has no ``<|endoftext|>``, an ``--out`` that cannot be written
            (:func:`ddp_exp.data.prepare_out.out_error`).
    """
    with _sigint_noted() as interrupted:
        return _prepare(opts, interrupted)


@contextlib.contextmanager
def _sigint_noted():
    """While preparing, a SIGINT is noted as well as raised: Python drops an exception raised
    in a ``__del__`` (tqdm's bar, collected while the tokenizer trained: "Exception ignored
    ... KeyboardInterrupt"), and a Ctrl-C 2-3 s into a 52 MB corpus was lost that way: the
    folder was written and the command exited 0. :func:`_raise_if` raises it again at the
    next step, before anything lands. Yields the list the signals are noted in."""
    interrupted: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return
    previous = signal.getsignal(signal.SIGINT)

    def note(signum, frame):
        interrupted.append(signum)
        if callable(previous):
            previous(signum, frame)
        else:
            raise KeyboardInterrupt

    if previous is signal.SIG_IGN:  # ignored at start (nohup, a background job): still so
        yield interrupted
        return
    signal.signal(signal.SIGINT, note)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def _raise_if(interrupted: list[int]) -> None:
    """A SIGINT noted and lost (see :func:`_sigint_noted`): raise it now."""
    if interrupted:
        raise KeyboardInterrupt


def _prepare(opts: PrepareOptions, interrupted: list[int]) -> dict:
    check_options(opts)
    with WorkFolder(opts.out) as work:  # --out is checked before the corpus is read
        return _prepare_in(opts, interrupted, work)


def _prepare_in(opts: PrepareOptions, interrupted: list[int], folder: WorkFolder) -> dict:
    corpus = Corpus(list(opts.sources), opts.text_key, opts.documents, opts.dataset, opts.split)
    if opts.tokenizer == "bpe":
        require_tokenizers("--tokenizer bpe")
    corpus.hash_files()
    count, chars = 0, 0
    for doc in _bar(corpus.documents_stream(), opts.progress, "reading", "documents"):
        count += 1
        chars += sum(len(p) for p in doc)
    if count == 0 or chars == 0:
        raise ConfigError(f"{', '.join(s.path for s in corpus.files)}: no text (empty "
                          "sources); give files with text")
    _raise_if(interrupted)
    val_docs = _val_documents(count, opts.val_fraction, opts.seed)
    tokenizer = _tokenizer(opts, corpus, val_docs)
    _raise_if(interrupted)
    eot = tokenizer.end_of_text
    if eot is None:
        raise ConfigError(f"--tokenizer={opts.tokenizer}: no {END_OF_TEXT} token in its "
                          "vocabulary (documents are joined with it); add it as a special token")
    dtype = dtype_for(tokenizer.vocab_size)
    work = folder.path
    stats = _encode(corpus, tokenizer, val_docs, work, dtype, eot, opts.progress)
    with writing():
        tokenizer.save(os.path.join(work, "tokenizer.json"))
        meta = {
            "format": META_FORMAT,
            "vocab_size": tokenizer.vocab_size,
            "dtype": dtype,
            "end_of_text": eot,
            "tokenizer": opts.tokenizer if opts.tokenizer in ("bytes", "bpe") else "file",
            "byte_level": tokenizer.byte_level,
            "train": stats["train"],
            "val": stats["val"],
            "documents": count,
            "val_fraction": opts.val_fraction,
            "seed": opts.seed,
            "sources": [{"path": s.path, "kind": s.kind, "sha256": s.sha256, "size": s.size}
                        for s in corpus.files],
            "command": list(opts.command),
        }
        with open(os.path.join(work, "meta.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1, ensure_ascii=False)
            f.write("\n")
        _raise_if(interrupted)  # the last moment nothing has landed
        folder.land()
    return meta


def val_share_warning(meta: dict) -> str | None:
    """One line when the validation split's share of the tokens is far from the
    ``val_fraction`` of the documents asked for (under half of it, or over twice it): the split
    is by whole document, so one long document drawn for validation (or none of the long ones)
    skews it. None when near, or with ``val_fraction`` 0."""
    fraction = float(meta.get("val_fraction") or 0.0)
    train, val = meta["train"]["tokens"], meta["val"]["tokens"]
    if fraction <= 0 or train + val == 0:
        return None
    share = val / (train + val)
    if fraction / 2 <= share <= 2 * fraction:
        return None
    docs = meta["val"]["documents"]
    return (f"warning: validation holds {share:.0%} of the tokens, --val-fraction={fraction:g} "
            f"asked for {fraction:.0%} ({plural(docs, 'document')} of {meta['documents']:,}: "
            "the split never cuts a document): cut the text into more documents (--documents "
            "paragraph, or several files) or draw other ones (--seed)")


def plural(count: int, noun: str) -> str:
    """``1 document``, ``2 documents``: a count and its noun, thousands separated."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def _val_documents(count: int, fraction: float, seed: int) -> np.ndarray:
    """Whether each document is validation's: bool ``[count]``, from ``seed`` only."""
    is_val = np.zeros(count, dtype=bool)
    if fraction == 0:
        return is_val
    if count < 2:
        raise ConfigError(f"1 document cannot be split into training and validation "
                          f"(--val-fraction={fraction}): give several files, --documents "
                          "paragraph for one text file, or --val-fraction 0")
    k = min(count - 1, max(1, round(count * fraction)))
    is_val[np.random.default_rng(seed).permutation(count)[:k]] = True
    return is_val


def _tokenizer(opts: PrepareOptions, corpus: Corpus, val_docs: np.ndarray) -> TextTokenizer:
    if opts.tokenizer == "bytes":
        return TextTokenizer.bytes()
    if opts.tokenizer != "bpe":
        return TextTokenizer.load(opts.tokenizer)
    tk = require_tokenizers("--tokenizer bpe")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = tk.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=int(opts.vocab_size), special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)

    def training_pieces() -> Iterator[str]:
        for i, doc in enumerate(corpus.documents_stream()):
            if not val_docs[i]:
                yield from doc

    hf.train_from_iterator(_bar(training_pieces(), opts.progress, "training the BPE",
                                "pieces"), trainer=trainer)
    return TextTokenizer("hf", hf, "bpe")


def _encode(corpus: Corpus, tokenizer: TextTokenizer, val_docs: np.ndarray, work: str,
            dtype: str, eot: int, progress: bool) -> dict:
    """Encode every document into ``work/{train,val}.bin``; returns each split's counts."""
    stats = {name: {"tokens": 0, "documents": 0, "bytes": 0} for name in ("train", "val")}
    with writing():
        files = {name: open(os.path.join(work, f"{name}.bin"), "wb") for name in stats}
    batch: list[tuple[int, int, str]] = []  # (document, is the last piece, text)
    size = 0

    def flush() -> None:
        nonlocal size
        ids = tokenizer.encode_batch([text for _, _, text in batch])
        for (doc, last, text), piece in zip(batch, ids, strict=True):
            name = "val" if val_docs[doc] else "train"
            if last:
                piece = piece + [eot]
                stats[name]["documents"] += 1
            stats[name]["tokens"] += len(piece)
            stats[name]["bytes"] += len(text.encode("utf-8"))
            # file.write, not ndarray.tofile: a short write of tofile is an OSError without
            # errno ("2801 requested and 1295 written"), a full disk that names no cause
            with writing():
                files[name].write(np.asarray(piece, dtype=dtype).tobytes())
        batch.clear()
        size = 0

    try:
        for doc, pieces in enumerate(_bar(corpus.documents_stream(), progress, "encoding",
                                          "documents")):
            text = next(pieces)
            for following in itertools.chain(pieces, [None]):  # a piece ahead: the last?
                batch.append((doc, following is None, text))
                size += len(text)
                if size >= BATCH_CHARS:
                    flush()
                text = following
        if batch:
            flush()
    finally:
        with writing():
            for f in files.values():
                f.close()
    return stats


def _bar(items, enabled: bool, desc: str, unit: str):
    """A tqdm progress bar on stderr over ``items`` (none when not ``enabled``)."""
    if not enabled:
        return items
    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (a log, a pipe)
    return tqdm(items, desc=desc, unit=f" {unit}", mininterval=1.0, leave=False, disable=None)
