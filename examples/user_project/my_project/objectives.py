"""A loss and a metric of the user's own: per-sample functions of (output, target)."""

import torch
import torch.nn.functional as F


def smoothed_cross_entropy(output: torch.Tensor, target: torch.Tensor,
                           smoothing: float = 0.1) -> torch.Tensor:
    """Cross-entropy with label smoothing, per sample: ``[batch]``."""
    return F.cross_entropy(output.float(), target, reduction="none", label_smoothing=smoothing)


def confident_correct(output: torch.Tensor, target: torch.Tensor,
                      threshold: float = 0.9) -> torch.Tensor:
    """1.0 where the prediction is right with probability >= ``threshold``, per sample."""
    prob = output.float().softmax(dim=1)
    confidence, prediction = prob.max(dim=1)
    return ((prediction == target) & (confidence >= threshold)).float()
