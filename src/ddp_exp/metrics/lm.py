"""What a language-model run reports (``data=tokens``): perplexity, bits per byte, tokens per
second, model FLOP/s and MFU, and text samples in TensorBoard.

* ``val/perplexity = exp(val/loss)`` (the per-token mean cross-entropy, nats);
  ``val/bits_per_byte = val/loss / ln 2`` where a token is one byte (the built-in corpus).
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
  stays exact.

May use: torch, :mod:`ddp_exp.data.tokens`.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ddp_exp.data.tokens import TokenSplit

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


def val_scalars(val_loss: float | None, split: Any) -> dict[str, float]:
    """``val/perplexity`` and, for byte-level tokens, ``val/bits_per_byte`` from the per-token
    ``val/loss`` (nats); empty for other data or no loss."""
    if val_loss is None or not is_token_data(split):
        return {}
    out = {"val/perplexity": math.exp(min(val_loss, 700.0))}
    if split.stream.byte_level:
        out["val/bits_per_byte"] = val_loss / math.log(2)
    return out


def printable(text: str) -> str:
    """``text`` for a log line: control characters other than line breaks (an untrained
    model's ``\\r``, ``\\x1b``, which would rewrite a terminal) as Python escapes."""
    return "".join(c if c.isprintable() or c == "\n" else c.encode("unicode_escape").decode()
                   for c in text)


class LanguageModelReport:
    """The loop's language-model numbers; inactive (every method a no-op) for other data.

    Args:
        trainer: ``cfg.trainer``, typed: ``peak_flops``, ``sample_every_n_epochs``,
            ``sample_prompt``.
        seed: the run's ``seed``.
        datasets: the splits (token data when ``datasets.train`` is a token split).
        model: the unwrapped model (``flops_per_token`` and ``generate`` if it has them).
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
                     "FLOP/s (e.g. 989e12, an H100's dense bf16); perf/model_flops_per_sec is")

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

    def prompt_tokens(self) -> list[int]:
        """The prompt as token ids: its UTF-8 bytes for byte-level data; otherwise the
        stream's first 8 tokens (ddp_exp has no tokenizer of a user's vocabulary)."""
        if self.stream.byte_level:
            return list(self.prompt.encode("utf-8")) or [10]
        return [int(t) for t in np.asarray(self.stream.tokens[:8])]

    def sample(self, epoch: int, step: int) -> str | None:
        """After (0-based) ``epoch``: rank 0 writes a sample every ``sample_every_n_epochs``
        epochs (TensorBoard text, tag ``samples``, at x = ``step``); returns its text."""
        generate = getattr(self.model, "generate", None)
        if (not self.active or not self.is_main or self.every <= 0 or not callable(generate)
                or (epoch + 1) % self.every):
            return None
        device = next(self.model.parameters()).device
        generator = torch.Generator(device=device)
        generator.manual_seed(int(np.random.SeedSequence([self.seed, epoch, SAMPLE_STREAM])
                                  .generate_state(1)[0]))
        idx = torch.tensor([self.prompt_tokens()], device=device)
        was_training = self.model.training
        self.model.eval()
        try:
            out = generate(idx, SAMPLE_TOKENS, SAMPLE_TEMPERATURE, generator)[0].tolist()
        finally:
            self.model.train(was_training)
        if self.stream.byte_level:
            text = bytes(t for t in out if t < 256).decode("utf-8", "replace")
        else:
            text = " ".join(map(str, out))
        indented = "    " + text.replace("\n", "\n    ")  # markdown: keep line breaks
        log.info("sample after epoch %d (trainer.sample_prompt=%r, %d tokens):\n%s",
                 epoch + 1, self.prompt, SAMPLE_TOKENS, printable(indented))
        tb = getattr(self.writer, "writer", None)
        if tb is not None:  # rank 0's SummaryWriter
            tb.add_text("samples", indented, step)
        return text
