"""Issue 29, ``model=gpt`` and a language-model run: the GPT (shapes, causality, the tied
head, bf16 autocast, one compiled step), the ``experiment=gpt_tokens`` preset learning the
built-in corpus with perplexity, bits per byte, tokens/s, MFU and text samples, a user's token
Dataset through ``data=dataset``, and the exact resume of a killed token run. The token
stream itself (``data=tokens``) and bad token input: test_token_data.py.

CLI runs are few and small (issue 29's budget is 60 s on 2 cores): what the CLI is not the
point of runs in this process. The user code CLI runs need (a token Dataset, a GPT that kills
its rank) reaches the ranks as ``test_language_model.<name>`` (``tests_on_path``).
"""

from __future__ import annotations

import math
import os
import signal

import numpy as np
import pytest
import torch
import yaml
from helpers import QUIET, load_ckpt, rel_close, tensorboard_series, tests_on_path
from torch.nn import functional as F

from ddp_exp.config.errors import ConfigError
from ddp_exp.config.schema import TrainerConfig
from ddp_exp.data import tokens as tk
from ddp_exp.train.gpt import GPT

# A small, fast preset run: 1 layer, 60 steps, capped validation.
SMALL = ("experiment=gpt_tokens", "model.n_layer=1", "trainer.epochs=1", "trainer.max_steps=60",
         "trainer.limit_val_batches=10", "trainer.peak_flops=1e12", QUIET)


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
                                   tk.split_stream(tk.load_tokens(), None, 0, 0),
                                   10 * 16 * 2)  # limit_val_batches=10 global batches of 2 x 16
    assert not (run.job_dir / "confusion_matrix.csv").exists()  # 256 classes: skipped
    assert rel_close(m["val/perplexity"], math.exp(m["val/loss"]), 1e-12)
    assert rel_close(m["val/bits_per_byte"], m["val/loss"] / math.log(2), 1e-12)
    # samples are windows of 128 tokens (test_token_data.py: the units of data=tokens)
    assert rel_close(m["train/tokens_per_sec"], 128 * m["train/samples_per_sec"], 1e-12)
    assert m["train/tokens_per_sec"] > 0
    # the same units in TensorBoard (its train/samples_per_sec counted tokens)
    windows = tensorboard_series(run.job_dir, "train/samples_per_sec")
    tokens = tensorboard_series(run.job_dir, "train/tokens_per_sec")
    assert windows and [s for s, _ in windows] == [s for s, _ in tokens]
    for (_, w), (_, t) in zip(windows, tokens, strict=True):
        assert rel_close(t, 128 * w, 1e-6)
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
    for key in ("val/loss", "train/epoch_loss", "val/perplexity"):
        assert rel_close(got[key], want[key], 1e-6), (key, got[key], want[key])
    a = torch.load(resumed.job_dir / "model.pt", weights_only=True)
    b = torch.load(ref.job_dir / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
