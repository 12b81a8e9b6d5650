"""A model of the user's own: any torch.nn.Module works."""

import math

import torch
from torch import nn


class ResidualMLP(nn.Module):
    """``[batch, *input_shape] -> [batch, num_outputs]``: a linear stem, ``depth`` residual
    blocks ``x + W2 relu(W1 norm(x))``, a linear head. ddp_exp passes ``input_shape`` and
    ``num_outputs`` from the dataset; ``width`` and ``depth`` come from the YAML."""

    def __init__(self, input_shape, num_outputs, width=64, depth=2):
        super().__init__()
        self.stem = nn.Linear(math.prod(input_shape), width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, width))
            for _ in range(depth))
        self.head = nn.Linear(width, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x.flatten(1))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)
