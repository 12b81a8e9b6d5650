"""Issue 28: any batch a model takes (integer token ids, tuple and mapping inputs, tuple and
mapping outputs) and per-token losses that stay exact across world sizes, gradient
accumulation, padding and a training set the world does not divide.

The datasets and models are defined here and reach the ranks as ``test_sequences.<name>``
(``tests_on_path``).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import QUIET, refused_before_ranks, rel_close, scalars, tests_on_path
from omegaconf import open_dict
from torch import nn

VOCAB = 11


def _sequences(n: int, seed: int) -> list[torch.Tensor]:
    """``n`` int64 token sequences of lengths 4..41 (inputs and targets of lengths 3..40)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 41, (1,), generator=g))
        out.append(torch.randint(0, VOCAB, (length + 1,), generator=g))
    return out


class Tokens(torch.utils.data.Dataset):
    """Items ``(tokens [T] int64, next tokens [T] int64)``, T in 3..40; with ``mapping``, Hugging
    Face causal-LM items ``{"input_ids", "attention_mask", "labels"}`` (labels = input_ids: the
    run shifts them with ``data.shift_labels``)."""

    classes = [str(i) for i in range(VOCAB)]

    def __init__(self, n: int, seed: int, mapping: bool = False):
        self.items, self.mapping = _sequences(n, seed), mapping

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        s = self.items[i]
        if self.mapping:
            return {"input_ids": s, "attention_mask": torch.ones_like(s), "labels": s}
        return s[:-1], s[1:]


def train_val(n_train: int = 100, n_val: int = 13, mapping: bool = False):
    """A (train, val) pair of :class:`Tokens` (``data._target_``)."""
    return Tokens(n_train, 0, mapping), Tokens(n_val, 1, mapping)


class TinyLM(nn.Module):
    """Embedding -> tanh -> linear head: logits ``[B, T, C]`` per token. ``shorter`` drops
    the last position (a model whose leading dimensions differ from the targets')."""

    def __init__(self, num_outputs: int, dim: int = 16, shorter: bool = False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.head = nn.Linear(dim, num_outputs)
        self.shorter = shorter

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None):
        assert not tokens.is_floating_point(), tokens.dtype  # ids stay integer
        out = self.head(torch.tanh(self.emb(tokens)))
        return out[:, :-1] if self.shorter else out


class KeywordLM(TinyLM):
    """A Hugging Face-style model: keyword inputs, ``{"logits": [B, T, C]}`` out."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        assert attention_mask.shape == input_ids.shape
        return {"logits": super().forward(input_ids)}


class TupleLM(TinyLM):
    """Returns ``(logits, hidden)``: the first element is the output."""

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None):
        out = super().forward(tokens)
        return out, out.detach()


def _args(*extra: str, model: str = "TinyLM") -> list[str]:
    return ["data=dataset", "data._target_=test_sequences.train_val", f"data.num_classes={VOCAB}",
            f"model._target_=test_sequences.{model}", "trainer.epochs=2",
            "trainer.log_every_n_steps=3", "trainer.progress=off", QUIET, *extra]


def _weights(job_dir) -> dict[str, torch.Tensor]:
    return torch.load(job_dir / "model.pt", weights_only=True)


def _close_weights(a: dict, b: dict, rel: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        scale = a[key].abs().max().item()
        assert (a[key] - b[key]).abs().max().item() <= rel * scale, key


def _metrics(job_dir) -> dict:
    return json.loads((job_dir / "metrics.json").read_text())


@pytest.mark.float_sensitive
def test_token_loss_exact_across_world_size_accumulation_padding_and_uneven_set(run_cli):
    """The same global batch of 12 variable-length sequences (3..40 tokens, padded per batch),
    four ways: world 1 batch 12, world 3 batch 4, world 1 batch 3 x 4 accumulated, world 3
    batch 2 x 2 accumulated; 100 training sequences, which world 3 does not divide
    (DistributedSampler's duplicates count zero). Weights after 2 epochs agree to 1e-5,
    ``train/loss`` points and ``val/loss`` to 1e-6 (the mean of per-micro-batch or per-rank
    token means differs by percents here)."""
    layouts = [(1, 12, 1), (3, 4, 1), (1, 3, 4), (3, 2, 2)]
    runs = [run_cli(*_args(f"world_size={ws}", f"data.batch_size={b}",
                           f"trainer.accumulate_grad_batches={acc}"),
                    job=f"ws{ws}_b{b}_acc{acc}", env=tests_on_path()).ok()
            for ws, b, acc in layouts]
    assert 100 % 3 != 0
    base = runs[0]
    points = scalars(base.job_dir, "train/loss")
    assert len(points) == 6  # 9 steps per epoch, a point every 3
    for run in runs[1:]:
        _close_weights(_weights(base.job_dir), _weights(run.job_dir), 1e-5)
        other = scalars(run.job_dir, "train/loss")
        assert [s for s, _ in other] == [s for s, _ in points]
        for (_, a), (_, b) in zip(points, other, strict=True):
            assert rel_close(a, b, 1e-6), (a, b)
        assert rel_close(_metrics(run.job_dir)["val/loss"], base.metrics["val/loss"], 1e-6)
        assert rel_close(_metrics(run.job_dir)["train/epoch_loss"],
                         base.metrics["train/epoch_loss"], 1e-6)
    # the unit is the counted token: every validation token once
    val_tokens = sum(len(s) - 1 for s in _sequences(13, 1))
    assert base.metrics["val/num_samples"] == val_tokens
    # val/loss is the token mean of model.pt over the validation tokens, computed in one
    # process (13 sequences: uneven shards at world 3, padded batches); world 2: below
    for run in runs[:2]:
        assert rel_close(_metrics(run.job_dir)["val/loss"], _one_process_val_loss(run.job_dir),
                         1e-6)


def _one_process_val_loss(job_dir) -> float:
    """The total token loss of ``model.pt`` over the validation tokens / their count."""
    model = TinyLM(VOCAB)
    model.load_state_dict(_weights(job_dir))
    total, count = 0.0, 0
    with torch.no_grad():
        for s in _sequences(13, 1):
            logits = model(s[:-1][None])[0]
            total += torch.nn.functional.cross_entropy(logits, s[1:], reduction="sum").item()
            count += len(s) - 1
    return total / count


@pytest.mark.float_sensitive
def test_per_sample_training_exact_on_a_set_the_world_does_not_divide(run_cli):
    """Digits, 1499 training samples (not divisible by 3): world 3 batch 4 equals world 1
    batch 12; DistributedSampler's repeated sample counts zero (train/num_samples 1499)."""
    common = ["data.val_size=298", "trainer.epochs=2", "trainer.progress=off", QUIET]
    one = run_cli(*common, "world_size=1", "data.batch_size=12", job="one").ok()
    three = run_cli(*common, "world_size=3", "data.batch_size=4", job="three").ok()
    _close_weights(_weights(one.job_dir), _weights(three.job_dir), 1e-5)
    assert one.metrics["train/num_samples"] == three.metrics["train/num_samples"] == 1499
    assert rel_close(one.metrics["val/loss"], three.metrics["val/loss"], 1e-6)
    assert rel_close(one.metrics["train/epoch_loss"], three.metrics["train/epoch_loss"], 1e-6)


@pytest.mark.float_sensitive
def test_hugging_face_style_mapping_items_and_keyword_model(run_cli):
    """Items ``{"input_ids", "attention_mask", "labels"}`` (labels = input_ids, shifted by the
    run), a model of keyword arguments returning ``{"logits": ...}``: world 2 equals world 1."""
    common = ["data._target_=test_sequences.train_val", "+data.mapping=true",
              "data.target_key=labels", "data.shift_labels=true"]
    one = run_cli(*_args(*common, "world_size=1", "data.batch_size=8", model="KeywordLM"),
                  job="one", env=tests_on_path()).ok()
    two = run_cli(*_args(*common, "world_size=2", "data.batch_size=4", model="KeywordLM"),
                  job="two", env=tests_on_path()).ok()
    _close_weights(_weights(one.job_dir), _weights(two.job_dir), 1e-5)
    assert rel_close(one.metrics["val/loss"], two.metrics["val/loss"], 1e-6)
    assert rel_close(two.metrics["val/loss"], _one_process_val_loss(two.job_dir), 1e-6)
    # shifted: each sequence of L tokens predicts L - 1 of them, as the pair items do
    assert one.metrics["val/num_samples"] == sum(len(s) - 1 for s in _sequences(13, 1))


# ------------------------------------------------------ in this process: the data path
def test_batches_keep_integer_ids_and_pad_with_ignore_index():
    from ddp_exp.data import lazy
    from ddp_exp.data.batches import Call
    from ddp_exp.data.collate import Padding

    split = lazy.TorchSplit(Tokens(3, 0), torch.arange(3).numpy(), lazy.ItemReader(), (5,),
                            VOCAB, elementwise=True, padding=Padding(7, -100, False))
    x, y = split.batch([0, 1, 2])
    lengths = [len(s) - 1 for s in _sequences(3, 0)]
    assert isinstance(x, Call) and x.args[0].dtype == torch.int64
    assert x.args[0].shape == (3, max(lengths)) and y.shape == (3, max(lengths))
    mask = x.kwargs["attention_mask"]
    assert mask.sum(1).tolist() == lengths
    assert (y[mask == 0] == -100).all() and (x.args[0][mask == 0] == 7).all()


def test_tuple_output_is_its_first_element():
    from ddp_exp.train.objective import Objective

    objective = Objective(VOCAB)
    tokens = torch.randint(0, VOCAB, (2, 5))
    objective.check(TupleLM(VOCAB), tokens, torch.randint(0, VOCAB, (2, 5)))


# ------------------------------------------------- bad input: one line, before any rank
def _compose_bad(compose, monkeypatch, *overrides: str, model: dict | None = None):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    cfg = compose("data=dataset", "data._target_=test_sequences.train_val",
                  f"data.num_classes={VOCAB}", *overrides)
    with open_dict(cfg):
        cfg.model = {"_target_": "test_sequences.TinyLM", **(model or {})}
    return cfg


@pytest.mark.parametrize(("overrides", "model", "expected"), [
    ([], {"num_outputs": 5},
     "model: the output has shape [batch, "),
    ([], {"shorter": True}, "model: the output has shape [batch, "),
    (["trainer.class_dim=1"], {}, "trainer.class_dim=1"),
])
def test_bad_per_token_outputs_are_refused_before_ranks(compose, tmp_path, monkeypatch,
                                                        overrides, model, expected):
    """An output whose class dimension is not the number of classes, whose leading dimensions
    differ from the targets', or laid out against ``trainer.class_dim``: one line naming the
    shapes and the shape wanted."""
    cfg = _compose_bad(compose, monkeypatch, *overrides, model=model)
    message = refused_before_ranks(cfg, tmp_path / "run")
    assert message.startswith(expected) or expected in message, message
    assert "must return [batch, " in message


def test_class_dim_other_than_last_or_1_is_refused(compose, tmp_path, monkeypatch):
    cfg = _compose_bad(compose, monkeypatch, "trainer.class_dim=2")
    assert refused_before_ranks(cfg, tmp_path / "run") == (
        "trainer.class_dim='2' is invalid: last (logits [batch, *dims, classes], language "
        "models) or 1 ([batch, classes, *dims], segmentation models)")


def test_mapping_output_without_output_key_is_refused(compose, tmp_path, monkeypatch):
    cfg = _compose_bad(compose, monkeypatch, "data.target_key=labels", "+data.mapping=true",
                       "data.shift_labels=true", "trainer.output_key=scores")
    with open_dict(cfg):
        cfg.model = {"_target_": "test_sequences.KeywordLM"}
    message = refused_before_ranks(cfg, tmp_path / "run")
    assert message.startswith("trainer.output_key='scores' is not a key of the model's output, "
                              "a dict {'logits': tensor [batch, "), message


def test_targets_all_ignored_are_refused(compose, tmp_path, monkeypatch):
    """A first batch whose every label is data.ignore_index: nothing to learn."""
    cfg = _compose_bad(compose, monkeypatch, "data.target_key=labels", "+data.mapping=true",
                       "data.shift_labels=true", "data.input_key=input_ids")
    with open_dict(cfg):
        cfg.data._target_ = "test_sequences.all_ignored"
    message = refused_before_ranks(cfg, tmp_path / "run")
    assert message.startswith("data: every target element of the first training samples is "
                              "data.ignore_index=-100"), message


def all_ignored(mapping: bool = True):
    """Items whose labels are all -100 (``data._target_``)."""
    train, val = train_val(mapping=mapping)
    for part in (train, val):
        part.items = [torch.full_like(s, -100) for s in part.items]
        part.mapping = True
    return _Inputs(train), _Inputs(val)


class _Inputs(torch.utils.data.Dataset):
    """A :class:`Tokens` mapping dataset whose ``input_ids`` are valid ids again."""

    classes = Tokens.classes

    def __init__(self, tokens: Tokens):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        item = self.tokens[i]
        return {**item, "input_ids": torch.zeros_like(item["input_ids"])}


def test_class_dim_1_and_a_per_element_user_loss_give_the_token_sum():
    """``trainer.class_dim=1`` reads logits ``[B, C, T]`` as ``last`` reads ``[B, T, C]``; a
    user's loss returning per-token values (the target's shape) is summed over counted
    tokens only; the count excludes ``ignore_index``."""
    from ddp_exp.train.objective import Objective

    logits = torch.randn(2, 5, VOCAB, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (2, 5))
    target[1, 3:] = -100
    last_sum, count = Objective(VOCAB).element_terms(logits.float(), target)
    first_sum, _ = Objective(VOCAB, class_dim="1").element_terms(
        logits.float().movedim(-1, 1), target)
    user = Objective(VOCAB, loss={"_target_": "torch.nn.functional.cross_entropy",
                                  "reduction": "none"}, class_dim="1")
    user_sum, _ = user.element_terms(logits.float().movedim(-1, 1), target)
    kept = target != -100
    expected = torch.nn.functional.cross_entropy(logits[kept], target[kept], reduction="sum")
    assert int(count) == int(kept.sum()) == 8
    for got in (last_sum, first_sum, user_sum):
        assert rel_close(float(got), float(expected), 1e-6)


class _PartlyIgnored(Tokens):
    """Items 2, 3 and 4 have every label ignored."""

    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        return (x, torch.full_like(y, -100)) if i in (2, 3, 4) else (x, y)


def partly_ignored():
    """8 training sequences whose items 2, 3 and 4 have every label ignored, and 2 validation
    sequences (``data._target_``)."""
    return _PartlyIgnored(8, 0), Tokens(2, 1)


def test_a_step_the_world_counts_no_token_in_is_skipped_and_a_rank_without_tokens_keeps_up(
        run_cli):
    """World 2, one sequence per rank, in order: step 2 has no counted token anywhere (skipped
    with a warning, no weight changes), step 3 has none on rank 0 only (rank 0 still runs its
    backward: no hang); the run ends normally with a finite loss."""
    run = run_cli(*_args("data._target_=test_sequences.partly_ignored", "world_size=2",
                         "data.batch_size=1", "data.shuffle=false", "trainer.epochs=1"),
                  env=tests_on_path(), timeout=120).ok()
    log = (run.job_dir / "ddp_exp.log").read_text()
    assert log.count("step 2: no counted element on any rank") == 1, log  # rank 0's alone
    assert "step 3: no counted" not in log
    train_tokens = sum(len(s) - 1 for i, s in enumerate(_sequences(8, 0)) if i not in (2, 3, 4))
    assert run.metrics["train/num_samples"] == train_tokens
    assert run.metrics["global_step"] == 4 and run.metrics["train/epoch_loss"] > 0


def test_per_token_labels_in_a_file_point_to_data_dataset(tmp_path):
    """A .pt of token ids with a label per token and data.task=classification is refused in one
    line that says where such labels train (the in-memory file path takes one label per
    sample); it used to stop at 'one label 0..C-1 per sample'."""
    from ddp_exp.config.errors import ConfigError
    from ddp_exp.data import load_file

    path = tmp_path / "tokens.pt"
    torch.save({"x": torch.randint(0, 50, (8, 12)), "y": torch.randint(0, 50, (8, 12))}, path)
    with pytest.raises(ConfigError, match=r"per token or pixel train through data=dataset"):
        load_file(str(path), "classification")
