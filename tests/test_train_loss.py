"""The training loss windows (ddp_exp.metrics.train_loss): the host and device sums agree and are
exact,
the perf row rides along, and a non-finite loss names its first step (issue 13's host path)."""

from __future__ import annotations

import math

import pytest
import torch

from ddp_exp.distributed.process_group import World
from ddp_exp.metrics.train_loss import LossWindow, NonFiniteLossError

WORLD = World(rank=0, local_rank=0, world_size=1, local_world_size=1)


def _window(on_host: bool, losses: list[float], sizes: list[int]) -> LossWindow:
    window = LossWindow(torch.device("cpu"))
    window.on_host = on_host  # the device path is the one CUDA takes
    for step, (loss, size) in enumerate(zip(losses, sizes, strict=True), start=1):
        window.add(torch.tensor(loss, dtype=torch.float32), size, step)
    return window


@pytest.mark.parametrize("on_host", [True, False])
def test_sum_is_exact_and_the_same_on_both_paths(on_host):
    gen = torch.Generator().manual_seed(0)
    losses = (torch.rand(10, generator=gen) * 3).tolist()
    sizes = [32] * 9 + [7]  # an uneven last batch
    window = _window(on_host, losses, sizes)
    window.start(WORLD, [1.5, 2.5], context="ctx")
    loss_sum, count, extra, context = window.finish(WORLD)
    # the exact sum of float32 loss x size, rounded once
    exact = math.fsum(float(torch.tensor(v, dtype=torch.float32)) * s
                      for v, s in zip(losses, sizes, strict=True))
    assert loss_sum == exact
    assert count == 295 and extra == [1.5, 2.5] and context == "ctx"
    assert window.take_interval()[:2] == (exact, 295)
    assert window.take_interval()[:2] == (0.0, 0)  # the next interval starts empty


@pytest.mark.parametrize("on_host", [True, False])
def test_an_empty_window_still_checks(on_host):
    window = _window(on_host, [], [])
    assert window.check(WORLD) == (0.0, 0)


@pytest.mark.parametrize("on_host", [True, False])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_loss_names_the_first_bad_step(on_host, bad):
    window = _window(on_host, [0.5, 0.25, bad, bad], [4, 4, 4, 4])
    window.start(WORLD)
    with pytest.raises(NonFiniteLossError, match="at step 3 "):
        window.finish(WORLD)
