"""The validation set's confusion matrix, reduced exactly over the ranks, as a CSV and a picture.

Each rank counts (true class, predicted class) pairs of its unpadded validation shard (samples
``rank, rank + world_size, ...``) during validation (:func:`pair_counts`); the all-reduce (SUM)
of the validation sums adds the counts too, so the matrix is the single-process one for any
world size and sums to ``val/num_samples``.

Uses torch and Pillow only; :mod:`ddp_exp.train.evaluation` uses it.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch

CORNER = "true\\predicted"


def pair_counts(output: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """One batch's counts of (true, predicted) class pairs, float64 ``[C * C]`` on the batch's
    device (row-major: index ``true * C + predicted``, predicted = ``argmax`` of ``output [B, C]``).

    :func:`ddp_exp.train.evaluation.evaluate` adds them up over its shard and all-reduces them with
    the
    loss sums, in the validation pass itself (float64 counts are exact below 2**53).
    """
    pairs = target.long() * num_classes + output.argmax(dim=1)
    return torch.bincount(pairs, minlength=num_classes * num_classes).double()


def class_names(split: Any, num_classes: int) -> list[str]:
    """The dataset's ``classes`` (an image folder's sub-folder names, a torchvision-style
    dataset's attribute) when there is one name per class, else ``"0" .. "C-1"``."""
    names = getattr(split, "classes", None) or getattr(getattr(split, "dataset", None),
                                                       "classes", None)
    if names is not None and len(names) == num_classes:
        return [str(n) for n in names]
    return [str(i) for i in range(num_classes)]


def to_csv(matrix: torch.Tensor, names: Sequence[str]) -> str:
    """CSV text: a header row (the corner cell, then the predicted class names), then one row
    per true class starting with its name."""
    import csv

    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow([CORNER, *names])
    for name, row in zip(names, matrix.tolist(), strict=True):
        w.writerow([name, *row])
    return out.getvalue()


CELL = 28  # pixels per matrix cell
LIGHT, DARK = (247, 251, 255), (8, 48, 107)  # the two ends of matplotlib's "Blues" colour map


def image(matrix: torch.Tensor, names: Sequence[str]):
    """The matrix as an RGB picture, ``uint8 [H, W, 3]`` (numpy): cells shaded from white to
    dark blue by the share of their true class (row), labelled with the counts (up to 30
    classes); true classes down the left, predicted classes along the top, and a title with
    the number correct.

    Drawn with Pillow (imported in ~0.05 s), not matplotlib (~1 s to import, ~0.5 s to lay
    out and render, at the end of every classification run: issue 13).
    """
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    counts = matrix.double()
    share = (counts / counts.sum(dim=1, keepdim=True).clamp(min=1)).tolist()
    values = matrix.long().tolist()
    n = len(names)
    font = ImageFont.load_default()
    draw_probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))

    def width(text: str) -> int:
        return int(draw_probe.textlength(text, font=font))

    left = max([width(name) for name in names] + [width("true")]) + 12
    top = 44 + (max(width(name) for name in names) if n > 10 else 14)
    size = (left + n * CELL + 8, top + n * CELL + 24)
    picture = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(picture)
    total, correct = int(counts.sum()), int(counts.diagonal().sum())
    draw.text((left, 4), f"validation: {correct}/{total} correct", fill="black", font=font)
    draw.text((left, 20), "predicted class ->", fill="black", font=font)
    draw.text((4, top - 14), "true", fill="black", font=font)
    for j, name in enumerate(names):  # predicted classes along the top
        x = left + j * CELL + CELL // 2
        if n > 10:  # vertical labels
            label = Image.new("RGB", (width(name) + 2, 12), "white")
            ImageDraw.Draw(label).text((0, 0), name, fill="black", font=font)
            label = label.rotate(90, expand=True)
            picture.paste(label, (x - 6, top - 4 - label.size[1]))
        else:
            draw.text((x - width(name) // 2, top - 16), name, fill="black", font=font)
    for i, name in enumerate(names):
        y = top + i * CELL
        draw.text((left - 6 - width(name), y + CELL // 2 - 6), name, fill="black", font=font)
        for j in range(n):
            a = share[i][j]
            colour = tuple(round(lo + (hi - lo) * a) for lo, hi in zip(LIGHT, DARK, strict=True))
            x = left + j * CELL
            draw.rectangle((x, y, x + CELL - 1, y + CELL - 1), fill=colour, outline=(220, 220, 220))
            if n <= 30 and values[i][j]:
                text = str(values[i][j])
                draw.text((x + (CELL - width(text)) // 2, y + CELL // 2 - 6), text,
                          fill="white" if a > 0.5 else "black", font=font)
    return np.asarray(picture)
