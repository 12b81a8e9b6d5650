"""The validation set's confusion matrix, reduced exactly over the ranks, as a CSV and a figure.

Each rank counts (true class, predicted class) pairs of its unpadded validation shard (samples
``rank, rank + world_size, ...``) during validation (:func:`pair_counts`); the all-reduce (SUM)
of the validation sums adds the counts too, so the matrix is the single-process one for any
world size and sums to ``val/num_samples``.
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

    :func:`ddp_exp.train.evaluate` adds them up over its shard and all-reduces them with the
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


def figure(matrix: torch.Tensor, names: Sequence[str]):
    """A matplotlib figure: cells coloured by the share of their true class (row), labelled
    with the counts (up to 30 classes)."""
    from matplotlib.figure import Figure

    counts = matrix.double()
    share = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
    n = len(names)
    side = min(12.0, 2.0 + 0.45 * n)
    fig = Figure(figsize=(side, side * 0.9), dpi=100)
    ax = fig.add_subplot()
    image = ax.imshow(share.numpy(), cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    ax.set_xticks(range(n), labels=names, rotation=90 if n > 10 else 0)
    ax.set_yticks(range(n), labels=names)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    total, correct = int(counts.sum()), int(counts.diagonal().sum())
    ax.set_title(f"validation: {correct}/{total} correct")
    if n <= 30:
        for (i, j), v in zip(((i, j) for i in range(n) for j in range(n)),
                             matrix.flatten().tolist(), strict=True):
            if v:
                ax.text(j, i, str(v), ha="center", va="center", fontsize=8,
                        color="white" if share[i, j] > 0.5 else "black")
    fig.tight_layout()
    return fig
