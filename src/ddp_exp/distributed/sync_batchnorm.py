"""BatchNorm over the world's global batch (``ddp.sync_batchnorm=true``).

Under DDP each rank's BatchNorm normalises with its own per-rank batch statistics, so
``world_size=2, batch_size=8`` is not ``world_size=1, batch_size=16``. Synchronised BatchNorm
reduces the statistics over the world first (Ioffe & Szegedy 2015 on the global batch; PyTorch's
``torch.nn.SyncBatchNorm``).

* CUDA: ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` before DDP wraps the model.
* CPU: torch 2.13's SyncBatchNorm refuses CPU tensors ("SyncBatchNorm expected input tensor to be
  on GPU or XPU"), so :class:`CPUSyncBatchNorm` does the same on the CPU. Forward: per-channel
  sum, sum of squares and count are all-reduced in one float64 collective; mean and biased
  variance of the global batch normalise the input. Backward: per-channel ``sum(dy)`` and
  ``sum(dy * x_hat)`` are all-reduced, and each rank computes the global batch's input gradient
  (the formula of ``torch.nn.SyncBatchNorm``'s backward). The weight and bias gradients stay
  local sums, which DDP then averages like every other parameter. Running statistics are updated
  from the global mean and unbiased variance, so they are the same on every rank.
  It extends torch's private ``_BatchNorm``, as torch's own SyncBatchNorm does (DDP refuses that
  public class on CPU, so it cannot be the base); ``tests/test_compat.py`` holds what it relies
  on (the constructor's arguments, the parameters and buffers, ``_check_input_dim``).

In ``eval()`` mode both use the running statistics and run no collective (evaluation goes through
the unwrapped model on uneven shards, see :mod:`ddp_exp.train.evaluation`). The state-dict keys are
those of BatchNorm: checkpoints and ``model.pt`` load into the plain model.

Uses :mod:`ddp_exp.distributed.process_group` (the all-reduce); the loop converts the model with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ddp_exp.distributed.process_group import all_reduce_sum


def _shape(x: torch.Tensor) -> list[int]:
    """Broadcast shape of a per-channel vector against ``x`` ``[N, C, *]``."""
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


class _GlobalBatchNorm(torch.autograd.Function):
    """``y = (x - mean) / sqrt(var + eps) * weight + bias`` with the world's batch statistics.

    ``x``: ``[N, C, *]`` on every rank (N may differ between ranks). Returns ``y`` (like ``x``),
    and the global per-channel ``mean`` and biased ``var`` ``[C]`` (float64) and the global
    sample count per channel (a float64 scalar).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float):
        c = x.shape[1]
        dims = [0, *range(2, x.dim())]
        xd = x.detach().double()
        count = x.numel() // c
        stats = torch.cat([xd.sum(dims), xd.square().sum(dims),
                           torch.full((1,), float(count), dtype=torch.float64, device=x.device)])
        all_reduce_sum(stats)
        n = stats[2 * c]
        mean = stats[:c] / n
        var = (stats[c:2 * c] / n - mean.square()).clamp_min(0.0)
        invstd = (var + eps).rsqrt()
        shape = _shape(x)
        x_hat = (x - mean.to(x.dtype).view(shape)) * invstd.to(x.dtype).view(shape)
        y = x_hat
        if weight is not None:
            y = y * weight.view(shape) + bias.view(shape)
        ctx.save_for_backward(x_hat, invstd, weight, n)
        ctx.mark_non_differentiable(mean, var, n)
        return y, mean, var, n

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar, _dn):
        x_hat, invstd, weight, n = ctx.saved_tensors
        c = x_hat.shape[1]
        dims = [0, *range(2, x_hat.dim())]
        shape = _shape(x_hat)
        sum_dy = dy.double().sum(dims)
        sum_dy_xhat = (dy * x_hat).double().sum(dims)
        grad_weight = grad_bias = None
        if weight is not None:  # local sums: DDP averages them over the ranks
            grad_weight = sum_dy_xhat.to(weight.dtype)
            grad_bias = sum_dy.to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            totals = all_reduce_sum(torch.cat([sum_dy, sum_dy_xhat]))
            mean_dy = (totals[:c] / n).to(dy.dtype).view(shape)
            mean_dy_xhat = (totals[c:] / n).to(dy.dtype).view(shape)
            scale = invstd.to(dy.dtype).view(shape)
            if weight is not None:
                scale = scale * weight.view(shape)
            grad_x = (dy - mean_dy - x_hat * mean_dy_xhat) * scale
        # (needs_input_grad is the same on every rank: same model, so the same collectives.)
        return grad_x, grad_weight, grad_bias, None


class CPUSyncBatchNorm(_BatchNorm):
    """BatchNorm whose training-mode statistics are those of the world's global batch (see the
    module docstring). Input ``[N, C, *]`` with at least 2 dimensions, output the same shape.

    Same parameters, buffers and options as ``torch.nn.BatchNorm{1,2,3}d``; built from one by
    :func:`convert_sync_batchnorm`.
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training and self.track_running_stats:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        if not self.training:  # no running statistics: this rank's batch (no collective)
            return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
        y, mean, var, n = _GlobalBatchNorm.apply(x, self.weight, self.bias, self.eps)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                            else self.momentum)
                unbiased = var * n / (n - 1).clamp_min(1.0)
                self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype),
                                                          alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype),
                                                         alpha=momentum)
        return y


def convert_sync_batchnorm(module: nn.Module, device_type: str) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` by its synchronised form, sharing its
    parameters and buffers; call before ``DistributedDataParallel(module)``.

    Args:
        module: the unwrapped model (changed in place; the root is returned, new if it was
            itself a BatchNorm).
        device_type: ``cuda`` (torch's ``SyncBatchNorm``) or ``cpu`` (:class:`CPUSyncBatchNorm`).
    """
    if device_type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, CPUSyncBatchNorm):
        out = CPUSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                               module.track_running_stats)
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, device_type))
    return out
