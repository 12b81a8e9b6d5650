"""``model=gpt``: a small decoder-only transformer (GPT-2's layout, as nanoGPT writes it).

Pre-norm blocks (``x + attn(ln(x))``, ``x + mlp(ln(x))``), causal
``scaled_dot_product_attention``, learned positions, a final LayerNorm and a head tied to the
token embedding. The vocabulary comes from the data (``num_outputs = vocab_size``), like every
built-in model, and so does the context length unless ``model.block_size`` sets it
(``input_shape = (block_size,)``: ``data.block_size`` for ``data=tokens``, the first item's
length for a ``data=dataset`` of rows, which may be shorter than later rows).

May use: torch, :mod:`ddp_exp.config` (``ConfigError``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from ddp_exp.config.errors import ConfigError


class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention then a 4x GELU MLP, each residual."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=bias), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=bias), nn.Dropout(dropout))
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer: token ids ``[B, T]`` (int64, ``T <= block_size``) -> logits
    ``[B, T, vocab_size]`` for the next token at every position.

    Args:
        input_shape: ``(block_size,)``, from the data.
        num_outputs: the vocabulary size, from the data.
        n_layer, n_head, n_embd: depth, attention heads, width (``n_head`` divides ``n_embd``).
        dropout: on embeddings, attention and residual branches (training only).
        bias: biases in the linear layers and LayerNorms.
        block_size: the longest sequence the model takes (its position embeddings); None: the
            data's item length ``input_shape[0]``.

    Raises:
        ConfigError: ``n_embd`` not divisible by ``n_head``, or a non-positive size; items that
            are not windows of token ids (an input shape of more than one dimension here, or
            floating inputs in ``forward``: the launcher's probe refuses them before any rank);
            a batch longer than ``block_size`` in ``forward``.
    """

    def __init__(self, input_shape: Sequence[int], num_outputs: int, n_layer: int = 2,
                 n_head: int = 4, n_embd: int = 128, dropout: float = 0.0, bias: bool = True,
                 block_size: int | None = None):
        super().__init__()
        if min(n_layer, n_head, n_embd) < 1 or n_embd % n_head:
            raise ConfigError(f"model.n_embd={n_embd} is invalid with model.n_head={n_head}: "
                              "positive, and n_head must divide n_embd (e.g. n_embd="
                              f"{max(1, n_head) * max(1, round(n_embd / max(1, n_head)))})")
        if len(input_shape) != 1:
            raise ConfigError(f"model=gpt takes windows of token ids [batch, T]; the data's "
                              f"items have shape {list(input_shape)} (data=tokens, or a Dataset "
                              "of token ids)")
        if block_size is not None and block_size < 1:
            raise ConfigError(f"model.block_size={block_size} is invalid: a positive number of "
                              "tokens, or null (the data's item length)")
        self.context_from = "model.block_size" if block_size else "the data's item length"
        self.block_size = int(block_size or input_shape[-1])
        self.vocab_size = int(num_outputs)
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.wte = nn.Embedding(self.vocab_size, n_embd)
        self.wpe = nn.Embedding(self.block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, self.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # weight tying
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.is_floating_point():  # a dtype check: no device sync
            raise ConfigError(f"model=gpt takes integer token ids [batch, T]; the data gives "
                              f"{str(idx.dtype).removeprefix('torch.')} inputs (data=tokens, or "
                              "a Dataset of token ids)")
        t = idx.shape[1]
        if t > self.block_size:  # shapes only: no device sync
            raise ConfigError(f"model=gpt: a batch of {t} tokens per sequence, longer than the "
                              f"model's context block_size={self.block_size} ({self.context_from});"
                              f" set model.block_size to the longest sequence of the data")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def fsdp_blocks(self) -> list[nn.Module]:
        """The transformer blocks, in order: the modules ``strategy=fsdp`` shards one by one
        (:func:`ddp_exp.train.strategy.find_blocks`); the embeddings, final norm and tied head
        stay with the root."""
        return list(self.blocks)

    def num_params(self, embeddings: bool = False) -> int:
        """Parameters, the tied head counted once; without the position embedding unless
        ``embeddings`` (the 6N rule's N, PaLM appendix B)."""
        n = sum(p.numel() for p in self.parameters())
        return n if embeddings else n - self.wpe.weight.numel()

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward and backward): ``6 N + 12 L H Q T`` (PaLM appendix
        B, with ``H Q = n_embd`` and ``T`` the sequence length, default ``block_size``)."""
        t = self.block_size if seq_len is None else seq_len
        return 6 * self.num_params() + 12 * self.n_layer * self.n_embd * t

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 1.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Continue ``idx [B, t]`` by ``new_tokens`` tokens -> ``[B, t + new_tokens]``; greedy at
        ``temperature <= 0``, else sampled with ``generator`` (never the global RNG's)."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.block_size:])[:, -1, :].float()
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
