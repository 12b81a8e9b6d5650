"""What a language-model run reports (``data=tokens``): perplexity, bits per byte, tokens per
second, model FLOP/s and MFU, and text samples in TensorBoard.

* ``val/perplexity = exp(val/loss)`` (the per-token mean cross-entropy, nats);
  ``val/bits_per_byte = val/loss x tokens / bytes / ln 2``: the validation tokens' nats over
  the UTF-8 bytes of their text (world sums), for any byte-level tokenizer.
* ``train/tokens_per_sec``: the counted tokens the world trained per second; in TensorBoard
  and ``metrics.json`` alike ``train/samples_per_sec`` (and ``metrics.json``'s
  ``train/num_samples``) count windows, ``train/num_tokens`` their tokens; the epoch line
  says tokens/s.
* ``perf/model_flops_per_sec = train/tokens_per_sec x flops_per_token``, where the model's
  training FLOPs per token are ``6 N + 12 L d T`` (PaLM, appendix B: N parameters without the
  position embedding, L layers, width d, context T; :meth:`ddp_exp.train.gpt.GPT.flops_per_token`);
  with ``trainer.peak_flops`` (FLOP/s of one device) ``perf/mfu`` = that over
  ``peak_flops x world_size`` (without it, one log line says why there is none). Every rate
  leaves warm-up out (the first step, compiling steps: :mod:`ddp_exp.metrics.warmup`).
* Every ``trainer.sample_every_n_epochs`` epochs rank 0 continues ``trainer.sample_prompt``
  and writes the text to the log and TensorBoard's text tab (tag ``samples``), drawing from a
  generator of its own seeded from ``(seed, epoch)``: no rank's global RNG moves, so resuming
  stays exact; the text is decoded with the run's tokenizer (:mod:`ddp_exp.metrics.sampling`).

May use: torch, :mod:`ddp_exp.data` (token splits, the tokenizer), :mod:`ddp_exp.config`.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ddp_exp.config.errors import ConfigError, described
from ddp_exp.data.text_tokenizer import TextTokenizer
from ddp_exp.data.tokens import TokenSplit
from ddp_exp.metrics.sampling import context_length, sample_ids, seeded_generator

if TYPE_CHECKING:
    from ddp_exp.config.schema import TrainerConfig

SAMPLE_TOKENS = 120  # new tokens per sample
SAMPLE_TEMPERATURE = 0.8
SAMPLE_STREAM = 0x5A3

log = logging.getLogger("ddp_exp.train")

__all__ = ["LanguageModelReport", "val_scalars"]


def is_token_data(split: Any) -> bool:
    """True for ``data=tokens`` splits."""
    return isinstance(split, TokenSplit)


def val_scalars(val_loss: float | None, split: Any, tokens: int = 0,
                num_bytes: float | None = None) -> dict[str, float]:
    """``val/perplexity`` and ``val/bits_per_byte`` from the per-token ``val/loss`` (nats);
    empty for other data or no loss.

    ``val/bits_per_byte = val/loss x tokens / num_bytes / ln 2``: the nats of every counted
    validation token over the UTF-8 bytes of the text those tokens stand for (both world-wide
    sums, :func:`token_byte_lengths`), so runs with different tokenizers compare. Without a
    byte count (a token file whose tokenizer ddp_exp does not know) there is none."""
    if val_loss is None or not is_token_data(split):
        return {}
    out = {"val/perplexity": math.exp(min(val_loss, 700.0))}
    if num_bytes:
        out["val/bits_per_byte"] = val_loss * tokens / num_bytes / math.log(2)
    return out


def printable(text: str) -> str:
    """``text`` for a log line: control characters other than line breaks (an untrained
    model's ``\\r``, ``\\x1b``, which would rewrite a terminal) as Python escapes."""
    return "".join(c if c.isprintable() or c == "\n" else c.encode("unicode_escape").decode()
                   for c in text)


def split_tokenizer(split: Any) -> TextTokenizer | None:
    """The tokenizer of a token split's ids: a prepared folder's ``tokenizer.json``, bytes
    for the built-in corpus, None for a bare token file.

    Raises:
        ConfigError: the folder's tokenizer does not load (e.g. no ``tokenizers`` library).
    """
    stream = split.stream
    if stream.tokenizer is not None:
        return TextTokenizer.load(stream.tokenizer)
    return TextTokenizer.bytes() if stream.byte_level else None


def token_byte_lengths(split: Any, is_main: bool = True) -> torch.Tensor | None:
    """UTF-8 bytes per token id, float64 ``[vocab_size]`` (special tokens 0), for token data
    whose tokenizer is byte-level; else None (no ``val/bits_per_byte``; why, said by rank 0
    alone: ``is_main``)."""
    if not is_token_data(split):
        return None
    try:
        tokenizer = split_tokenizer(split)
        if tokenizer is None or not tokenizer.byte_level:
            return None
        lengths = tokenizer.byte_lengths()
    except (ConfigError, ValueError) as e:
        if is_main:
            log.warning("no val/bits_per_byte: %s", e)
        return None
    vocab = split.stream.vocab_size
    table = torch.zeros(vocab, dtype=torch.float64)
    n = min(vocab, len(lengths))
    table[:n] = torch.tensor(lengths[:n], dtype=torch.float64)
    return table


class LanguageModelReport:
    """The loop's language-model numbers; inactive (every method a no-op) for other data.

    Args:
        trainer: ``cfg.trainer``, typed: ``peak_flops``, ``sample_every_n_epochs``,
            ``sample_prompt``.
        seed: the run's ``seed``.
        datasets: the splits (token data when ``datasets.train`` is a token split).
        model: the unwrapped model (``flops_per_token`` if it has it; any causal LM samples).
        world_size, is_main: the world; only rank 0 samples.
        writer: the run's :class:`ddp_exp.metrics.writer.MetricsWriter`.
    """

    def __init__(self, trainer: TrainerConfig, seed: int, datasets: Any, model: nn.Module,
                 world_size: int, is_main: bool, writer: Any):
        self.active = is_token_data(datasets.train)
        self.model, self.writer, self.is_main, self.seed = model, writer, is_main, seed
        counter = getattr(model, "flops_per_token", None)
        self.flops = counter() if self.active and callable(counter) else None
        peak = trainer.peak_flops
        self.peak_world = peak * world_size if peak else None
        self.every = trainer.sample_every_n_epochs or 0
        self.prompt = trainer.sample_prompt or "\n"
        self.stream = datasets.train.stream if self.active else None
        if self.flops is not None and not peak and is_main:  # once per run, rank 0
            log.info("perf/mfu is not reported: set trainer.peak_flops to one device's peak "
                     "FLOP/s (e.g. 989e12, an H100's dense bf16); perf/model_flops_per_sec is "
                     "reported either way")
        self.train_split = datasets.train
        self.output_key = getattr(trainer, "output_key", None) or "logits"
        self.tokenizer: TextTokenizer | None | bool = False  # False: not loaded yet

    @property
    def unit(self) -> str:
        """What the loop's training counts count: ``tokens`` for token data (every position
        of a window is counted), else ``samples``."""
        return "tokens" if self.active else "samples"

    def windows(self, tokens: float | None) -> float | None:
        """Token data: the windows (samples) that ``tokens`` counted tokens make
        (``tokens / data.block_size``: every position of a window counts); else ``tokens``."""
        if not self.active or tokens is None:
            return tokens
        return tokens / self.stream.block_size

    def train_scalars(self, tokens_per_sec: float | None) -> dict[str, float | None]:
        """``train/tokens_per_sec`` and the model FLOP/s (and MFU) from the interval's rate."""
        if not self.active:
            return {}
        out: dict[str, float | None] = {"train/tokens_per_sec": tokens_per_sec}
        if self.flops is not None and tokens_per_sec is not None:
            out["perf/model_flops_per_sec"] = tokens_per_sec * self.flops
            if self.peak_world:
                out["perf/mfu"] = tokens_per_sec * self.flops / self.peak_world
        return out

    def prompt_tokens(self, tokenizer: TextTokenizer | None) -> list[int]:
        """The prompt as token ids (the run's tokenizer); without one (a bare token file)
        the stream's first 8 tokens."""
        if tokenizer is not None:
            ids = tokenizer.encode(self.prompt)
            if ids:
                return ids
            return [tokenizer.end_of_text] if tokenizer.end_of_text is not None else [10]
        return [int(t) for t in np.asarray(self.stream.tokens[:8])]

    def sample(self, epoch: int, step: int, validation: int | None = None) -> str | None:
        """After (0-based) ``epoch``: rank 0 writes a sample every ``sample_every_n_epochs``
        epochs (TensorBoard text, tag ``samples``, at x = ``step``); returns its text. With
        validation by steps, after the (0-based) ``validation``-th validation instead: every
        ``sample_every_n_epochs`` validations, seeded from ``(seed, step)``. The log line
        says when: "after epoch E", or "at step S of epoch E" for validation by steps.

        The sample is ddp_exp's own loop over the model's next-token logits
        (:func:`ddp_exp.metrics.sampling.sample_ids`), decoded with the run's tokenizer. A
        sample that cannot be made (a model whose forward takes no bare ids, a tokenizer that
        does not load) is one warning, never a failed run."""
        count = epoch if validation is None else validation
        if (not self.active or not self.is_main or self.every <= 0
                or (count + 1) % self.every):
            return None
        # validation by steps is at a step, mostly inside an epoch: the step says when
        when = (f"after epoch {epoch + 1}" if validation is None
                else f"at step {step} of epoch {epoch + 1}")
        try:
            text = self.sample_text([epoch] if validation is None else [step, 1])
        except Exception as e:  # a view of the run: it never fails the run
            log.warning("no text sample %s: %s", when, described(e, 200))
            return None
        indented = "    " + text.replace("\n", "\n    ")  # markdown: keep line breaks
        log.info("sample %s (trainer.sample_prompt=%r, %d tokens):\n%s",
                 when, self.prompt, SAMPLE_TOKENS, printable(indented))
        tb = getattr(self.writer, "writer", None)
        if tb is not None:  # rank 0's SummaryWriter
            tb.add_text("samples", indented, step)
        return text

    def sample_text(self, key: list[int]) -> str:
        """The text of a sample, from a generator seeded by ``(seed, *key)`` (``[epoch]``,
        or ``[global step, 1]`` with validation by steps): the run's tokenizer's text, or
        ids for a bare token file."""
        if self.tokenizer is False:
            self.tokenizer = split_tokenizer(self.train_split)
        tokenizer = self.tokenizer
        device = next(self.model.parameters()).device
        seeds = np.random.SeedSequence([self.seed, key[0], SAMPLE_STREAM, *key[1:]])
        seed = int(seeds.generate_state(1)[0])
        prompt = self.prompt_tokens(tokenizer)
        new = sample_ids(self.model, prompt, SAMPLE_TOKENS, SAMPLE_TEMPERATURE,
                         generator=seeded_generator(seed, device),
                         context=context_length(self.model, self.stream.block_size),
                         output_key=self.output_key)
        if tokenizer is None:
            return " ".join(map(str, prompt + new))
        return tokenizer.decode(prompt + new)
