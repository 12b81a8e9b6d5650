"""No straggler is named from too few steps (issue 41 item 4): runs of 5 steps logged
"rank 1 is a straggler" from means dominated by the first steps' one-off costs. The epoch's
line needs :data:`ddp_exp.metrics.perf.STRAGGLER_MIN_STEPS` (20) steps on every rank."""

from __future__ import annotations

import pytest
import torch

from ddp_exp.metrics import perf


def _epoch(steps: float, slow_compute_s: float) -> torch.Tensor:
    """Two ranks' epoch sums: rank 0 computes 10 ms a step, rank 1 ``slow_compute_s`` in all."""
    return torch.tensor([[0.0, 0.010 * steps, 0.0, 0.0, steps, 0.0, 0.0],
                         [0.0, slow_compute_s, 0.0, 0.0, steps, 0.0, 0.0]], dtype=torch.float64)


@pytest.mark.parametrize("steps", [1, 5, 19])
def test_a_short_epoch_names_no_straggler_however_uneven(steps):
    assert perf.straggler_line(_epoch(steps, 0.030 * steps), epoch=0) is None  # 3x


@pytest.mark.parametrize("steps", [20, 500])
def test_an_epoch_of_enough_steps_names_the_slow_rank(steps):
    line = perf.straggler_line(_epoch(steps, 0.030 * steps), epoch=0)
    assert line is not None and line.startswith("epoch 1: rank 1 is a straggler")
    assert "3.00x the fastest rank's (rank 0, 10.00 ms)" in line


def test_the_sample_counts_the_rank_with_fewest_steps():
    table = _epoch(40, 1.2)
    table[1, 4] = 10.0  # rank 1 timed 10 steps only: too few, whatever its mean
    assert perf.straggler_line(table, epoch=0) is None
