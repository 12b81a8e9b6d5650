"""Which strategy a run trains under (``strategy=ddp|fsdp``): the one place that knows both.

:mod:`ddp_exp.train.strategy` holds the interface and DDP's implementation,
:mod:`ddp_exp.train.fsdp` FSDP2's (which imports the interface), so neither imports the other's
module back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ddp_exp.config.view import RankConfig
from ddp_exp.train.strategy import DDPStrategy, Strategy


def build_strategy(cfg: RankConfig, model: nn.Module, device: torch.device,
                   input_shape: Any = None, num_outputs: int = 0) -> Strategy:
    """The run's strategy (``cfg.strategy``) over the seeded, unwrapped ``model``
    (``input_shape`` and ``num_outputs``: the dataset's, for the FSDP meta-device build)."""
    if cfg.strategy.name == "fsdp":
        from ddp_exp.train.fsdp import FSDPStrategy

        return FSDPStrategy(cfg, cfg.strategy, model, device, input_shape, num_outputs)
    return DDPStrategy(cfg, model, device)
