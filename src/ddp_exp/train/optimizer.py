"""The optimizer side of a step: the optimizer, mixed precision, gradient clipping and norm.

* :func:`build_optimizer`: ``cfg.optim``'s ``_target_`` at the effective learning rate (the
  scaling rule of :func:`ddp_exp.config.checks.effective_lr`);
* :func:`autocast` and :func:`grad_scaler`: mixed precision, ``trainer.precision`` (autocast
  is also the evaluation forward's);
* :class:`OptimizerStep`: what runs once per optimizer step after the last micro-batch's
  backward, i.e. after DDP's gradient all-reduce: unscaling (``16-mixed`` loss scaling),
  clipping to ``trainer.gradient_clip_val`` or measuring ``train/grad_norm``, and
  ``optimizer.step()``. Gradients are identical on every rank by then, so the norm and the
  clipping are too.

Uses :mod:`ddp_exp.config` (errors, the effective learning rate) and torch only; the loop
(:mod:`ddp_exp.train.loop`) uses it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from ddp_exp.compat.tensors import tensor_norms
from ddp_exp.config.checks import OPTIM_OWN_KEYS
from ddp_exp.config.errors import ConfigError, first_line
from ddp_exp.config.targets import instantiate_node
from ddp_exp.config.view import RankConfig

AUTOCAST_DTYPES = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
NO_CONTEXT = contextlib.nullcontext()  # reusable: entering it does nothing


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``bf16-mixed`` / ``16-mixed``, a no-op for ``32-true``."""
    dtype = AUTOCAST_DTYPES[precision]
    if dtype is None:
        return NO_CONTEXT
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
    """The global L2 norm of the parameters' gradients (a scalar tensor on their device, no
    host sync), as ``torch.nn.utils.clip_grad_norm_`` computes it (the norm of the per-tensor
    norms, :func:`ddp_exp.compat.tensors.tensor_norms`); None if none has a
    gradient. Called after DDP's all-reduce, it is the same on every rank. Not
    ``torch.nn.utils.get_total_norm``: its grouping costs ~130 us of host time a call on a
    small model, ~20 % of a digits step (issue 13); the value is the same."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    return torch.linalg.vector_norm(torch.stack(tensor_norms(grads)))  # ddp_exp.compat


def build_optimizer(cfg: RankConfig, params: Iterable[torch.nn.Parameter]
                    ) -> torch.optim.Optimizer:
    """``cfg.optim``'s ``_target_`` over ``params``, at the effective (scaled) learning rate.

    Args:
        cfg: the run's typed config: the optimizer's arguments are ``cfg.targets.optim``, as
            ``instantiate`` takes them.

    Raises:
        ConfigError: the optimizer cannot be imported or rejects its arguments.
    """
    args = {k: v for k, v in cfg.targets.optim.items() if k not in OPTIM_OWN_KEYS}
    args["lr"] = cfg.effective_lr
    factory = instantiate_node(args, "optim")
    try:
        return factory(params)
    except Exception as exc:  # an unknown keyword, a value out of range, a list too short
        raise _rejected(args, exc) from None


class _ArgumentsChecked(Exception):
    """Raised by :class:`_Unread` when an optimizer's constructor reads its parameters: its
    own checks of its arguments, which come first, have passed."""


class _Unread:
    """Stands for the parameters in :func:`check_optimizer`: reading it ends the build."""

    def __iter__(self):
        raise _ArgumentsChecked


def check_optimizer(cfg: RankConfig) -> None:
    """Refuse ``cfg.optim`` before any rank starts as :func:`build_optimizer` would, without
    building the optimizer: its class is imported and called with its arguments, at the
    effective learning rate, over parameters that stop the call where it first reads them.
    torch's optimizers check their arguments first (an unknown keyword, ``lr``, ``momentum``,
    ``betas``, ``eps``, ``weight_decay`` out of range, ``nesterov`` without momentum) and then
    hand the parameters to ``Optimizer.__init__``, whose first ``add_param_group`` imports
    ``torch._dynamo`` (~1.3 s of the launcher's start, issue 42 item 6): that import is left to
    the ranks, which build the optimizer. What a constructor checks after it has the
    parameters (fused kernels for their device, say) is a rank's error instead.

    Raises:
        ConfigError: the optimizer cannot be imported or rejects its options (the same line
            as :func:`build_optimizer`).
    """
    args = {k: v for k, v in cfg.targets.optim.items() if k not in OPTIM_OWN_KEYS}
    args["lr"] = cfg.effective_lr
    factory = instantiate_node(args, "optim")
    try:
        factory(_Unread())
    except _ArgumentsChecked:
        return
    except Exception as exc:
        raise _rejected(args, exc) from None


def _rejected(args: dict[str, Any], exc: BaseException) -> ConfigError:
    """The one line for an optimizer that rejects its arguments (``args``, as built)."""
    options = {k: v for k, v in args.items() if not k.startswith("_") and k != "lr"}
    first = first_line(exc, default=type(exc).__name__)
    return ConfigError(f"optim ({args['_target_']}) rejects its options {options}: {first}")


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 (``16-mixed``) needs loss scaling: a ``GradScaler``; bf16 and fp32 do not (None:
    the step skips the scaler's calls)."""
    return torch.amp.GradScaler(device.type) if precision == "16-mixed" else None


class OptimizerStep:
    """One optimizer step once the step's gradients are all-reduced (the hot path: nothing
    done that a step does not need).

    Args:
        optimizer: from :func:`build_optimizer`.
        scaler: from :func:`grad_scaler` (the one the backward scaled the loss with), or None.
        clip: ``trainer.gradient_clip_val``: the max global L2 norm, or None (off).
        params: the parameters whose gradients are clipped or measured (those that require
            one).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
                 clip: float | None, params: list[torch.nn.Parameter]):
        self.optimizer = optimizer
        self.scaler = scaler
        self.clip = clip
        self.params = params

    def step(self, measure_norm: bool) -> torch.Tensor | None:
        """Clip (with ``clip``) or, when ``measure_norm`` (a logging step), measure the global
        gradient norm, unscaled first under ``16-mixed``; then ``optimizer.step()`` (through the
        scaler, which skips a step with inf/NaN gradients and updates its scale).

        Returns:
            The global L2 norm before clipping (a device scalar, no host sync) when clipping or
            measuring, else None.
        """
        norm = None
        if self.clip is not None:  # after DDP's all-reduce: the same norm on every rank
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        elif measure_norm:  # train/grad_norm, logging steps only
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            norm = grad_norm(self.params)
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        return norm
