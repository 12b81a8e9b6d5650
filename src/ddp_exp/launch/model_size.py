"""What a model's size implies, checked before it is built (issue 41 item 2): a model too large
for this machine is refused in one line instead of minutes of initialising memory the machine
does not have, or a rank killed by the kernel's OOM killer with no line at all.

ddp_exp's own models (``_target_`` under ``ddp_exp.``) are built once on the ``meta`` device (no
memory, no initialisation: milliseconds) and their parameters and buffers counted. A user's
``_target_`` is not: its constructor may download or read weights, and would then run twice.

The bound is a floor, not an estimate: the launching process holds one copy of the weights; on
the CPU each of the node's ranks holds its own copy and the gradients of the same size (every
trainable parameter gets a ``.grad`` at the first backward). Optimizer state, activations and the
allocator come on top, so a model refused here could never have trained.

May use: :mod:`ddp_exp.train.models`, :mod:`ddp_exp.config.errors`, torch.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

import torch

from ddp_exp.config.errors import ConfigError
from ddp_exp.train.models import build_model


def host_memory_bytes() -> int | None:
    """This machine's physical memory in bytes (``sysconf``), None where unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def model_bytes(node: dict[str, Any], input_shape: Sequence[int], num_outputs: int
                ) -> int | None:
    """Bytes of the parameters and buffers of ``node``'s model built on the ``meta`` device;
    None for a user's ``_target_`` or a model that cannot be built there (the real build then
    says what is wrong)."""
    if not str(node.get("_target_", "")).startswith("ddp_exp."):
        return None
    try:
        with torch.device("meta"):
            model = build_model(node, input_shape, num_outputs)
    except Exception:  # noqa: BLE001 - the real build reports it
        return None
    return sum(t.numel() * t.element_size()
               for t in itertools.chain(model.parameters(), model.buffers()))


def check_fits(node: dict[str, Any], input_shape: Sequence[int], num_outputs: int,
               ranks_on_host: int, device: str, memory: int | None = None) -> None:
    """Refuse a model whose weights (and, on the CPU, every rank's weights and gradients) exceed
    the machine's ``memory`` (bytes; default: :func:`host_memory_bytes`).

    Args:
        node: ``cfg.model`` as plain data.
        input_shape, num_outputs: the data's sizes, as :func:`build_model` takes them.
        ranks_on_host: ranks of this node (``world_size / launcher.nnodes``).
        device: ``cpu`` or ``cuda`` (resolved).

    Raises:
        ConfigError: one line with the model's size, the floor of what training needs and the
            machine's memory.
    """
    size = model_bytes(node, input_shape, num_outputs)
    memory = host_memory_bytes() if memory is None else memory
    if size is None or not memory:
        return
    copies = 1 + (2 * ranks_on_host if device == "cpu" else 0)
    if size * copies <= memory:
        return
    gib = 2.0 ** 30
    where = (f"{ranks_on_host} CPU rank(s) x (weights + gradients) + the launcher's copy"
             if device == "cpu" else "the launcher's copy on the host")
    raise ConfigError(f"model._target_={node['_target_']!r}: {size // 4:,} float32 values "
                      f"({size / gib:.1f} GiB) need at least {size * copies / gib:.1f} GiB "
                      f"({where}), and this machine has {memory / gib:.1f} GiB: make the model "
                      "smaller (model.* sizes)")
