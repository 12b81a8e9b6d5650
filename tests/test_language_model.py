"""Issue 29: a language model on real text out of the box: ``data=tokens`` (memmap token
streams and the built-in corpus), ``model=gpt`` (also on a user's token Dataset through
``data=dataset``), the ``experiment=gpt_tokens`` preset, exact resume of a token run, and bad
token input refused in one line.

CLI runs are few and small (the file's budget is 60 s on 2 cores): what the CLI is not the point
of runs in this process. The user code CLI runs need (a token Dataset, a GPT that kills its
rank) reaches the ranks as ``test_language_model.<name>`` (``tests_on_path``).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal

import numpy as np
import pytest
import torch
import yaml
from helpers import QUIET, load_ckpt, refused_before_ranks, rel_close, tests_on_path
from torch.nn import functional as F

from ddp_exp.config.errors import ConfigError
from ddp_exp.config.schema import DataConfig, TokensDataConfig, TrainerConfig
from ddp_exp.config.view import section
from ddp_exp.data import tokens as tk
from ddp_exp.data.loaders import RankData
from ddp_exp.train.gpt import GPT

# A small, fast preset run: 1 layer, 60 steps, capped validation.
SMALL = ("experiment=gpt_tokens", "model.n_layer=1", "trainer.epochs=1", "trainer.max_steps=60",
         "trainer.limit_val_batches=10", "trainer.peak_flops=1e12", QUIET)


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


def test_gpt_shapes_causality_and_tied_head():
    """Logits ``[B, T, V]``; position t never sees tokens after t; the head is the embedding;
    sequences up to the context train, a longer one is one line naming the context."""
    torch.manual_seed(0)
    model = GPT((16,), 40, n_layer=2, n_head=2, n_embd=32).eval()
    x = torch.randint(0, 40, (3, 16))
    out = model(x)
    assert out.shape == (3, 16, 40) and model.head.weight is model.wte.weight
    x2 = x.clone()
    x2[:, 10:] = (x2[:, 10:] + 1) % 40
    assert torch.allclose(model(x2)[:, :10], out[:, :10], atol=1e-6)
    assert model.flops_per_token() == 6 * model.num_params() + 12 * 2 * 32 * 16
    assert model(x[:, :5]).shape == (3, 5, 40)
    with pytest.raises(ConfigError, match=r"^model=gpt: a batch of 17 tokens per sequence, "
                       r"longer than the model's context block_size=16 \(the data's item "
                       r"length\); set model.block_size to the longest sequence of the data$"):
        model(torch.zeros(1, 17, dtype=torch.int64))
    wider = GPT((16,), 40, n_layer=1, n_head=2, n_embd=32, block_size=24)
    assert wider.block_size == 24 and wider(torch.zeros(1, 24, dtype=torch.int64)).shape[1] == 24


def test_gpt_trains_under_bf16_autocast():
    """bf16 autocast (``trainer.precision=bf16-mixed`` wraps the forward and loss in it; the
    loop's precision handling has its own CLI tests): the GPT's ops run in bf16 on the CPU,
    its per-token loss is the fp32 one to bf16's precision, and every gradient is finite."""
    torch.manual_seed(0)
    model = GPT((16,), 50, n_layer=1, n_head=2, n_embd=32)
    x, y = torch.randint(0, 50, (4, 16)), torch.randint(0, 50, (4, 16))
    full = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    assert logits.dtype == torch.bfloat16
    assert rel_close(loss.item(), full.item(), 2e-2), (loss.item(), full.item())
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_gpt_one_step_compiled(run_cli):
    """The one compile check of the GPT: ``trainer.compile=true`` trains a step (inductor's C++
    code generation costs ~10 s whatever the size, so the model is as small as it gets)."""
    run = run_cli("model=gpt", "data=tokens", "world_size=1", "model.n_layer=1",
                  "model.n_head=1", "model.n_embd=8", "data.block_size=8", "data.batch_size=2",
                  "trainer.max_steps=1", "trainer.epochs=1", "trainer.limit_val_batches=1",
                  "trainer.sample_every_n_epochs=0", "trainer.compile=true", QUIET,
                  timeout=300).ok()
    assert run.metrics["global_step"] == 1 and math.isfinite(run.metrics["val/loss"])


def _byte_unigram_entropy() -> float:
    counts = np.bincount(tk.builtin_corpus(), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _samples(job_dir) -> list[str]:
    """The text of TensorBoard's ``samples`` tag, one per step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list((job_dir / "tensorboard").glob("events.out.tfevents*"))
    acc = EventAccumulator(str(files[0]), size_guidance={"tensors": 0})
    acc.Reload()
    return [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("samples/text_summary")]


def test_sampling_never_moves_the_global_rng(monkeypatch):
    """A sample draws from its own generator: torch's global RNG is where it was, and the same
    epoch gives the same text."""
    from ddp_exp.metrics import lm

    monkeypatch.setattr(lm, "SAMPLE_TOKENS", 12)
    stream = tk.load_tokens(block_size=32)
    d = tk.split_stream(stream, 10, 0, 0)
    torch.manual_seed(0)
    model = GPT((32,), 256, n_layer=1, n_head=2, n_embd=16)
    trainer = TrainerConfig(sample_every_n_epochs=1, sample_prompt="The ")
    report = lm.LanguageModelReport(trainer, 0, d, model, 1, True, writer=None)
    state = torch.get_rng_state()
    a = report.sample(0, 10)
    assert torch.equal(torch.get_rng_state(), state) and model.training
    assert a.startswith("The ") and a == report.sample(0, 10) and a != report.sample(1, 10)


@pytest.mark.float_sensitive
def test_preset_learns_below_the_unigram_entropy(run_cli):
    """``experiment=gpt_tokens`` (1 layer, 60 steps, 2 ranks) predicts the built-in corpus
    better than its byte frequencies do, and reports perplexity, bits per byte, tokens/s, model
    FLOP/s and MFU (by their definitions) and a text sample in TensorBoard; its ``val/loss``
    is the one-process value of its weights on the capped validation windows."""
    run = run_cli(*SMALL).ok()
    m = run.metrics
    assert m["val/loss"] < _byte_unigram_entropy() - 0.3, (m["val/loss"], _byte_unigram_entropy())
    _assert_one_process_validation(run, GPT((128,), 256, n_layer=1, n_head=4, n_embd=128),
                                   tk.split_stream(tk.load_tokens(), None, 0, 0), 10 * 16)
    assert not (run.job_dir / "confusion_matrix.csv").exists()  # 256 classes: skipped
    assert rel_close(m["val/perplexity"], math.exp(m["val/loss"]), 1e-12)
    assert rel_close(m["val/bits_per_byte"], m["val/loss"] / math.log(2), 1e-12)
    # samples are windows of 128 tokens (test_resume_followups.py: the units of data=tokens)
    assert rel_close(m["train/tokens_per_sec"], 128 * m["train/samples_per_sec"], 1e-12)
    assert m["train/tokens_per_sec"] > 0
    flops = m["perf/model_flops_per_sec"] / m["train/tokens_per_sec"]
    assert rel_close(m["perf/mfu"], m["perf/model_flops_per_sec"] / (2 * 1e12), 1e-9)
    model = GPT((128,), 256, n_layer=1, n_head=4, n_embd=128)
    assert rel_close(flops, model.flops_per_token(), 1e-9)
    texts = _samples(run.job_dir)
    assert len(texts) == 1 and texts[0].lstrip().startswith("The "), texts


def _per_token_loss(model: GPT, rows: list[torch.Tensor]) -> tuple[float, int]:
    """The mean next-token cross-entropy over ``rows`` (1-D int64, each predicting its own
    tokens 1..n-1 from the ones before: a causal model's outputs there do not depend on the
    last token), in float64, and the tokens counted."""
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            logits = model(row[None, :-1])[0]
            total += F.cross_entropy(logits.double(), row[1:], reduction="sum").item()
            count += len(row) - 1
    return total / count, count


def _assert_one_process_validation(run, model: GPT, datasets, windows: int) -> None:
    """``run``'s ``val/loss`` (its ranks' shards of the first ``windows`` validation windows,
    reduced) is the one-process value of its trained weights (``model.pt``) computed here
    (1e-6: another summation order), so every window counted once whatever the world size."""
    model.load_state_dict(torch.load(run.job_dir / "model.pt", weights_only=True))
    size = datasets.val.stream.block_size
    rows = [torch.from_numpy(np.asarray(datasets.val.stream.tokens[s:s + size + 1])
                             .astype(np.int64)) for s in datasets.val.starts(range(windows))]
    loss, count = _per_token_loss(model.eval(), rows)
    assert run.metrics["val/num_samples"] == count == windows * size
    assert rel_close(run.metrics["val/loss"], loss, 1e-6), (run.metrics["val/loss"], loss)


# ------------------------------------------------ a user's token Dataset (data=dataset)
class TokenRows(torch.utils.data.Dataset):
    """Rows of token ids as a Hugging Face causal-LM dataset gives them (``with_format("torch")``):
    items ``{"input_ids", "attention_mask", "labels"}``, labels = input_ids (the run shifts
    them with ``data.shift_labels``)."""

    def __init__(self, rows: list[torch.Tensor]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.rows[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _corpus_rows(n: int, seed: int) -> list[torch.Tensor]:
    """``n`` consecutive rows of the built-in corpus's bytes, of lengths 6..40 (the first one
    short: the model's context cannot come from it)."""
    lengths = np.random.default_rng(seed).integers(6, 41, n)
    lengths[0] = 6
    tokens = tk.builtin_corpus()[seed * 20_000:]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return [torch.from_numpy(tokens[s:s + k].astype(np.int64)) for s, k in zip(starts, lengths,
                                                                                strict=True)]


def token_rows(num_train: int = 48, num_val: int = 12) -> tuple[TokenRows, TokenRows]:
    """``data._target_``: a (train, val) pair of :class:`TokenRows` of the built-in corpus."""
    return TokenRows(_corpus_rows(num_train, 0)), TokenRows(_corpus_rows(num_val, 1))


@pytest.mark.float_sensitive
def test_gpt_on_a_token_dataset_with_shifted_labels(run_cli):
    """``model=gpt`` on a user's Dataset of token rows of different lengths (padded per batch),
    ``data.shift_labels``, the context set by ``model.block_size`` (the first row is shorter
    than the others): 2 ranks train, every real next token counts once and padding nowhere, and
    ``val/loss`` is the per-token mean of the trained weights computed here (1e-6)."""
    run = run_cli("model=gpt", "model.n_layer=1", "model.n_embd=16", "model.block_size=40",
                  "data=dataset", "data._target_=test_language_model.token_rows",
                  "data.input_key=input_ids", "data.target_key=labels", "data.shift_labels=true",
                  "data.num_classes=256", "data.batch_size=4", "world_size=2",
                  "trainer.epochs=1", QUIET, env=tests_on_path()).ok()
    m = run.metrics
    model = GPT((6,), 256, n_layer=1, n_embd=16, block_size=40).eval()
    model.load_state_dict(torch.load(run.job_dir / "model.pt", weights_only=True))
    loss, count = _per_token_loss(model, _corpus_rows(12, 1))
    assert m["val/num_samples"] == count
    assert m["train/num_samples"] == sum(len(r) - 1 for r in _corpus_rows(48, 0))
    assert rel_close(m["val/loss"], loss, 1e-6), (m["val/loss"], loss)


# ------------------------------------------------------------ exact resume of a token run
class KilledGPT(GPT):
    """``model=gpt`` whose rank 1 SIGKILLs itself at its training forward number ``kill_at``
    (0: never), once ``after_checkpoint`` holds epoch 0's checkpoint (written in the
    background: the kill lands after it whatever the load). Same modules, same seeded weights
    and ``state_dict`` keys as :class:`GPT`."""

    def __init__(self, input_shape, num_outputs, kill_at: int = 0,
                 after_checkpoint: str | None = None, **gpt):
        super().__init__(input_shape, num_outputs, **gpt)
        self.kill_at, self.after_checkpoint, self.calls = kill_at, after_checkpoint, 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.training and "RANK" in os.environ:  # a rank's step (not the launcher's probe)
            self.calls += 1
            if self.calls == self.kill_at and os.environ["RANK"] == "1":
                from faulty import wait_for_checkpoint

                wait_for_checkpoint(self.after_checkpoint, 0)
                os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(idx)


def _killed_gpt(config_dir, **options) -> list[str]:
    """Write ``<config_dir>/model/killed_gpt.yaml`` (1 layer, dropout 0.1: the resumed run
    needs every rank's RNG) and return the overrides selecting it."""
    node = {"_target_": "test_language_model.KilledGPT", "n_layer": 1, "n_head": 2,
            "n_embd": 16, "dropout": 0.1, **options}
    (config_dir / "model").mkdir(parents=True, exist_ok=True)
    (config_dir / "model" / "killed_gpt.yaml").write_text(yaml.safe_dump(node))
    return ["--config-dir", str(config_dir), "model=killed_gpt"]


@pytest.mark.float_sensitive
def test_token_run_killed_in_epoch_2_resumes_exactly(run_cli, tmp_path):
    """A token run (3 ranks, AdamW, warmup + cosine, clipping, dropout) whose rank 1 is
    SIGKILLed 3 steps into epoch 2, then started again in its folder with
    ``trainer.resume=auto``, ends as the run never interrupted (the epoch's window shift and
    order come from (seed, epoch), the RNG states and the optimizer from the checkpoint): the
    same steps and counts, the losses to 1e-6 and the weights to 1e-6 absolute. Not bit for
    bit with 3 ranks: gloo's ring adds 3 gradients in an order set by an element's place in
    DDP's bucket, and a fresh DDP's first step uses its initial buckets, the uninterrupted
    run's step there its rebuilt ones (2 ranks have one order: identical weights); AdamW turns
    the key bias's noise-sized gradients into whole steps, hence absolute. The uninterrupted
    run's ``val/loss`` is the one-process value (3 uneven shards of 16 validation windows)."""
    path = tmp_path / "tokens.npy"
    np.save(path, tk.builtin_corpus()[:2600].astype(np.int64))
    common = ("data=tokens", f"data.path={path}", "data.vocab_size=256", "data.block_size=16",
              "data.batch_size=4", "optim=adamw", "optim.lr=0.003", "scheduler=cosine",
              "scheduler.warmup_steps=3", "trainer.gradient_clip_val=1.0", "trainer.epochs=2",
              "world_size=3", "launcher.max_restarts=0", QUIET)
    env = tests_on_path()
    ref = run_cli(*_killed_gpt(tmp_path / "c1"), *common, job="ref", env=env).ok()
    datasets = tk.split_stream(tk.load_tokens(str(path), vocab_size=256, block_size=16), None,
                               0, 0)
    assert len(datasets.val) == 16
    _assert_one_process_validation(ref, GPT((16,), 256, n_layer=1, n_head=2, n_embd=16),
                                   datasets, 16)
    steps = ref.metrics["steps_per_epoch"]
    killed = run_cli(*_killed_gpt(tmp_path / "c2", kill_at=steps + 3,
                                  after_checkpoint=str(tmp_path / "job/checkpoints/last.pt")),
                     *common, job="job", env=env)
    assert killed.returncode != 0 and not (killed.job_dir / "metrics.json").exists()
    assert load_ckpt(killed.job_dir / "checkpoints" / "last.pt")["epoch"] == 0
    resumed = run_cli(*_killed_gpt(tmp_path / "c2"), *common, "trainer.resume=auto", job="job",
                      env=env).ok()
    assert "epoch 2/2" in resumed.stdout and "epoch 1/2" not in resumed.stdout, resumed.stdout
    got, want = resumed.metrics, ref.metrics
    for key in ("val/num_samples", "train/num_samples", "global_step", "epoch"):
        assert got[key] == want[key], (key, got[key], want[key])
    for key in ("val/loss", "train/loss", "val/perplexity"):
        assert rel_close(got[key], want[key], 1e-6), (key, got[key], want[key])
    a = torch.load(resumed.job_dir / "model.pt", weights_only=True)
    b = torch.load(ref.job_dir / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


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
    assert m["global_step"] == 20 and m["val/num_samples"] == 2 * 2 * 64
    assert m["perf/max_rss_mb"] < 1024, m["perf/max_rss_mb"]  # the file: 4096 MB
