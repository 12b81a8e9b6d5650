"""The documents of ``ddp-exp prepare``'s sources, read as a stream.

A source is a text file (one document per file, or per blank-line separated paragraph with
``documents="paragraph"``), a folder of them (its files in sorted order, recursively, hidden
ones skipped), a JSON lines / CSV / Parquet file (one document per row, the text in column
``text_key``), or a Hugging Face ``datasets`` dataset (a hub name or a local path, one split).

Text is read as bytes and decoded as strict UTF-8 (CRLF and every other character kept as they
are); a file with a NUL byte in its first 8 KB is binary. A document is yielded as an iterator
of pieces of at most about :data:`PIECE_CHARS` characters, cut only where a newline is followed by
a non-blank character: GPT-2's pre-tokenizer splits there anyway, so encoding the pieces one by
one gives the ids of the whole document, and no document is ever held whole in memory.

Nothing here holds the corpus: :class:`Corpus` reads its sources again for each pass.

May use: :mod:`ddp_exp.config` (``ConfigError``); ``pyarrow`` and ``datasets`` lazily.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import itertools
import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field

from ddp_exp.config.errors import ConfigError, described

PIECE_CHARS = 1 << 16  # characters per piece of a long document (what the BPE trainer buffers)
READ_BYTES = 1 << 20
TABLE_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_CUT = re.compile(r"\n(?=\S)")
_WORD_CUT = re.compile(r"(?<=\S)(?= \S)")  # before " word": GPT-2's pre-tokens split there
HARD_CUT = 16  # pieces: a text with neither cut this long is cut anywhere
_PARAGRAPH = re.compile(r"(?:\r?\n)[ \t]*(?:\r?\n)+")


@dataclass
class Source:
    """One input: ``kind`` is ``text``, ``json``, ``csv``, ``parquet`` or ``dataset``."""

    path: str
    kind: str
    sha256: str = ""
    size: int = 0


@dataclass
class Corpus:
    """The sources of one prepare, read as documents (each a list of text pieces).

    Args:
        sources: paths of files or folders.
        text_key: the column of the text in JSON lines / CSV / Parquet rows and datasets.
        documents: ``file`` (a text file is one document) or ``paragraph`` (blank-line
            separated paragraphs of a text file are documents).
        dataset: a Hugging Face ``datasets`` name or path (instead of, or beside, files).
        split: the dataset's split.
    """

    sources: list[str]
    text_key: str = "text"
    documents: str = "file"
    dataset: str | None = None
    split: str = "train"
    files: list[Source] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.documents not in ("file", "paragraph"):
            raise ConfigError(f"--documents={self.documents} is invalid: file or paragraph")
        for path in self.sources:
            self.files.extend(_expand(path))
        if self.dataset:
            self.files.append(Source(self.dataset, "dataset"))
        if not self.files:
            raise ConfigError("ddp-exp prepare: no source: give text files, a folder of them, "
                              "JSON lines / CSV / Parquet files, or --dataset NAME_OR_PATH")

    def hash_files(self) -> None:
        """Fill each file's ``sha256`` and ``size`` (bytes); a dataset's is its fingerprint."""
        for src in self.files:
            if src.kind == "dataset":
                ds = _load_dataset(src.path, self.split)
                src.sha256, src.size = str(getattr(ds, "_fingerprint", "")), len(ds)
                continue
            h = hashlib.sha256()
            with open(src.path, "rb") as f:
                for block in iter(lambda f=f: f.read(READ_BYTES), b""):
                    h.update(block)
                    src.size += len(block)
            src.sha256 = h.hexdigest()

    def documents_stream(self) -> Iterator[Iterator[str]]:
        """Every non-empty document of every source, in order: an iterator of text pieces
        each, to be consumed before the next document is asked for."""
        for src in self.files:
            if src.kind == "text":
                yield from _text_documents(src.path, self.documents)
            else:
                yield from _row_documents(src, self.text_key, self.split)


def _expand(path: str) -> list[Source]:
    if os.path.isdir(path):
        found = []
        for root, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            found += [os.path.join(root, n) for n in sorted(names) if not n.startswith(".")]
        if not found:
            raise ConfigError(f"{path}: an empty folder (give a folder of text files)")
        for p in found:  # reading a FIFO or a device would wait for ever (a fresh user's find)
            _check_regular(p)
        return [_source(p) for p in found]
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file or folder (text files, a folder of them, "
                          "JSON lines / CSV / Parquet files)")
    return [_source(path)]


def _check_regular(path: str) -> None:
    """Refuse a file of a source folder that is no regular file: a FIFO, a socket, a device
    (reading one would wait for ever or never end), a symbolic link to nothing.

    Raises:
        ConfigError: one line naming the file and what it is.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror}; a symbolic link to nothing?):"
                          " remove it from the folder or give the files one by one") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{path}: not a regular file (a FIFO, socket or device): remove it "
                          "from the folder or give the files one by one")


def _source(path: str) -> Source:
    kind = TABLE_SUFFIXES.get(os.path.splitext(path)[1].lower(), "text")
    return Source(path, kind)


def _text_documents(path: str, documents: str) -> Iterator[Iterator[str]]:
    """A text file's documents, each an iterator of pieces (consume one before the next)."""
    if documents == "paragraph":
        rest = ""
        for text in _decoded_blocks(path):
            parts = _PARAGRAPH.split(rest + text)
            rest = parts.pop()
            yield from (iter([part]) for part in parts if part.strip())
        if rest.strip():
            yield iter([rest])
        return
    pieces = _file_pieces(path)
    first = next(pieces, None)
    if first is not None:  # an empty file is no document
        yield itertools.chain([first], pieces)


def _file_pieces(path: str) -> Iterator[str]:
    """A text file's text in pieces of about :data:`PIECE_CHARS` (module docstring)."""
    buffer = ""
    for text in _decoded_blocks(path):
        buffer += text
        while len(buffer) > PIECE_CHARS:
            cut = _last_cut(buffer, PIECE_CHARS)
            if cut is None and len(buffer) > HARD_CUT * PIECE_CHARS:  # no newline, no space
                cut = PIECE_CHARS
            if cut is None:
                break
            yield buffer[:cut]
            buffer = buffer[cut:]
    if buffer:
        yield buffer


def _decoded_blocks(path: str) -> Iterator[str]:
    """A file's text, decoded as strict UTF-8 block by block.

    Raises:
        ConfigError: a NUL byte in the first 8 KB (binary), or bytes that are not UTF-8.
    """
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(READ_BYTES)
            if offset == 0 and b"\0" in block[:8192]:
                raise ConfigError(f"{path}: a binary file (a NUL byte in its first 8 KB), not "
                                  "text; give UTF-8 text files")
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}: not UTF-8 text (near byte {offset + e.start}: "
                                  f"{e.reason}); convert it, e.g. iconv -f latin1 -t "
                                  "utf-8") from None
            offset += len(block)
            if text:
                yield text
            if not block:
                return


def _last_cut(text: str, limit: int) -> int | None:
    """The last place before ``limit`` right after a newline followed by a non-blank
    character, else before a single space between words (where GPT-2's pre-tokenizer splits
    anyway), or None."""
    for pattern in (_CUT, _WORD_CUT):
        cut = None
        for m in pattern.finditer(text, 0, limit + 1):
            cut = m.end()
        if cut:
            return cut
    return None


def _row_documents(src: Source, text_key: str, split: str) -> Iterator[Iterator[str]]:
    for row, text in enumerate(_rows(src, text_key, split)):
        if not isinstance(text, str):
            raise ConfigError(f"{src.path}: row {row} has {text_key!r} of type "
                              f"{type(text).__name__}; --text-key names a column of text")
        if text:
            yield iter([text])


def _rows(src: Source, key: str, split: str) -> Iterator[object]:
    missing = f"{src.path}: no column {key!r} (--text-key names the column of text)"
    if src.kind == "json":
        with open(src.path, encoding="utf-8") as f:
            for n, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise ConfigError(f"{src.path}: line {n + 1} is not JSON ({e}); "
                                      "give JSON lines, one object per line") from None
                if not isinstance(row, dict) or key not in row:
                    raise ConfigError(missing)
                yield row[key]
    elif src.kind == "csv":
        with open(src.path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            if key not in (reader.fieldnames or []):
                raise ConfigError(missing)
            for row in reader:
                yield row[key]
    elif src.kind == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(f"{src.path}: Parquet needs pyarrow: pip install "
                              "'ddp_exp[text]'") from None
        table = pq.ParquetFile(src.path)
        if key not in table.schema_arrow.names:
            raise ConfigError(missing)
        for batch in table.iter_batches(columns=[key], batch_size=1024):
            yield from batch.column(0).to_pylist()
    else:
        ds = _load_dataset(src.path, split)
        if key not in ds.column_names:
            raise ConfigError(f"--dataset {src.path}: no column {key!r} (one of "
                              f"{', '.join(ds.column_names)}; --text-key names it)")
        for start in range(0, len(ds), 1024):
            yield from ds[start:start + 1024][key]


def _load_dataset(name: str, split: str):
    try:
        import datasets
    except ImportError:
        raise ConfigError("--dataset needs the Hugging Face datasets library: pip install "
                          "'ddp_exp[text]'") from None
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:  # the hub's, the builder's: one line
        raise ConfigError(f"--dataset {name} --split {split}: could not load it "
                          f"({described(e, 200)})") from None
