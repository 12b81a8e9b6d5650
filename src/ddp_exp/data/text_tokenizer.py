"""A prepared folder's tokenizer (``tokenizer.json``): text to token ids and back.

Two kinds, both written by ``ddp-exp prepare`` (:mod:`ddp_exp.data.prepare_text`):

* **bytes**: a token is one UTF-8 byte (ids 0..255), ``<|endoftext|>`` is 256; vocabulary 257.
  Its ``tokenizer.json`` is ddp_exp's own three keys (``{"ddp_exp": "bytes", ...}``) and needs
  no library.
* **a Hugging Face** ``tokenizers`` **tokenizer** (``tokenizer.json`` in that library's format):
  the byte-level BPE that prepare trains, or any file a user gives. Needs the ``ddp_exp[text]``
  extra.

Decoding for people (:meth:`TextTokenizer.decode`): for byte-level vocabularies (bytes, and a
BPE whose pre-tokenizer is ``ByteLevel``) the ids become bytes and the bytes text, where bytes
that form no character (a sample cut in the middle of a Chinese character, or a model's
ill-formed sequence) are dropped, never shown as U+FFFD; a tokenizer of another kind decodes
with its own ``decode``. A prepared corpus decodes back exactly (``decode(encode(t)) == t``,
CRLF, accents, CJK and emoji included).

May use: :mod:`ddp_exp.config` (``ConfigError``); ``tokenizers`` lazily.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from functools import cached_property

from ddp_exp.config.errors import ConfigError, described

END_OF_TEXT = "<|endoftext|>"
TEXT_EXTRA = "pip install 'ddp_exp[text]'"
BYTES_KIND = "bytes"


def require_tokenizers(what: str):
    """The ``tokenizers`` module, or a :class:`ConfigError` naming the extra that provides it."""
    try:
        import tokenizers
    except ImportError:
        raise ConfigError(f"{what} needs the Hugging Face tokenizers library: "
                          f"{TEXT_EXTRA}") from None
    return tokenizers


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte
    (``tokenizers.pre_tokenizers.ByteLevel.alphabet()``'s mapping, from GPT-2's
    ``bytes_to_unicode``), as ``{character: byte}``."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def text_of(data: bytes) -> str:
    """UTF-8 text of ``data``, dropping bytes that form no character (never U+FFFD)."""
    return data.decode("utf-8", "ignore")


class TextTokenizer:
    """Text <-> token ids for a prepared folder or a ``tokenizer.json``.

    Args:
        kind: ``bytes`` or ``hf`` (a ``tokenizers.Tokenizer``).
        hf: the Hugging Face tokenizer (``hf`` kind only).
        source: the file it came from, for messages.
    """

    def __init__(self, kind: str, hf=None, source: str = ""):
        self.kind, self.hf, self.source = kind, hf, source

    # ------------------------------------------------------------------ building and saving
    @classmethod
    def bytes(cls) -> TextTokenizer:
        """The byte-level tokenizer: ids 0..255 are bytes, 256 is ``<|endoftext|>``."""
        return cls(BYTES_KIND, source=BYTES_KIND)

    @classmethod
    def load(cls, path: str) -> TextTokenizer:
        """Read ``path`` (a ``tokenizer.json``, or a folder holding one).

        Raises:
            ConfigError: no such file, not a tokenizer file, or a Hugging Face tokenizer
                without the ``tokenizers`` library.
        """
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: no such tokenizer file (a tokenizer.json: a prepared "
                              "folder's, or a Hugging Face tokenizers file)")
        try:
            with open(path, encoding="utf-8") as f:
                spec = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: not a tokenizer.json ({e})") from None
        if isinstance(spec, dict) and spec.get("ddp_exp") == BYTES_KIND:
            return cls(BYTES_KIND, source=path)
        tokenizers = require_tokenizers(f"the tokenizer {path}")
        try:
            hf = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the library's own parse error
            raise ConfigError(f"{path}: not a Hugging Face tokenizer file "
                              f"({described(e, 200)})") from None
        return cls("hf", hf, path)

    def save(self, path: str) -> None:
        """Write ``tokenizer.json`` to ``path``, through Python's file (the library's own
        ``save`` is Rust's: a full disk came back as a bare ``Exception``, no ``OSError`` with
        its errno); the same bytes as ``Tokenizer.save``.

        Raises:
            OSError: the write failed (a full disk: ``ENOSPC``).
        """
        with open(path, "w", encoding="utf-8", newline="") as f:
            if self.kind == BYTES_KIND:
                json.dump({"ddp_exp": BYTES_KIND, "vocab_size": 257,
                           "end_of_text": 256}, f, indent=1)
                f.write("\n")
            else:
                f.write(self.hf.to_str(pretty=True))

    # ------------------------------------------------------------------------------ queries
    @property
    def vocab_size(self) -> int:
        """Ids are ``0 .. vocab_size-1`` (the special tokens included)."""
        return 257 if self.kind == BYTES_KIND else self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def end_of_text(self) -> int | None:
        """The id of ``<|endoftext|>`` (None if the tokenizer has none)."""
        return 256 if self.kind == BYTES_KIND else self.hf.token_to_id(END_OF_TEXT)

    @cached_property
    def byte_level(self) -> bool:
        """True when every id stands for bytes (decodable piece by piece)."""
        if self.kind == BYTES_KIND:
            return True
        spec = json.loads(self.hf.to_str())
        pre = spec.get("pre_tokenizer") or {}
        kinds = [p.get("type") for p in pre.get("pretokenizers", [pre])]
        return "ByteLevel" in kinds

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """The bytes each id stands for (``[vocab_size]``; special tokens: empty).

        Raises:
            ValueError: not a byte-level tokenizer.
        """
        if self.kind == BYTES_KIND:
            return [bytes([b]) for b in range(256)] + [b""]
        if not self.byte_level:
            raise ValueError(f"{self.source}: not a byte-level tokenizer")
        alphabet = byte_alphabet()
        special = {t.content for t in self.hf.get_added_tokens_decoder().values()
                   if t.special}
        out = [b""] * self.vocab_size
        for token, i in self.hf.get_vocab(with_added_tokens=True).items():
            if token in special:
                continue
            if all(c in alphabet for c in token):
                out[i] = bytes(alphabet[c] for c in token)
            else:  # an added, non-special token: its text
                out[i] = token.encode("utf-8")
        return out

    def byte_lengths(self) -> list[int]:
        """UTF-8 bytes of the text each id stands for (special tokens 0): what
        ``val/bits_per_byte`` divides by. Raises ValueError for a tokenizer not byte-level."""
        return [len(b) for b in self.token_bytes]

    # ---------------------------------------------------------------------------- encoding
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (no special token added); the Hugging Face tokenizer
        encodes a batch on every core (its ``encode_batch``)."""
        if self.kind == BYTES_KIND:
            return [list(t.encode("utf-8")) for t in texts]
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return self.encode_batch([text])[0]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``: exact for a prepared corpus; bytes that form no character (a
        partial character at the end of a sample) are dropped, never U+FFFD; special tokens
        are written as their names. Ids outside the vocabulary are skipped."""
        if self.kind != BYTES_KIND and not self.byte_level:
            return self.hf.decode(list(ids), skip_special_tokens=False)
        table, eot, parts, pending = self.token_bytes, self.end_of_text, [], bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < len(table) and table[i]:
                pending += table[i]
            elif 0 <= i < self.vocab_size:  # a special token
                parts.append(text_of(bytes(pending)))
                pending.clear()
                parts.append(END_OF_TEXT if i == eot else self._special(i))
        parts.append(text_of(bytes(pending)))
        return "".join(parts)

    def _special(self, i: int) -> str:
        return "" if self.hf is None else (self.hf.id_to_token(i) or "")
