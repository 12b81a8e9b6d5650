"""A small corpus of unique documents in mixed scripts (CRLF, CJK, accents, emoji) for the
tests of ``ddp-exp prepare`` and of runs on a prepared folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SENTENCES = ["the quick brown fox jumps over the lazy dog.",
             "a rank reduces its sums with every other rank.",
             "gradients are averaged across the whole world.",
             "数据并行训练需要同步梯度。", "Ünïcödé text with accents — and emoji 😀 too.",
             "line one ends with crlf\r\nand line two follows.",
             "every document ends with a special token.", "tabs\tand  double  spaces  stay."]


def write_corpus(folder: Path, documents: int = 60, seed: int = 0) -> list[str]:
    """``documents`` unique text files (each starts with its own number); returns the texts."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    texts = []
    for i in range(documents):
        text = f"document {i}\n" + " ".join(
            SENTENCES[j] for j in rng.integers(len(SENTENCES), size=20)) + "\n"
        (folder / f"d{i:03d}.txt").write_bytes(text.encode("utf-8"))
        texts.append(text)
    return texts
