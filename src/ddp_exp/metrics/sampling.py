"""Text from a causal language model: ddp_exp's own sampling loop over next-token logits.

It asks a model nothing but its forward: token ids ``[1, t]`` in, logits ``[1, t, vocab]`` out
(a tensor, a tuple's first element, or a mapping's ``trainer.output_key``, as training reads
it), so any causal LM a user brings samples: ddp_exp's GPT, a Hugging Face
``GPT2LMHeadModel``, a module of one's own. A model's own ``generate`` is never called (its
signature differs from model to model). Per new token: the context cropped to the model's
length, the last position's logits, divided by the temperature, the ``top_k`` largest kept,
one draw from a ``torch.Generator`` of the caller's (never the global RNG: sampling during
training moves no rank's random numbers, and a seed repeats a sample exactly). Temperature
0 is greedy.

Used by the per-epoch TensorBoard samples (:mod:`ddp_exp.metrics.lm`) and ``ddp-exp sample``
(:mod:`ddp_exp.cli.sample`).

May use: torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn


def context_length(model: nn.Module, default: int) -> int:
    """The longest sequence ``model`` takes: its ``block_size`` (ddp_exp's GPT), its Hugging
    Face config's ``n_positions`` / ``max_position_embeddings``, else ``default`` (the
    data's window, what the model trained on)."""
    for value in (getattr(model, "block_size", None),
                  getattr(getattr(model, "config", None), "n_positions", None),
                  getattr(getattr(model, "config", None), "max_position_embeddings", None)):
        if isinstance(value, int) and value > 0:
            return value
    return default


def next_token_logits(out: Any, output_key: str = "logits") -> torch.Tensor:
    """The logits ``[B, t, V]`` of a model's output: a tensor, a mapping's ``output_key``
    (a Hugging Face ``ModelOutput`` is one), or a tuple's first element.

    Raises:
        TypeError: an output none of these, or logits that are not ``[B, t, V]``.
    """
    if isinstance(out, Mapping):
        out = out[output_key]
    elif isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        raise TypeError(f"the model's output is not logits [batch, tokens, vocabulary] "
                        f"(got {type(out).__name__}"
                        f"{list(out.shape) if isinstance(out, torch.Tensor) else ''})")
    return out


@torch.no_grad()
def sample_ids(model: nn.Module, prompt: Sequence[int], max_new_tokens: int,
               temperature: float = 0.8, top_k: int | None = None,
               generator: torch.Generator | None = None, context: int = 128,
               output_key: str = "logits", stop_id: int | None = None) -> list[int]:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens; returns the new ids only.

    Args:
        model: a causal LM (eval mode is set for the call and the mode restored after).
        prompt: token ids (at least one).
        temperature: > 0 divides the logits; <= 0 takes the most likely token (greedy).
        top_k: keep only the ``top_k`` most likely tokens (None or 0: all).
        generator: the random source of the draws (a seeded one repeats the sample).
        context: the longest context fed to the model (:func:`context_length`).
        output_key: the logits' key in a mapping output (``trainer.output_key``).
        stop_id: stop after drawing this id (``<|endoftext|>``), or None.

    Raises:
        ValueError: an empty prompt. Whatever the model's forward raises.
    """
    if not prompt:
        raise ValueError("an empty prompt: give at least one token")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    new: list[int] = []
    try:
        for _ in range(max_new_tokens):
            logits = next_token_logits(model(idx[:, -context:]), output_key)[:, -1, :].float()
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(int(top_k), logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
            new.append(int(nxt))
            if stop_id is not None and new[-1] == stop_id:
                break
    finally:
        model.train(was_training)
    return new


def seeded_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator of its own on ``device`` seeded with ``seed``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed))
    return generator
