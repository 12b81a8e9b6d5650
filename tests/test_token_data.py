"""Issue 29, ``data=tokens``: a flat token stream (a ``.bin`` or ``.npy`` through
``numpy.memmap``, or the built-in corpus) cut into next-token windows under a shift and an order
drawn from (seed, epoch, global window index), so a global batch holds the same windows for any
world size; validation windows fixed in the held-out tail; a 4 GB file served and trained with
little memory; bad token input refused in one line (before any rank, or in the batch that reads
a bad id). The model and what a language-model run reports: test_language_model.py.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch
from helpers import QUIET, refused_before_ranks

from ddp_exp.config.errors import ConfigError
from ddp_exp.config.schema import DataConfig, TokensDataConfig
from ddp_exp.config.view import section
from ddp_exp.data import tokens as tk
from ddp_exp.data.loaders import RankData
from ddp_exp.metrics.progress import EpochResult, epoch_line


def _data_cfg(**extra):
    cfg = {"batch_size": 4, "shuffle": True, "num_workers": 0}
    cfg.update(extra)
    return cfg


def _stream(n: int = 10_000, block: int = 16, vocab: int = 50) -> tk.TokenStream:
    tokens = (np.arange(n) * 7 % vocab).astype(np.uint16)
    return tk.TokenStream(tokens, vocab, block, "test")


def _global_batches(datasets, world_size: int, epoch: int, steps: int, batch: int = 4):
    """The windows' start offsets of the first ``steps`` global batches, each a sorted list."""
    ranks = [RankData(datasets, DataConfig(**_data_cfg(batch_size=batch)), 3, r, world_size,
                      torch.device("cpu")) for r in range(world_size)]
    for rank in ranks:
        rank.train.set_epoch(epoch)
    out = []
    for keys in zip(*(iter(rank.train.keys) for rank in ranks), strict=False):
        if len(out) == steps:
            break
        starts = [int(s) for key in keys for s in datasets.train.starts(key[1], key[2])]
        out.append(sorted(starts))
    return out


def test_windows_are_next_token_pairs_and_splits_are_disjoint():
    """Input ``tokens[i:i+T]``, target ``tokens[i+1:i+T+1]``; validation and test windows lie
    in the tail, after every training target, and never overlap."""
    stream = _stream()
    d = tk.split_stream(stream, val_size=20, test_size=5, seed=0)
    x, y = d.train.batch([0, 3], epoch=2)
    starts = d.train.starts([0, 3], 2)
    assert x.dtype == torch.int64 and x.shape == (2, 16)
    for row, s in enumerate(starts):
        assert torch.equal(x[row], torch.from_numpy(stream.tokens[s:s + 16].astype(np.int64)))
        assert torch.equal(y[row], torch.from_numpy(stream.tokens[s + 1:s + 17].astype(np.int64)))
    last_train_target = max(d.train.starts(range(len(d.train)), e)[-1] for e in range(20)) + 16
    val_starts = d.val.starts(range(len(d.val)))
    test_starts = d.test.starts(range(len(d.test)))
    assert last_train_target < val_starts[0]
    assert np.all(np.diff(val_starts) == 16) and test_starts[0] == val_starts[-1] + 16
    assert test_starts[-1] + 16 < len(stream.tokens)
    assert (len(d.val), len(d.test)) == (20, 5)
    assert len(tk.split_stream(stream, None, 0, 0).val) == (len(stream.tokens) - 1) // 16 // 10


def test_training_windows_shift_per_epoch_and_repeat_with_the_seed():
    """Non-overlapping windows under a shift drawn per epoch from the seed; the same seed
    gives the same windows, another seed or epoch other ones."""
    stream = _stream()
    d = tk.split_stream(stream, 20, 0, seed=0)
    shifts = {d.train.shift(e) for e in range(20)}
    assert len(shifts) > 1 and all(0 <= s < 16 for s in shifts)
    a = _global_batches(d, 2, epoch=1, steps=5)
    assert a == _global_batches(tk.split_stream(stream, 20, 0, seed=0), 2, epoch=1, steps=5)
    assert a != _global_batches(d, 2, epoch=2, steps=5)
    flat = [s for batch in a for s in batch]
    assert len(set(flat)) == len(flat)
    assert len({(s - d.train.shift(1)) % 16 for s in flat}) == 1  # one shift, non-overlapping


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 4097])
def test_window_order_is_a_seeded_permutation_sharded_like_distributed_sampler(n):
    """The epoch's order is a permutation of the windows, another per epoch and seed, and the
    ranks' shards are DistributedSampler's: strided, padded with the order's start."""
    from ddp_exp.data.sampling import shard_order

    order = tk.WindowOrder(n, seed=5, epoch=2)
    perm = order(np.arange(n))
    assert sorted(perm.tolist()) == list(range(n))
    if n > 7:
        assert not np.array_equal(perm, tk.WindowOrder(n, 5, 3)(np.arange(n)))
        assert not np.array_equal(perm, np.arange(n))
    for world in (1, 2, 3):
        shards = []
        for r in range(world):
            s = tk.window_sampler(n, world, r, True, 5)
            s.set_epoch(2)
            got = shard_order(s)
            assert got[0:len(got)].tolist() == list(s)
            shards.append(list(s))
        total = -(-n // world) * world
        padded = np.concatenate([perm] * 4)[:total]
        assert [x for r in range(total) for x in [shards[r % world][r // world]]] \
            == padded.tolist()


def test_global_batches_hold_the_same_windows_for_any_world_size():
    """With the global batch fixed (24 windows), world sizes 1, 2 and 3 train on the same
    windows step by step, and each validation window is evaluated exactly once."""
    d = tk.split_stream(_stream(), 20, 0, seed=0)
    one = _global_batches(d, 1, epoch=3, steps=6, batch=24)
    assert one == _global_batches(d, 2, epoch=3, steps=6, batch=12)
    assert one == _global_batches(d, 3, epoch=3, steps=6, batch=8)
    for world in (1, 2, 3):
        seen = []
        for r in range(world):
            rank = RankData(d, DataConfig(**_data_cfg()), 0, r, world, torch.device("cpu"))
            seen += [int(v) for xb, _ in rank.val_batches(0) for v in xb[:, 0]]
        assert sorted(seen) == sorted(int(v) for v in d.val.batch(range(20))[0][:, 0])


def test_builtin_corpus_and_files(tmp_path):
    """No path: the standard library's text as bytes (vocab 256); a .bin through memmap in its
    dtype; a 1-D .npy."""
    s = tk.load_tokens()
    assert s.vocab_size == 256 and s.byte_level and len(s.tokens) > 100_000
    assert bytes(s.tokens[:4000]).decode("utf-8", "ignore").count(" ") > 300  # English text
    data = np.arange(1000, dtype=np.uint32) % 70_000
    data.tofile(tmp_path / "t.bin")
    got = tk.load_tokens(str(tmp_path / "t.bin"), "uint32", 70_000, 8)
    assert isinstance(got.tokens, np.memmap) and np.array_equal(got.tokens, data)
    np.save(tmp_path / "t.npy", data.astype(np.int64))
    assert np.array_equal(tk.load_tokens(str(tmp_path / "t.npy"), vocab_size=70_000).tokens, data)


@pytest.mark.parametrize("bad, expected", [
    ("short", "shorter than data.block_size + 1 = 129"),
    ("odd", "not a multiple of data.dtype=uint16's 2 bytes"),
    ("heads", "model.n_embd=30 is invalid with model.n_head=4"),
    ("vocab", "needs its vocabulary size"),
    ("limit", "trainer.limit_val_batches=0 is invalid"),
    ("context", "a batch of 128 tokens per sequence, longer than the model's context "
                "block_size=64 (model.block_size)"),
    ("no context", "model.block_size=0 is invalid"),
])
def test_bad_token_input_is_refused_before_ranks(compose, tmp_path, bad, expected):
    """A .bin shorter than one window, a .bin whose size is not a multiple of its dtype,
    n_head not dividing n_embd, a file without its vocabulary, a model context shorter than
    the windows: one line, before any rank."""
    path = tmp_path / "t.bin"
    path.write_bytes(b"\0" * {"short": 2 * 128, "odd": 2001}.get(bad, 4000))
    overrides = ["model=gpt", "data=tokens", f"data.path={path}", "data.vocab_size=10"]
    builtin = ["model=gpt", "data=tokens", "model.n_layer=1", "model.n_embd=16"]
    overrides = {"heads": ["model=gpt", "data=tokens", "model.n_embd=30"],
                 "vocab": overrides[:-1],
                 "limit": [*builtin, "trainer.limit_val_batches=0"],
                 "context": [*builtin, "model.block_size=64"],
                 "no context": [*builtin, "model.block_size=0"]}.get(bad, overrides)
    message = refused_before_ranks(compose(*overrides), tmp_path / "run")
    assert expected in message, message


def test_token_outside_the_vocabulary_is_named_in_its_batch():
    """An id >= vocab_size is found in the batch that reads it, named with its position."""
    tokens = np.zeros(4000, np.uint16)
    tokens[1234] = 99
    d = tk.split_stream(tk.TokenStream(tokens, 50, 16, "f.bin"), 10, 0, 0)
    window = next(p for p in range(len(d.train)) if d.train.starts([p], 0)[0] <= 1234
                  < d.train.starts([p], 0)[0] + 17)
    d.train.batch([0], epoch=0)  # a clean window reads fine
    with pytest.raises(ConfigError, match="token 1234 has id 99, outside the vocabulary 0..49"):
        d.train.batch([window], epoch=0)


def test_token_outside_the_vocabulary_during_training_is_one_line(run_cli, tmp_path):
    """The CLI: a bad id read in epoch 1's batches ends the run with one line naming the file
    and the token's position, exit 1 (ranks had started), no traceback, no process left
    (``run_cli``), the job marked failed."""
    tokens = (np.arange(3000) % 10).astype(np.uint16)
    tokens[1500] = 99  # in the training region: read during epoch 1
    path = tmp_path / "bad.bin"
    tokens.tofile(path)
    run = run_cli("model=gpt", "data=tokens", f"data.path={path}", "data.vocab_size=10",
                  "data.block_size=16", "data.batch_size=4", "model.n_layer=1",
                  "model.n_embd=16", "world_size=2", "trainer.epochs=1", QUIET)
    assert run.returncode == 1, (run.stdout, run.stderr)
    line = (f"ConfigError: data.path={path}: token 1500 has id 99, outside the vocabulary "
            "0..9 (data.vocab_size=10)")
    assert re.fullmatch(rf"error: rank [01] failed: {re.escape(line)}\n", run.stderr), run.stderr
    assert "Traceback" not in run.stdout + run.stderr
    assert json.loads((run.job_dir / "status.json").read_text())["status"] == "failed"


# ------------------------------------------------------------------- a 4 GB token file
def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.fixture
def sparse_4gb(tmp_path):
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.truncate(4 * 2**30)
    return path


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux /proc")
def test_a_sparse_4gb_file_is_served_with_little_memory(sparse_4gb):
    """Opening a 4 GB stream, splitting it and serving 20 batches of a rank keeps its
    resident memory far below the file's size (memmap: only the windows read; the epoch's
    order of 16.7M windows is computed per batch, not stored)."""
    from ddp_exp.data import load

    before = _rss_mb()
    cfg = {"_target_": "ddp_exp.data.tokens.load_tokens", "path": str(sparse_4gb),
           "dtype": "uint16", "vocab_size": 50304, "block_size": 128, "val_size": None,
           "test_size": 0, **_data_cfg(batch_size=8)}
    datasets = load(cfg, 0, 2)
    rank = RankData(datasets, section(TokensDataConfig, cfg), 0, 1, 2, torch.device("cpu"))
    rank.train.set_epoch(0)
    shapes, grown = [], 0.0
    for _, (x, _) in zip(range(20), rank.train, strict=False):  # measured while iterating
        shapes.append(tuple(x.shape))
        grown = max(grown, _rss_mb() - before)
    assert shapes == [(8, 128)] * 20 and len(rank.train) > 900_000  # batches of this rank
    # 16.7M windows: a permutation of them would be 134 MB per rank, Python lists GBs
    assert grown < 60, grown


def test_a_sparse_4gb_file_trains(run_cli, sparse_4gb):
    """A 4 GB .bin trains 20 steps on 2 ranks with validation capped
    (trainer.limit_val_batches), each rank's peak resident memory far below the file."""
    run = run_cli("model=gpt", "data=tokens", f"data.path={sparse_4gb}", "data.vocab_size=512",
                  "data.block_size=64", "data.batch_size=2", "model.n_layer=1",
                  "model.n_head=2", "model.n_embd=16", "world_size=2", "trainer.max_steps=20",
                  "trainer.epochs=1", "trainer.limit_val_batches=2",
                  "trainer.sample_every_n_epochs=0", QUIET, timeout=300).ok()
    m = run.metrics
    # 2 global batches of 2 ranks x 2 windows of 64 tokens
    assert m["global_step"] == 20 and m["val/num_samples"] == 2 * (2 * 2) * 64
    assert m["perf/max_rss_mb"] < 1024, m["perf/max_rss_mb"]  # the file: 4096 MB


# ----------------------------------------------------------------- 6. data=tokens' units
def test_the_epoch_line_names_the_unit_it_counts():
    val = {"val/loss": 1.0, "val/accuracy": None, "val/num_samples": 10}
    tokens = EpochResult(0, 10, 2.0, 2560, 1.0, val, unit="tokens")
    assert epoch_line(tokens, 1).endswith("| 2,560 tokens/s")
    samples = EpochResult(0, 10, 2.0, 640, 1.0, val)
    assert epoch_line(samples, 1).endswith("| 640 samples/s")
    # trainer.val_every_n_steps: the epoch ends after its last validation (a fresh user's
    # find: step 50's line showed step 45's val/loss as its own)
    earlier = EpochResult(0, 50, 2.0, 640, 1.0, val, val_step=45)
    assert epoch_line(earlier, 2).startswith(
        "epoch 1/2 | step 50 | train/epoch_loss 2.0000 | val at step 45 | val/loss 1.0000 |")
    assert "val at step" not in epoch_line(EpochResult(0, 50, 2.0, 640, 1.0, val, val_step=50),
                                           2)


@pytest.mark.slow
def test_token_runs_count_samples_as_samples(run_cli):
    """data=tokens: the epoch line says tokens/s, metrics.json's train/num_samples and
    train/samples_per_sec count the windows trained (20 steps x 32 of the 3277),
    train/num_tokens and train/tokens_per_sec their tokens (16 per window)."""
    run = run_cli("data=tokens", "model=gpt", "model.n_layer=1", "model.n_head=2",
                  "model.n_embd=16", "data.block_size=16", "world_size=2", "trainer.epochs=1",
                  "trainer.max_steps=20", "trainer.limit_val_batches=1", QUIET).ok()
    metrics = run.metrics
    assert metrics["train/num_samples"] == 20 * 32
    assert metrics["train/num_tokens"] == 20 * 32 * 16
    assert abs(metrics["train/tokens_per_sec"] - 16 * metrics["train/samples_per_sec"]) <= (
        1e-9 * metrics["train/tokens_per_sec"])
    output = run.stdout + run.stderr
    epoch = [line for line in output.splitlines() if "| step 20 |" in line]
    assert epoch and epoch[0].rstrip().endswith("tokens/s"), output
    assert "samples/s" not in epoch[0]
