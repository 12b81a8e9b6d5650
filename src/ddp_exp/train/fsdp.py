"""``strategy=fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) behind the loop's
:class:`ddp_exp.train.strategy.Strategy` interface.

Build (torchtitan's order): the model on the ``meta`` device, per-block activation checkpointing,
``fully_shard`` on each block then the root over a 1-D device mesh of the world, ``to_empty``,
then each parameter's shard filled with its slice of the seeded full tensor. What stays exact,
and why:

* Accumulation: earlier micro-batches run under ``set_requires_gradient_sync(False)`` (FSDP2's
  ``no_sync``: unsharded gradients accumulate locally; the last micro-batch reduce-scatters the
  sum), with the loop's own loss weights, so per-token means are the global ones.
* Clipping: the global L2 norm of the sharded (DTensor) gradients, each rank's partial sum of
  squares all-reduced (``torch.nn.utils.get_total_norm`` then ``full_tensor``), then
  ``clip_grads_with_norm_``: the same rule as ``clip_grad_norm_`` under DDP.
* Evaluation: every block gathered once before the pass and kept gathered through it
  (``unshard`` with ``reshard_after_forward`` off), so the forwards run no collective and
  uneven validation shards cannot hang; the pass holds the full parameters (not gradients or
  optimizer state) while it runs.
* Checkpoints and ``model.pt``: full state dicts (``torch.distributed.checkpoint.state_dict``,
  ``full_state_dict=True, cpu_offload=True``: rank 0 holds the gathered tensors), the optimizer's
  in the plain parameter-id layout of ``optimizer.state_dict()``: a DDP checkpoint resumes under
  FSDP and back, at any world size.

Uses :mod:`ddp_exp.config`, :mod:`ddp_exp.train.models`, :mod:`ddp_exp.train.optimizer` and
:mod:`ddp_exp.train.strategy`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

from ddp_exp.compat.glibc_malloc import set_mmap_threshold, trim
from ddp_exp.config.strategy import StrategyConfig
from ddp_exp.config.view import RankConfig
from ddp_exp.train.models import build_model
from ddp_exp.train.optimizer import OptimizerStep
from ddp_exp.train.strategy import Strategy, find_blocks, iter_fsdp

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 holds the result
FULL_LOAD = StateDictOptions(full_state_dict=True)  # every rank holds the full state


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def checkpointed(block: nn.Module) -> None:
    """Recompute ``block``'s activations in backward (``torch.utils.checkpoint``, non-reentrant),
    keeping its parameter names (no wrapper module: state dicts are unchanged)."""
    forward = block.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = run


def shard_model(model: nn.Module, section: StrategyConfig, device: torch.device,
                world_size: int) -> dict[nn.Module, bool]:
    """``fully_shard`` each block of ``model`` (:func:`ddp_exp.train.strategy.find_blocks`), then
    the root, over a 1-D mesh of ``world_size`` ranks on ``device``'s type; in place. Returns
    each sharded module's ``reshard_after_forward`` (``strategy.reshard_after_forward``, but
    for the last block, which keeps its parameters gathered)."""
    mesh = init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=_dtype(section.param_dtype),
                                  reduce_dtype=_dtype(section.reduce_dtype))
    blocks = find_blocks(model, section.blocks)
    flags: dict[nn.Module, bool] = {}
    for i, block in enumerate(blocks):
        if section.activation_checkpointing:
            checkpointed(block)
        # The last block's backward runs first, right after the forward: resharding it would
        # free parameters only to all-gather them again at once (torchtitan keeps it too).
        reshard = section.reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        flags[block] = reshard
    fully_shard(model, mesh=mesh, reshard_after_forward=section.reshard_after_forward,
                mp_policy=policy)
    flags[model] = section.reshard_after_forward
    return flags


@torch.no_grad()
def fill_from(model: nn.Module, source: nn.Module) -> None:
    """Give the materialised, sharded ``model`` the values of the unsharded ``source`` (same
    architecture): each parameter's local shard is its slice of the full tensor, cut locally
    (``distribute_tensor(..., src_data_rank=None)``: no collective), one parameter at a time;
    buffers (not sharded) are copied whole."""
    full = dict(source.named_parameters())
    for name, param in model.named_parameters():
        value = full[name].detach()
        if isinstance(param, DTensor):
            local = distribute_tensor(value.to(param.device), param.device_mesh,
                                      param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(value)
    buffers = dict(source.named_buffers())
    for name, buffer in model.named_buffers():
        buffer.copy_(buffers[name])


class FSDPOptimizerStep(OptimizerStep):
    """:class:`ddp_exp.train.optimizer.OptimizerStep` over sharded gradients: the global norm is
    the all-reduced sum of every rank's shard's squares (one all-reduce), then the same
    clipping rule as ``clip_grad_norm_``. With ``release`` (``strategy.malloc_trim`` on a CPU
    device), the heap's free pages go back to the system after the step
    (:func:`ddp_exp.compat.glibc_malloc.trim`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: Any, clip: float | None,
                 params: list[torch.nn.Parameter], release: bool = False):
        super().__init__(optimizer, scaler, clip, params)
        self.release = release

    def step(self, measure_norm: bool) -> torch.Tensor | None:
        norm = None
        if self.clip is not None or measure_norm:
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                norm = torch.nn.utils.get_total_norm(grads)
                if isinstance(norm, DTensor):
                    norm = norm.full_tensor()
                if self.clip is not None:
                    torch.nn.utils.clip_grads_with_norm_(self.params, self.clip, norm)
        self.optimizer.step()
        if self.release:
            trim()
        return norm


class FSDPStrategy(Strategy):
    """FSDP2 over the world (see the module docstring).

    Args:
        cfg: the run's typed config (``cfg.targets.model`` is rebuilt on ``meta``).
        section: ``strategy.*``.
        source: the seeded, unsharded model the launching process built: read, never copied.
        device: this rank's device.
        input_shape, num_outputs: the dataset's sizes, as :func:`build_model` takes them.
    """

    name = "fsdp"
    states_still_until_step = False  # its full states are gathers (collectives)

    def __init__(self, cfg: RankConfig, section: StrategyConfig, source: nn.Module,
                 device: torch.device, input_shape: Any, num_outputs: int):
        self.section = section
        set_mmap_threshold(section.malloc_mmap_threshold)  # before the shards are allocated
        # The CPU's heap (glibc's malloc); a GPU's memory is the CUDA caching allocator's.
        self.release_freed_pages = section.malloc_trim and device.type == "cpu"
        with torch.device("meta"):
            model = build_model(cfg.targets.model, input_shape, num_outputs)
        self.reshard_after_forward = shard_model(model, section, device, cfg.world_size)
        model.to_empty(device=device)
        fill_from(model, source)
        self.module = self.wrapped = model
        self.fsdp_modules = list(iter_fsdp(model))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        for m in self.fsdp_modules:
            m.set_reshard_after_forward(False, recurse=False)
        for m in self.fsdp_modules:
            m.unshard()
        try:
            yield
        finally:
            for m in self.fsdp_modules:
                m.reshard()
                m.set_reshard_after_forward(self.reshard_after_forward[m], recurse=False)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, scaler: Any,
                       clip: float | None) -> OptimizerStep:
        params = [p for p in self.module.parameters() if p.requires_grad]
        return FSDPOptimizerStep(optimizer, scaler, clip, params, self.release_freed_pages)

    def model_state(self) -> dict[str, Any]:
        return get_model_state_dict(self.module, options=FULL)

    def load_model_state(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.module, state, options=FULL_LOAD)

    def load_from_main(self, state: dict[str, Any]) -> None:
        """Load the full ``state`` rank 0 holds (others pass ``{}``): each rank receives its
        shards by broadcast (``broadcast_from_rank0``)."""
        set_model_state_dict(self.module, state, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))

    def _fqns(self, optimizer: torch.optim.Optimizer) -> list[list[str]]:
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The full optimizer state in ``optimizer.state_dict()``'s layout (parameter ids in
        param-group order), not DCP's parameter names; rank 0 holds it, others an empty dict."""
        state = get_optimizer_state_dict(self.module, optimizer, options=FULL)
        if not state:
            return {}
        ids, groups = {}, []
        for group, fqns in zip(state["param_groups"], self._fqns(optimizer), strict=True):
            start = len(ids)
            ids.update({fqn: start + i for i, fqn in enumerate(fqns)})
            groups.append({**group, "params": [ids[f] for f in fqns]})
        return {"state": {ids[fqn]: s for fqn, s in state["state"].items()},
                "param_groups": groups}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
                             ) -> None:
        """Load a plain optimizer ``state_dict`` (parameter ids) that every rank holds."""
        fqns = [f for group in self._fqns(optimizer) for f in group]
        if len(state["param_groups"]) != len(optimizer.param_groups) or any(
                len(g["params"]) != len(o["params"])
                for g, o in zip(state["param_groups"], optimizer.param_groups, strict=True)):
            raise ValueError("the checkpoint's optimizer has other parameter groups")
        named = {"state": {fqns[i]: s for i, s in state["state"].items()},
                 "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]}
                                  for g in state["param_groups"]]}
        set_optimizer_state_dict(self.module, optimizer, named, options=FULL_LOAD)

