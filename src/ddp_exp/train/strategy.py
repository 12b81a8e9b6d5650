"""The ``strategy`` group: how a rank holds the model (replicated under DDP, sharded under FSDP2).

Both strategies give the loop the same small interface (:class:`Strategy`): the module the
training forward goes through (``wrapped``), the unwrapped module for evaluation and text
samples (``module``), the accumulation context that skips the gradient reduction (``no_sync``),
the evaluation context (``evaluation``), the optimizer step with the global-norm clipping
(``optimizer_step``), and the full (unsharded, plain ``state_dict`` layout) model and optimizer
states that checkpoints and ``model.pt`` hold, so that a checkpoint of either strategy resumes
under the other, at any world size.

* :class:`DDPStrategy`: ``DistributedDataParallel`` (``ddp.*`` keys), as before the group.
* :class:`FSDPStrategy`: FSDP2, ``torch.distributed.fsdp.fully_shard`` over an explicit 1-D
  device mesh of the world (gloo on the CPU works with torch 2.13), each block (:func:`find_blocks`)
  and then the root. The rank builds the model on the ``meta`` device (no memory), shards it,
  materialises its shards (``to_empty``) and copies into each parameter's shard the slice of
  the seeded full tensor (``distribute_tensor(..., src_data_rank=None)``: a local slice, no
  collective), so its initial weights are bit-identical to the unsharded build of the same seed.
  The full tensors are the launching process's one seeded build (:mod:`ddp_exp.launch.build`),
  which forked ranks share without a copy: a rank allocates only its shards.

Uses :mod:`ddp_exp.config` (the section, errors), :mod:`ddp_exp.distributed.sync_batchnorm`,
:mod:`ddp_exp.train.models` and :mod:`ddp_exp.train.optimizer`; the loop
(:mod:`ddp_exp.train.loop`), the checkpoint state (:mod:`ddp_exp.train.state`) and
:mod:`ddp_exp.launch.build` (the checks before any rank) use it.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import inspect
import logging
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from ddp_exp.compat.ddp_buckets import lay_out_buckets_once
from ddp_exp.compat.optimizer_hooks import without_global_hooks
from ddp_exp.config.errors import ConfigError
from ddp_exp.config.strategy import StrategyConfig
from ddp_exp.config.view import RankConfig
from ddp_exp.distributed.sync_batchnorm import convert_sync_batchnorm
from ddp_exp.train.optimizer import NO_CONTEXT, OptimizerStep

# Every BatchNorm class of torch.nn (their shared base is private): running statistics per rank.
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
               nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d)

log = logging.getLogger("ddp_exp.train")

MIB = 2 ** 20


class Strategy:
    """What the loop needs from a strategy. Attributes: ``name``; ``module``: the unwrapped
    model (the same parameters); ``wrapped``: what the training forward calls."""

    name = "base"
    module: nn.Module
    wrapped: nn.Module

    def no_sync(self) -> contextlib.AbstractContextManager:
        """The context of an accumulating micro-batch (forward and backward): no reduction."""
        raise NotImplementedError

    def evaluation(self) -> contextlib.AbstractContextManager:
        """The context of an evaluation pass through ``module`` (ranks may run different
        numbers of batches inside it: no collective per forward)."""
        return NO_CONTEXT

    def optimizer_step(self, optimizer: torch.optim.Optimizer, scaler: Any,
                       clip: float | None) -> OptimizerStep:
        """The step that clips by (or measures) the global gradient norm, then steps."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        return OptimizerStep(optimizer, scaler, clip, params)

    def model_state(self) -> dict[str, Any]:
        """The model's plain ``state_dict`` (full tensors); every rank calls it."""
        return self.module.state_dict()

    def load_model_state(self, state: dict[str, Any]) -> None:
        """Load a plain, full ``state_dict`` (every rank holds it)."""
        self.module.load_state_dict(state)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()``'s plain layout (parameter ids), full tensors."""
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
                             ) -> None:
        """Load a plain, full optimizer ``state_dict`` (every rank holds it)."""
        optimizer.load_state_dict(state)

    @functools.cached_property
    def states_still_until_step(self) -> bool:
        """Whether :meth:`model_state` and :meth:`optimizer_state` read the same values until
        the next ``optimizer.step()`` while the loop runs forward and backward beside them: a
        module held whole without buffers (a forward writes none: BatchNorm's running
        statistics are buffers) under a strategy whose states gather nothing (not FSDP's). Then a
        checkpoint's snapshot of them can run on the background writer while the next step's
        forward and backward do (:func:`ddp_exp.train.checkpointing.take`)."""
        return next(self.module.buffers(), None) is None

    def state_mb(self, optimizer: torch.optim.Optimizer) -> float:
        """MiB of parameters + gradients + optimizer state this rank holds: the parameters'
        local bytes, as many again for the gradients of trainable ones, and the optimizer's
        state tensors (before its first step: estimated by :func:`optimizer_bytes_per_byte`)."""
        params = [_local(p) for p in self.module.parameters()]
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        grad_bytes = sum(_local(p).numel() * _local(p).element_size()
                         for p in self.module.parameters() if p.requires_grad)
        if optimizer.state:
            state_bytes = sum(_local(v).numel() * _local(v).element_size()
                              for s in optimizer.state.values() for v in s.values()
                              if isinstance(v, torch.Tensor))
        else:
            state_bytes = grad_bytes * optimizer_bytes_per_byte(optimizer)
        return (param_bytes + grad_bytes + state_bytes) / MIB


class Whole(Strategy):
    """A module held whole with no wrapper (a loop built without a strategy, e.g. in a test):
    the plain ``state_dict`` calls."""

    name = "ddp"

    def __init__(self, module: nn.Module):
        self.module = self.wrapped = module

    def no_sync(self) -> contextlib.AbstractContextManager:
        return NO_CONTEXT


class HoldsModel(Protocol):
    """What :func:`held` reads: a loop's (or a stand-in's) unwrapped ``model``; its
    ``strategy`` where it has one."""

    model: nn.Module


def held(loop: HoldsModel) -> Strategy:
    """``loop.strategy``, or :class:`Whole` over ``loop.model`` where the loop has none."""
    strategy = getattr(loop, "strategy", None)
    return strategy if strategy is not None else Whole(loop.model)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


@functools.lru_cache(maxsize=32)
def _state_ratio(factory: type, defaults: tuple) -> float:
    probe = nn.Parameter(torch.zeros(64))
    optimizer = factory([probe], **dict(defaults))
    probe.grad = torch.ones_like(probe)
    with without_global_hooks():  # a user's step-counting hook must not see the probe's step
        optimizer.step()
    sized = sum(v.numel() for v in optimizer.state[probe].values()
                if isinstance(v, torch.Tensor) and v.numel() == probe.numel())
    return sized / probe.numel()


def optimizer_bytes_per_byte(optimizer: torch.optim.Optimizer) -> float:
    """Optimizer state bytes per byte of gradient, for an optimizer that has not stepped yet
    (its state is created lazily): one step of the same class and settings on a 64-element
    probe, counting the state tensors the size of the parameter (AdamW: 2, SGD with momentum:
    1, plain SGD: 0). The probe gets the settings its class's ``__init__`` takes (AdamW's
    defaults hold ``decoupled_weight_decay``, which ``AdamW()`` refuses: the estimate was 0 for
    every AdamW run), and 0 where an optimizer needs more than params and its settings."""
    try:
        accepted = inspect.signature(type(optimizer)).parameters
    except (TypeError, ValueError):
        return 0.0
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    defaults = tuple(sorted((k, v) for k, v in optimizer.defaults.items()
                            if (takes_any or k in accepted) and _hashable(v)))
    try:
        return _state_ratio(type(optimizer), defaults)
    except Exception:  # an optimizer that needs more than params and its defaults
        return 0.0


def _hashable(value: Any) -> bool:
    """A plain setting (number, flag, text, None, or a tuple of them: AdamW's ``betas``)."""
    if isinstance(value, tuple):
        return all(_hashable(v) for v in value)
    return isinstance(value, (int, float, bool, str, type(None)))


class DDPStrategy(Strategy):
    """``DistributedDataParallel`` over the seeded model (``ddp.*``; ``ddp.sync_batchnorm``
    converts BatchNorm first, as torch's SyncBatchNorm docs say)."""

    name = "ddp"

    def __init__(self, cfg: RankConfig, model: nn.Module, device: torch.device):
        from torch.nn.parallel import DistributedDataParallel

        ddp_cfg = cfg.ddp
        if ddp_cfg.sync_batchnorm:  # before DDP wraps it
            model = convert_sync_batchnorm(model, device.type)
        self.module = model.to(device)
        self.wrapped = DistributedDataParallel(
            self.module, device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=ddp_cfg.bucket_cap_mb,
            gradient_as_bucket_view=ddp_cfg.gradient_as_bucket_view,
            static_graph=ddp_cfg.static_graph,
            find_unused_parameters=ddp_cfg.find_unused_parameters)
        # One bucket layout for every step, so that a resume at 3+ ranks sums alike.
        lay_out_buckets_once(self.wrapped)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.wrapped.no_sync()


def find_blocks(model: nn.Module, patterns: list[str] | None) -> list[nn.Module]:
    """The modules FSDP shards one by one, in order: those whose class name or module path
    (``blocks.0``) matches one of ``patterns`` (fnmatch; a module inside a matched one is not
    taken again); with no patterns, the model's ``fsdp_blocks()`` if it has one, else each
    top-level child that holds parameters.

    Raises:
        ConfigError: a pattern that matches no module (naming ``strategy.blocks``).
    """
    if not patterns:
        own = getattr(model, "fsdp_blocks", None)
        if callable(own):
            return list(own())
        children = []
        for child in model.children():  # a ModuleList has no forward: its items instead
            items = child.children() if isinstance(child, (nn.ModuleList, nn.ModuleDict)) \
                else (child,)
            children += [m for m in items if any(True for _ in m.parameters())]
        return children
    found: list[nn.Module] = []
    taken: list[str] = []
    used = set()
    for path, module in model.named_modules():
        if not path or any(path.startswith(t + ".") for t in taken):
            continue
        hit = [p for p in patterns
               if type(module).__name__ == p or fnmatch.fnmatchcase(path, p)]
        if hit:
            used.update(hit)
            found.append(module)
            taken.append(path)
    unused = [p for p in patterns if p not in used]
    if unused:
        names = sorted({type(m).__name__ for _, m in model.named_modules()})
        raise ConfigError(f"strategy.blocks={unused[0]!r} matches no module of the model: a "
                          f"class name ({', '.join(names[:8])}) or a module path pattern "
                          "such as 'blocks.*'")
    return found


def check_model(cfg: RankConfig, model: nn.Module, device: str) -> None:
    """Refuse, before any rank starts, what ``strategy=fsdp`` cannot keep exact with this model
    and config: ``ddp.sync_batchnorm`` (SyncBatchNorm's all-reduce per forward is DDP's), a
    model with BatchNorm (its running statistics would drift per rank, unsynchronised),
    ``trainer.compile`` and ``16-mixed`` loss scaling (not built for FSDP2 yet), float16 on
    the CPU, a ``strategy.blocks`` entry that matches nothing.

    Raises:
        ConfigError: one line naming the key.
    """
    from ddp_exp.config.strategy import check_device

    if cfg.strategy.name != "fsdp":
        return
    if cfg.ddp.sync_batchnorm:
        raise ConfigError("ddp.sync_batchnorm=true does not apply to strategy=fsdp "
                          "(SyncBatchNorm is DDP's): set ddp.sync_batchnorm=false or strategy=ddp")
    if any(isinstance(m, BATCH_NORMS) for m in model.modules()):
        raise ConfigError("strategy=fsdp: the model has BatchNorm, whose running statistics "
                          "each rank would keep from its own shard: use strategy=ddp with "
                          "ddp.sync_batchnorm=true, or a model without BatchNorm")
    if cfg.trainer.compile:
        raise ConfigError("trainer.compile=true is not supported with strategy=fsdp yet: "
                          "set trainer.compile=false or strategy=ddp")
    if cfg.trainer.precision == "16-mixed":
        raise ConfigError("trainer.precision=16-mixed (loss scaling) is not supported with "
                          "strategy=fsdp yet: use bf16-mixed or strategy.param_dtype=bfloat16")
    check_device(cfg.strategy, device)
    find_blocks(model, cfg.strategy.blocks)


def startup_line(strategy: Strategy, section: StrategyConfig | None,
                 optimizer: torch.optim.Optimizer) -> str:
    """``strategy ddp: 388.1 MiB of parameters + gradients + optimizer state on this rank``."""
    extra = ""
    if strategy.name == "fsdp" and section is not None:
        extra = (f" (reshard_after_forward={section.reshard_after_forward}, param_dtype="
                 f"{section.param_dtype}, reduce_dtype={section.reduce_dtype}, "
                 f"activation_checkpointing={section.activation_checkpointing})")
    return (f"strategy {strategy.name}{extra}: {strategy.state_mb(optimizer):.1f} MiB of "
            "parameters + gradients + optimizer state on this rank")


def iter_fsdp(module: nn.Module) -> Iterator[nn.Module]:
    """The FSDP2-sharded modules under ``module`` (itself included), in module order."""
    from torch.distributed.fsdp import FSDPModule

    return (m for m in module.modules() if isinstance(m, FSDPModule))
