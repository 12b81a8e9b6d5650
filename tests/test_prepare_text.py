"""Issue 39: ``ddp-exp prepare`` (text to a prepared folder), its tokenizers, a prepared folder
read by ``data=tokens``, and ddp_exp's own sampling loop. In process, no training: the runs
are in test_text_runs.py.

The corpus of these tests has unique documents mixing scripts (Latin with accents, Chinese,
emoji) and line ends (LF and CRLF), so that a round trip, the split and the byte counts are
checked on what breaks tokenizers."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from text_corpus import SENTENCES, write_corpus

from ddp_exp.config.errors import ConfigError
from ddp_exp.data import tokens as tk
from ddp_exp.data.example_text import write_chinese_corpus
from ddp_exp.data.prepare_text import PrepareOptions, dtype_for, prepare
from ddp_exp.data.text_tokenizer import END_OF_TEXT, TextTokenizer
from ddp_exp.metrics.sampling import sample_ids, seeded_generator


def documents_of(folder: Path, split: str, tokenizer: TextTokenizer) -> list[str]:
    """The documents a split's ``.bin`` holds, decoded (each ends with <|endoftext|>)."""
    meta = json.loads((folder / "meta.json").read_text())
    ids = np.fromfile(folder / f"{split}.bin", dtype=meta["dtype"])
    text = tokenizer.decode(ids.tolist())
    assert text.endswith(END_OF_TEXT)
    return text.split(END_OF_TEXT)[:-1]


def run_prepare(sources, out, **kw) -> dict:
    return prepare(PrepareOptions([str(s) for s in sources], str(out), progress=False, **kw))


@pytest.mark.parametrize("tokenizer", ["bpe", "bytes"])
def test_prepare_round_trips_splits_by_document_and_counts(tmp_path, tokenizer):
    """Every document comes back exactly (CRLF, accents, CJK, emoji), in exactly one split;
    meta.json's counts are the files' sizes; the same command again writes the same bytes."""
    texts = write_corpus(tmp_path / "corpus")
    out = tmp_path / "prepared"
    meta = run_prepare([tmp_path / "corpus"], out, tokenizer=tokenizer, vocab_size=2000,
                       val_fraction=0.2, seed=3)
    tok = TextTokenizer.load(str(out))
    assert tok.decode(tok.encode(texts[0])) == texts[0]
    train, val = documents_of(out, "train", tok), documents_of(out, "val", tok)
    assert sorted(train + val) == sorted(texts)  # round trip, every document once
    assert not set(train) & set(val) and len(val) == 12  # round(60 x 0.2) documents
    expected_vocab = 257 if tokenizer == "bytes" else tok.vocab_size
    assert meta["vocab_size"] == expected_vocab <= 2000 and meta["dtype"] == "uint16"
    for split, docs in (("train", train), ("val", val)):
        size = os.path.getsize(out / f"{split}.bin")
        assert meta[split]["tokens"] * 2 == size
        assert meta[split]["documents"] == len(docs)
        assert meta[split]["bytes"] == sum(len(d.encode("utf-8")) for d in docs)
    assert len(meta["sources"]) == 60 and all(len(s["sha256"]) == 64 for s in meta["sources"])
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    run_prepare([tmp_path / "corpus"], out, tokenizer=tokenizer, vocab_size=2000,
                val_fraction=0.2, seed=3)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["corpus", "prepared"]  # no work folder left
    other = tmp_path / "other_seed"
    run_prepare([tmp_path / "corpus"], other, tokenizer=tokenizer, vocab_size=2000,
                val_fraction=0.2, seed=4)
    assert set(documents_of(other, "val", tok)) != set(val)


def test_bpe_trains_on_the_training_documents_only(tmp_path):
    """A word only the validation documents hold is no token of the BPE."""
    folder = tmp_path / "corpus"
    write_corpus(folder, documents=20)
    out = tmp_path / "p"
    run_prepare([folder], out, vocab_size=600, val_fraction=0.25, seed=0)
    val_docs = documents_of(out, "val", TextTokenizer.load(str(out)))
    # add a rare word to the validation documents, prepare again: never merged
    for path in sorted(folder.iterdir()):
        text = path.read_bytes().decode("utf-8")
        if text in val_docs:
            path.write_bytes((text + "zyzzyvazyzzyva " * 50).encode("utf-8"))
    run_prepare([folder], out, vocab_size=600, val_fraction=0.25, seed=0)
    tok = TextTokenizer.load(str(out))
    assert len(tok.encode("zyzzyva")) >= 4  # never merged: training never saw it


def test_vocabulary_past_uint16_is_stored_as_uint32(tmp_path):
    """F07: ids above 65,535 are stored as uint32, never wrapped."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab.update({f"unused{i}": 256 + i for i in range(70_000)})
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([END_OF_TEXT])
    hf.save(str(tmp_path / "big.json"))
    texts = write_corpus(tmp_path / "corpus", documents=4)
    out = tmp_path / "p"
    meta = run_prepare([tmp_path / "corpus"], out, tokenizer=str(tmp_path / "big.json"),
                       val_fraction=0.25)
    assert meta["dtype"] == "uint32" and meta["end_of_text"] == 256 + 70_000 > 65_535
    ids = np.fromfile(out / "train.bin", dtype=np.uint32)
    assert ids.max() == 70_256 and meta["train"]["tokens"] * 4 == ids.nbytes
    tok = TextTokenizer.load(str(out))
    assert sorted(documents_of(out, "train", tok) + documents_of(out, "val", tok)) == \
        sorted(texts)
    assert dtype_for(65_536) == "uint16" and dtype_for(65_537) == "uint32"


def test_rows_of_json_lines_and_csv_are_documents(tmp_path):
    rows = [{"text": f"row {i}: " + SENTENCES[i % len(SENTENCES)], "n": i} for i in range(10)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False)
                                                for r in rows) + "\n", encoding="utf-8")
    import csv

    with open(tmp_path / "b.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, ["n", "body"])
        w.writeheader()
        w.writerows({"n": r["n"], "body": r["text"].upper()} for r in rows)
    out = tmp_path / "p"
    run_prepare([tmp_path / "a.jsonl"], out, tokenizer="bytes", val_fraction=0.2)
    tok = TextTokenizer.load(str(out))
    docs = documents_of(out, "train", tok) + documents_of(out, "val", tok)
    assert sorted(docs) == sorted(r["text"] for r in rows)
    with pytest.raises(ConfigError, match=r"b\.csv: no column 'text' \(--text-key"):
        run_prepare([tmp_path / "b.csv"], tmp_path / "q", tokenizer="bytes")
    meta = run_prepare([tmp_path / "b.csv"], tmp_path / "q", tokenizer="bytes", text_key="body")
    assert meta["documents"] == 10


def test_bad_sources_and_options_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(ConfigError, match=r"a\.txt: no text \(empty sources\)"):
        run_prepare([tmp_path / "empty"], tmp_path / "o", tokenizer="bytes")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "x.txt").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match=r"x\.txt: a binary file"):
        run_prepare([tmp_path / "bin"], tmp_path / "o", tokenizer="bytes")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.txt: not UTF-8 text \(near byte 3"):
        run_prepare([tmp_path / "latin1.txt"], tmp_path / "o", tokenizer="bytes")
    with pytest.raises(ConfigError, match=r"^--vocab-size=300 is invalid: a byte-level BPE"):
        run_prepare([tmp_path / "latin1.txt"], tmp_path / "o", vocab_size=300)
    with pytest.raises(ConfigError, match=r"^1 document cannot be split"):
        run_prepare([tmp_path / "empty"] + [Path(write_corpus(tmp_path / "one", 1) and
                                                 tmp_path / "one")], tmp_path / "o",
                    tokenizer="bytes")
    with pytest.raises(ConfigError, match=r"nope: no such file or folder"):
        run_prepare([tmp_path / "nope"], tmp_path / "o", tokenizer="bytes")
    assert not (tmp_path / "o").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".o.")]  # no work folder


def test_a_long_document_drawn_for_validation_is_a_warning_and_counts_are_singular(
        tmp_path, capsys):
    """Four documents of 100 bytes and one of 1000, --val-fraction 0.2 (one document): where
    the long one is drawn, validation holds 1001 of 1405 byte tokens (the bytes + one
    <|endoftext|> each: 71%, over twice 20%): one warning line says both shares and the fix,
    and the summary says "1 document"; where a short one is, 101 of 1405 (7%, under half of
    20%) warns too. Five equal documents (20% exactly): no warning."""
    from ddp_exp.cli.prepare import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(5):
        (corpus / f"d{i}.txt").write_text(("x" * 999 if i == 2 else "y" * 99) + "\n")
    seen = {}
    for seed in range(12):
        out = tmp_path / f"s{seed}"
        assert main([str(corpus), "--out", str(out), "--tokenizer", "bytes", "--no-progress",
                     "--val-fraction", "0.2", "--seed", str(seed)]) == 0
        val_tokens = os.path.getsize(out / "val.bin") // 2  # uint16 ids
        seen[val_tokens] = (seed, capsys.readouterr())
        if len(seen) == 2:
            break
    assert sorted(seen) == [101, 1001]
    long_seed, long_out = seen[1001]
    assert long_out.out.splitlines() == [
        f"{tmp_path}/s{long_seed}: vocabulary 257 (uint16), train 404 tokens / 4 documents, "
        "val 1,001 tokens / 1 document; train with python -m ddp_exp experiment=gpt_tokens "
        f"data.path={tmp_path}/s{long_seed}"]
    assert long_out.err.splitlines() == [
        "warning: validation holds 71% of the tokens, --val-fraction=0.2 asked for 20% (1 "
        "document of 5: the split never cuts a document): cut the text into more documents "
        "(--documents paragraph, or several files) or draw other ones (--seed)"]
    assert seen[101][1].err.startswith("warning: validation holds 7% of the tokens")
    for i in range(5):
        (corpus / f"d{i}.txt").write_text("y" * 99 + "\n")
    assert main([str(corpus), "--out", str(tmp_path / "even"), "--tokenizer", "bytes",
                 "--no-progress", "--val-fraction", "0.2"]) == 0
    assert capsys.readouterr().err == ""  # 101 of 505 tokens: 20%


def test_bpe_without_the_text_extra_names_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    write_corpus(tmp_path / "c", 3)
    with pytest.raises(ConfigError, match=r"^--tokenizer bpe needs the Hugging Face tokenizers "
                                          r"library: pip install 'ddp_exp\[text\]'$"):
        run_prepare([tmp_path / "c"], tmp_path / "o", vocab_size=1000)


def test_a_prepared_folder_is_read_by_data_tokens(tmp_path):
    """Vocabulary, dtype and the validation split from the folder; a conflicting
    data.vocab_size and a folder without meta.json are one line each."""
    write_corpus(tmp_path / "c", 20)
    out = tmp_path / "p"
    meta = run_prepare([tmp_path / "c"], out, tokenizer="bytes", val_fraction=0.25)
    stream = tk.load_tokens(str(out), block_size=16)
    assert stream.vocab_size == 257 and len(stream.tokens) == meta["train"]["tokens"]
    splits = tk.split_stream(stream, None, 2, seed=0)
    val_windows = (meta["val"]["tokens"] - 1) // 16
    assert len(splits.val) == val_windows - 2 and len(splits.test) == 2
    x, y = splits.val.batch([0, 1])
    val_ids = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert x[1].tolist() == val_ids[16:32].tolist() and y[1].tolist() == val_ids[17:33].tolist()
    assert tk.load_tokens(str(out), vocab_size=257, block_size=16).vocab_size == 257
    with pytest.raises(ConfigError, match=r"^data.vocab_size=50304 conflicts with .*meta\.json"
                                          r"'s vocab_size 257: leave data.vocab_size unset"):
        tk.load_tokens(str(out), vocab_size=50304)
    with pytest.raises(ConfigError, match=r"is a folder without meta.json: give a folder that "
                                          r"ddp-exp prepare wrote"):
        tk.load_tokens(str(tmp_path / "c"))


def test_bits_per_byte_counts_the_bytes_of_the_evaluated_tokens(tmp_path):
    """val/bits_per_byte = nats per token x tokens / bytes / ln 2, the bytes those of the
    tokens' text (computed here from the decoded text, not the code's table)."""
    from ddp_exp.metrics import lm

    write_corpus(tmp_path / "c", 12)
    out = tmp_path / "p"
    run_prepare([tmp_path / "c"], out, vocab_size=800, val_fraction=0.25)
    splits = tk.split_stream(tk.load_tokens(str(out), block_size=8), None, 0, seed=0)
    table = lm.token_byte_lengths(splits.val)
    tok = TextTokenizer.load(str(out))
    _, y = splits.val.batch(list(range(len(splits.val))))
    text = tok.decode(y.flatten().tolist()).replace(END_OF_TEXT, "")
    assert float(table[y].sum()) == len(text.encode("utf-8"))
    got = lm.val_scalars(2.0, splits.val, y.numel(), float(table[y].sum()))
    assert got["val/bits_per_byte"] == pytest.approx(
        2.0 * y.numel() / len(text.encode("utf-8")) / math.log(2), rel=1e-12)


def test_partial_utf8_at_a_sample_end_decodes_without_replacement():
    tok = TextTokenizer.bytes()
    data = list("数据并行".encode())
    assert tok.decode(data[:-1]) == "数据并"  # the cut character is held back, not U+FFFD
    assert tok.decode([0xFF, 0xFE] + data) == "数据并行"  # ill-formed bytes are dropped
    assert tok.decode(data + [256] + data[:4]) == f"数据并行{END_OF_TEXT}数"


class MappingLM(torch.nn.Module):
    """A causal LM of the test's own: returns ``{"logits": [B, T, V]}``, context 6, and a
    ``generate`` that raises (ddp_exp's sampling must not call it)."""

    block_size = 6

    def __init__(self, vocab: int = 11):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, vocab)
        self.seen: list[int] = []

    def forward(self, idx):
        self.seen.append(idx.shape[1])
        return {"logits": self.emb(idx) * 3.0}

    def generate(self, *args, **kwargs):
        raise AttributeError("'int' object has no attribute 'max_length'")


def test_sampling_is_our_loop_seeded_cropped_and_top_k():
    torch.manual_seed(0)
    model = MappingLM()
    a = sample_ids(model, [1, 2], 12, 1.0, generator=seeded_generator(5), context=6)
    b = sample_ids(model, [1, 2], 12, 1.0, generator=seeded_generator(5), context=6)
    assert a == b and len(a) == 12 and max(model.seen) == 6  # the context cropped
    greedy = sample_ids(model, [3], 5, 0.0, context=6)
    probs = torch.softmax(model.emb.weight * 3.0, dim=-1)
    expected, last = [], 3
    for _ in range(5):  # greedy by hand: the most likely next token of the last one
        last = int(probs[last].argmax())
        expected.append(last)
    assert greedy == expected
    assert sample_ids(model, [3], 5, 1.0, top_k=1, generator=seeded_generator(0),
                      context=6) == expected
    assert model.training  # the mode is restored


def test_a_sample_that_cannot_be_made_is_a_warning(caplog):
    """A model whose forward fails at sampling: one warning, no exception."""
    from types import SimpleNamespace

    from ddp_exp.config.schema import TrainerConfig
    from ddp_exp.metrics.lm import LanguageModelReport

    class Broken(MappingLM):
        def forward(self, idx):
            if not self.training:
                raise RuntimeError("no eval forward here")
            return super().forward(idx)

    stream = tk.load_tokens(None, block_size=8)
    splits = tk.split_stream(stream, None, 0, seed=0)
    report = LanguageModelReport(TrainerConfig(), 0, splits, Broken(257), 1, True,
                                 SimpleNamespace(writer=None))
    with caplog.at_level("WARNING"):
        assert report.sample(0, 10) is None
    assert ["no text sample after epoch 1: RuntimeError: no eval forward here"] == [
        r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_a_sample_at_a_validation_step_names_the_step(caplog):
    """trainer.val_every_n_steps: the sample of a validation at step 37 (mid epoch 1) says
    "at step 37", not "after epoch 1"; the per-epoch sample still says the epoch."""
    from types import SimpleNamespace

    from ddp_exp.config.schema import TrainerConfig
    from ddp_exp.metrics.lm import LanguageModelReport

    stream = tk.load_tokens(None, block_size=8)
    splits = tk.split_stream(stream, None, 0, seed=0)
    report = LanguageModelReport(TrainerConfig(), 0, splits, MappingLM(257), 1, True,
                                 SimpleNamespace(writer=None))
    with caplog.at_level("INFO", logger="ddp_exp"):
        assert report.sample(0, 37, validation=2) is not None
        assert report.sample(0, 50) is not None
    heads = [r.getMessage().splitlines()[0] for r in caplog.records]
    assert heads == ["sample at step 37 of epoch 1 (trainer.sample_prompt='The ', 120 tokens):",
                     "sample after epoch 1 (trainer.sample_prompt='The ', 120 tokens):"]


def test_the_chinese_example_corpus_prepares_and_round_trips(tmp_path):
    paths = write_chinese_corpus(str(tmp_path / "zh"), documents=30, seed=1)
    again = write_chinese_corpus(str(tmp_path / "zh2"), documents=30, seed=1)
    assert [Path(p).read_bytes() for p in paths] == [Path(p).read_bytes() for p in again]
    out = tmp_path / "p"
    run_prepare([tmp_path / "zh"], out, vocab_size=1000, val_fraction=0.2)
    tok = TextTokenizer.load(str(out))
    docs = documents_of(out, "train", tok) + documents_of(out, "val", tok)
    texts = [Path(p).read_bytes().decode("utf-8") for p in paths]
    assert sorted(docs) == sorted(texts)
    assert any("\r\n" in t for t in texts) and all("\ufffd" not in d for d in docs)


def test_long_documents_stream_in_pieces_with_the_ids_of_the_whole(tmp_path, monkeypatch):
    """A document longer than a piece is read in blocks and encoded in pieces cut after a
    newline: the same ids as the whole text encoded at once (the BPE's pre-tokenizer splits
    there too), and a multi-byte character cut by a block boundary decodes whole."""
    from ddp_exp.data import text_sources

    write_corpus(tmp_path / "c", 6)
    whole = tmp_path / "whole"
    run_prepare([tmp_path / "c"], whole, vocab_size=700, val_fraction=0.0)
    monkeypatch.setattr(text_sources, "PIECE_CHARS", 50)
    monkeypatch.setattr(text_sources, "READ_BYTES", 7)  # cuts inside UTF-8 sequences
    pieces = tmp_path / "pieces"
    run_prepare([tmp_path / "c"], pieces, tokenizer=str(whole / "tokenizer.json"),
                val_fraction=0.0)
    assert (pieces / "train.bin").read_bytes() == (whole / "train.bin").read_bytes()


def test_parquet_rows_and_a_datasets_dataset_are_documents(tmp_path, monkeypatch):
    """Parquet (pyarrow, read in batches) and ``--dataset`` (Hugging Face datasets, here a
    local JSON lines file: no network) give the same documents as the rows."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = [f"row {i}: " + SENTENCES[i % len(SENTENCES)] for i in range(12)]
    pq.write_table(pa.table({"body": texts, "n": list(range(12))}), tmp_path / "t.parquet")
    meta = run_prepare([tmp_path / "t.parquet"], tmp_path / "p", tokenizer="bytes",
                       text_key="body", val_fraction=0.25)
    tok = TextTokenizer.bytes()
    docs = documents_of(tmp_path / "p", "train", tok) + documents_of(tmp_path / "p", "val", tok)
    assert sorted(docs) == sorted(texts) and meta["sources"][0]["kind"] == "parquet"
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    (tmp_path / "ds").mkdir()
    lines = [json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts]
    (tmp_path / "ds" / "d.jsonl").write_text("".join(lines), encoding="utf-8")
    meta = prepare(PrepareOptions([], str(tmp_path / "q"), tokenizer="bytes", progress=False,
                                  dataset=str(tmp_path / "ds"), split="train",
                                  val_fraction=0.25))
    docs = documents_of(tmp_path / "q", "train", tok) + documents_of(tmp_path / "q", "val", tok)
    assert sorted(docs) == sorted(texts) and meta["sources"][0]["kind"] == "dataset"


def test_a_ctrl_c_that_python_dropped_still_stops_prepare(tmp_path, monkeypatch):
    """A SIGINT whose KeyboardInterrupt is swallowed (raised inside a ``__del__``: tqdm's bar,
    collected while the tokenizer trained) still ends ``prepare`` before anything lands: no
    output folder, no temporary one (a Ctrl-C 2-3 s into a 52 MB corpus wrote the folder and
    exited 0)."""
    import signal

    from ddp_exp.data import prepare_text

    write_corpus(tmp_path / "corpus", documents=12)
    real = prepare_text._tokenizer

    def tokenizer_then_a_lost_ctrl_c(*args, **kwargs):
        # the SIGINT handler prepare installed, called as Python calls it (no real signal: in
        # an xdist worker one would reach the worker's own loop), its KeyboardInterrupt dropped
        handler = signal.getsignal(signal.SIGINT)
        assert callable(handler) and handler is not signal.default_int_handler
        try:
            handler(signal.SIGINT, None)
        except KeyboardInterrupt:
            pass  # dropped, as in a __del__
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare_text, "_tokenizer", tokenizer_then_a_lost_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        run_prepare([tmp_path / "corpus"], tmp_path / "out", tokenizer="bytes")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def prepare_cli(*argv: str) -> int:
    """``ddp-exp prepare ARGV`` as the console script runs it: the entry's one line, exit 2."""
    from ddp_exp.cli.commands import dispatch

    return dispatch(["prepare", *argv, "--tokenizer", "bytes", "--no-progress"])


def hidden_leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("where", ["under a file", "deeper under a file", "/proc", "full disk"])
def test_an_out_that_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path, monkeypatch,
                                                                      capsys, where):
    """--out under a file, in /proc, or on a disk that fills while the tokens are written: one
    ``error: --out=...`` line naming the cause, exit 2, no traceback, no work folder and no
    folder made above --out left (tracebacks: FileExistsError, FileNotFoundError '/proc/.pout.x',
    OSError '2801 requested and 1295 written')."""
    import builtins
    import errno
    import re

    from ddp_exp.data import prepare_text

    write_corpus(tmp_path / "corpus", documents=6)
    (tmp_path / "doc.txt").write_text("a file\n")
    if where == "/proc" and not os.path.isdir("/proc/self"):
        pytest.skip("Linux /proc")
    out = {"under a file": tmp_path / "doc.txt" / "sub",
           "deeper under a file": tmp_path / "doc.txt" / "a" / "b",
           "/proc": Path("/proc/ddp_exp_pout"),
           "full disk": tmp_path / "new" / "deeper" / "out"}[where]
    written = []

    class FullDisk:
        """A file whose disk fills after 1,000 bytes: writes up to there, then ENOSPC."""

        def __init__(self, f):
            self.f = f

        def write(self, data):
            room = 1000 - sum(written)
            if len(data) > room:
                self.f.write(bytes(data)[:room])
                written.append(room)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written.append(len(data))
            return self.f.write(data)

        def close(self):
            self.f.close()

    if where == "full disk":
        monkeypatch.setattr(prepare_text, "open", lambda *a, **k: FullDisk(builtins.open(*a, **k)),
                            raising=False)
    assert prepare_cli(str(tmp_path / "corpus"), "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    expected = {
        "under a file": rf"lies under {re.escape(str(tmp_path / 'doc.txt'))}, a file, not a "
                        "folder: give --out a path in a folder",
        "deeper under a file": rf"lies under {re.escape(str(tmp_path / 'doc.txt'))}, a file",
        "/proc": r"cannot be created \(No such file or directory in /proc\): give --out a folder "
                 "that can be created and written",
        "full disk": r": the disk that holds it is full \(No space left on device; 1,000 bytes "
                     r"written before it filled, [\d,.]+ (bytes|MB) free there now\): free space "
                     "there, or give --out a folder on another disk"}[where]
    assert re.match(rf"error: --out={re.escape(str(out))}\b.*{expected}", err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "doc.txt"]
    if where == "/proc":
        assert not [n for n in os.listdir("/proc") if n.startswith(".ddp_exp_pout.")]


def test_a_later_prepare_removes_the_leftovers_of_killed_ones_only(tmp_path):
    """A prepare killed with SIGKILL leaves its work folder; the next prepare into the same
    --out removes it (its lock is free: its process is gone), and the work folder of an older
    ddp_exp (no lock), but keeps one whose lock a running prepare holds."""
    import fcntl
    import signal
    import subprocess
    import time

    write_corpus(tmp_path / "corpus", documents=6)
    marker = tmp_path / "writing"
    script = ("import sys, time\n"
              "from ddp_exp.data import prepare_text as p\n"
              "def encode(*a, **k):\n"
              "    open(sys.argv[3], 'w').close()\n"
              "    time.sleep(600)\n"
              "p._encode = encode\n"
              "p.prepare(p.PrepareOptions([sys.argv[1]], sys.argv[2], 'bytes', progress=False))\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "corpus"),
                             str(tmp_path / "out"), str(marker)])
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the prepare to kill never reached its writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed = hidden_leftovers(tmp_path)
    assert len(killed) == 2 and killed[0].startswith(".out.") and killed[1] == killed[0] + ".lock"
    (tmp_path / ".out.abc_1234").mkdir()  # an older ddp_exp's work folder: no lock
    (tmp_path / ".out.abc_1234" / "train.bin").write_bytes(b"\0" * 10)
    (tmp_path / ".out.live0000").mkdir()  # a prepare writing now: its lock is held
    with open(tmp_path / ".out.live0000.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        run_prepare([tmp_path / "corpus"], tmp_path / "out", tokenizer="bytes", val_fraction=0.2)
        assert hidden_leftovers(tmp_path) == [".out.live0000", ".out.live0000.lock"]
    assert (tmp_path / "out" / "meta.json").is_file()
    run_prepare([tmp_path / "corpus"], tmp_path / "out", tokenizer="bytes", val_fraction=0.2)
    assert hidden_leftovers(tmp_path) == []  # its prepare is gone (the lock released)


def test_a_source_that_is_no_file_or_folder_is_named_so(tmp_path):
    """/dev/null, a FIFO (whose read would wait forever) and a link to nothing exist, or seem
    to: each is named for what it is, not "no such file or folder"."""
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "nowhere", tmp_path / "link")
    cases = [(tmp_path / "fifo", r"fifo: exists but is a named pipe \(FIFO\), not a regular file "
                                 "or folder: give text files"),
             (tmp_path / "link", r"link: a symbolic link to .*nowhere, which does not exist: "
                                 "give text files")]
    if os.path.exists("/dev/null"):
        cases.append((Path("/dev/null"), r"^/dev/null: exists but is a character device, not a "
                                         "regular file or folder: give text files, a folder of "
                                         "them, JSON lines / CSV / Parquet files$"))
    for source, expected in cases:
        with pytest.raises(ConfigError, match=expected):
            run_prepare([source], tmp_path / "o", tokenizer="bytes")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link"]
    # The same inside a folder of text: its walk read the FIFO (and waited for ever).
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("some text\n")
    os.mkfifo(folder / "pipe")
    with pytest.raises(ConfigError, match=r"texts/pipe: not a regular file \(a FIFO, socket or "
                                          r"device\): remove it from the folder"):
        run_prepare([folder], tmp_path / "o", tokenizer="bytes")
    (folder / "pipe").unlink()
    os.symlink(tmp_path / "nowhere", folder / "gone.txt")
    with pytest.raises(ConfigError, match=r"texts/gone.txt: cannot be read \(No such file"):
        run_prepare([folder], tmp_path / "o", tokenizer="bytes")


@pytest.mark.parametrize("name", ["plain_dir-1.x", "prep dir", "dür", "it's", "1e3", "a,b",
                                  "sub/x y"])
def test_the_printed_override_works_pasted_into_a_shell(tmp_path, monkeypatch, capsys, name):
    """The summary's ``data.path=`` word, split as a POSIX shell splits it, is read back by
    Hydra's override parser as the path itself: a space, ``ü`` (outside Hydra's unquoted
    characters), a quote, a number (``1e3`` would be the float 1000.0), a comma (a sweep); a
    plain path is printed as it is."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    monkeypatch.chdir(tmp_path)  # --out as typed: relative
    write_corpus(tmp_path / "corpus", documents=6)
    out = name
    assert prepare_cli("corpus", "--out", out, "--val-fraction", "0.2") == 0
    line = capsys.readouterr().out.strip()
    words = shlex.split(line.split("; train with ", 1)[1])
    assert words[:4] == ["python", "-m", "ddp_exp", "experiment=gpt_tokens"] and len(words) == 5
    parsed = OverridesParser.create().parse_overrides([words[4]])[0]
    assert parsed.key_or_group == "data.path" and parsed.value() == out
    if name == "plain_dir-1.x":
        assert line.endswith(f" data.path={out}")


def test_a_prepared_folder_without_its_tokenizer_trains_with_one_warning(tmp_path, caplog,
                                                                         monkeypatch):
    """A BPE folder whose tokenizer.json was deleted still reads (tokens need no tokenizer),
    with one warning naming the file, what is lost and the fix; a bytes folder loses nothing
    (its ids are bytes): no warning; torchrun's other ranks stay silent."""
    import logging

    from ddp_exp.metrics import lm

    write_corpus(tmp_path / "c", 12)
    out = tmp_path / "p"
    meta = run_prepare([tmp_path / "c"], out, vocab_size=600, val_fraction=0.25,
                       command=["ddp-exp", "prepare", "my c", "--out", "p"])
    (out / "tokenizer.json").unlink()
    monkeypatch.delenv("RANK", raising=False)
    with caplog.at_level(logging.WARNING):
        stream = tk.load_tokens(str(out), block_size=8)
    assert len(stream.tokens) == meta["train"]["tokens"] and stream.tokenizer is None
    assert [r.getMessage() for r in caplog.records] == [
        f"{out / 'tokenizer.json'} is missing: no val/bits_per_byte and no text samples (token "
        "ids instead); run ddp-exp prepare again to write it (meta.json's command: ddp-exp "
        "prepare 'my c' --out p)"]
    splits = tk.split_stream(stream, None, 0, seed=0)
    assert lm.token_byte_lengths(splits.val) is None  # indeed no bits per byte
    caplog.clear()
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.WARNING):
        tk.load_tokens(str(out), block_size=8)
    assert caplog.records == []
    monkeypatch.delenv("RANK")
    run_prepare([tmp_path / "c"], tmp_path / "b", tokenizer="bytes", val_fraction=0.25)
    (tmp_path / "b" / "tokenizer.json").unlink()
    with caplog.at_level(logging.WARNING):
        assert tk.load_tokens(str(tmp_path / "b"), block_size=8).byte_level
    assert caplog.records == []


@pytest.mark.parametrize("name, text, vocab", [
    ("notes.txt", "Some notes, é and 数据.\n" * 613, None),  # odd size, no vocabulary
    ("notes.md", "# Title\n\nEven sized text.\n" * 300, 50304),  # fits uint16 and a vocab
    ("corpus.bin", "plain English text, named as tokens\n" * 100, 50304),
], ids=["txt", "md", "bin"])
def test_a_text_file_given_as_tokens_names_prepare(tmp_path, name, text, vocab):
    """data.path=<text file>: one line saying it is text and the commands that make tokens of
    it (not a dtype multiple, a missing vocabulary, or training on the text's bytes as ids)."""
    import re
    import shlex

    path = tmp_path / "my texts" / name
    path.parent.mkdir()
    path.write_text(text, encoding="utf-8")
    folder = tmp_path / "my texts" / f"{name.split('.')[0]}_prepared"
    expected = (f"data.path={path} is a text file (UTF-8), not tokens: prepare it first, "
                f"ddp-exp prepare {shlex.quote(str(path))} --out {shlex.quote(str(folder))}, "
                f"then train with 'data.path=\"{folder}\"'")
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
        tk.load_tokens(str(path), vocab_size=vocab, block_size=8)
    ids = np.arange(1000, dtype=np.uint16) * 37  # real tokens are not text
    ids.tofile(tmp_path / "t.bin")
    assert len(tk.load_tokens(str(tmp_path / "t.bin"), vocab_size=50304).tokens) == 1000
