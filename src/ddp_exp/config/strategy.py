"""The ``strategy`` config group: how the model is replicated or sharded over the world.

* ``strategy=ddp`` (the default): every rank holds the whole model, gradients and optimizer
  state; ``DistributedDataParallel`` all-reduces the gradients (``ddp.*`` keys).
* ``strategy=fsdp``: FSDP2's ``torch.distributed.fsdp.fully_shard`` shards parameters,
  gradients and optimizer state over the world (each block, then the root;
  :mod:`ddp_exp.train.strategy` builds it).

The keys below are read by ``fsdp`` only. Ranges are checked here (``__post_init__``); the
checks that need the model or the device are :func:`ddp_exp.train.strategy.check_model` and
:func:`check_device`.

Uses :mod:`ddp_exp.config.errors`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ddp_exp.config.errors import ConfigError

STRATEGIES = ("ddp", "fsdp")
DTYPES = ("float32", "bfloat16", "float16")  # FSDP2 MixedPrecisionPolicy dtypes, by name
CHECKPOINTS = ("sharded", "full")  # strategy.checkpoint
MMAP_THRESHOLD_MAX = 32 * 2 ** 20  # glibc's ceiling for it on 64-bit (mallopt(3))


@dataclass
class StrategyConfig:
    """``strategy.*``.

    Attributes:
        name: ``ddp`` | ``fsdp``.
        reshard_after_forward: fsdp: free each block's gathered parameters after its forward
            (all-gather them again for backward: less memory, one more all-gather per block).
        param_dtype: fsdp: the dtype the gathered parameters compute in (``bfloat16``), null:
            the parameters' own (float32). The sharded parameters and the optimizer stay float32.
        reduce_dtype: fsdp: the dtype gradients are reduce-scattered in; null: ``param_dtype``.
        activation_checkpointing: fsdp: recompute each block's activations in backward.
        blocks: fsdp: the modules sharded one by one (each its own all-gather): class names
            (``Block``) or module-path patterns (``blocks.*``, fnmatch); null: the model's
            ``fsdp_blocks()`` if it has one (``model=gpt``: its transformer blocks), else each
            top-level child that holds parameters.
        checkpoint: how checkpoints hold the model and optimizer: ``full`` (one file, the
            plain state dicts gathered to rank 0; ddp's only kind) or ``sharded`` (fsdp's
            default: a folder in which every rank writes its own shard with
            ``torch.distributed.checkpoint``; :mod:`ddp_exp.io.sharded`). Both resume at any
            world size under either strategy.
        malloc_trim: fsdp, CPU: give the heap's free pages back to the system after each
            optimizer step (glibc's ``malloc_trim(0)``): the buffers FSDP frees every step
            otherwise stay in the rank's RSS (:mod:`ddp_exp.compat.glibc_malloc`; on by default:
            the peak RSS under DDP's, for ~11% of tokens/s on the CPU). Not glibc, or a GPU:
            nothing.
        malloc_mmap_threshold: fsdp: glibc's ``M_MMAP_THRESHOLD`` fixed for each rank, bytes
            (tensors at least this large are mapped on their own and given back on ``free``):
            left to glibc (null, the default) it rises to the size of the buffers FSDP frees
            every step and the heap keeps the smaller freed tensors' pages, so RSS grows above
            the live memory. 131072 (128 KiB) gives them back, at the price of a page fault per
            4 KiB of every large tensor each step (:mod:`ddp_exp.compat.glibc_malloc`).
            0 to 32 MiB, or null.
    """

    name: str = "ddp"
    reshard_after_forward: bool = True
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    activation_checkpointing: bool = False
    blocks: list[str] | None = field(default=None)
    checkpoint: str = "full"
    malloc_trim: bool = True
    malloc_mmap_threshold: int | None = None

    def __post_init__(self) -> None:
        check_ranges(vars(self))


def check_ranges(values: Mapping[str, Any]) -> None:
    """Range-check a ``strategy`` section (any mapping).

    Raises:
        ConfigError: an unknown strategy name or dtype, naming the key and what is valid.
    """
    name = values.get("name", "ddp")
    if name not in STRATEGIES:
        raise ConfigError(f"strategy={name!r} is not a strategy: one of {', '.join(STRATEGIES)}")
    kind = values.get("checkpoint", "full")
    if kind not in CHECKPOINTS:
        raise ConfigError(f"strategy.checkpoint={kind!r} is not a checkpoint kind: one of "
                          f"{', '.join(CHECKPOINTS)}")
    if kind == "sharded" and name != "fsdp":
        raise ConfigError(f"strategy.checkpoint=sharded needs strategy=fsdp (under "
                          f"strategy={name} every rank holds the same full state): set "
                          "strategy.checkpoint=full")
    threshold = values.get("malloc_mmap_threshold")
    if threshold is not None and not (isinstance(threshold, int) and not isinstance(threshold, bool)
                                      and 0 <= threshold <= MMAP_THRESHOLD_MAX):
        raise ConfigError(f"strategy.malloc_mmap_threshold={threshold!r} is invalid: bytes from 0 "
                          f"to {MMAP_THRESHOLD_MAX} (32 MiB, glibc's ceiling), or null (glibc's "
                          "dynamic threshold)")
    for key in ("param_dtype", "reduce_dtype"):
        dtype = values.get(key)
        if dtype is not None and dtype not in DTYPES:
            raise ConfigError(f"strategy.{key}={dtype!r} is not a dtype FSDP takes: one of "
                              f"{', '.join(DTYPES)}, or null")


def check_device(cfg: StrategyConfig, device: str) -> None:
    """Refuse what the resolved device cannot run under ``strategy=fsdp``: float16 parameters
    on the CPU (no float16 GEMM kernels worth the name; use bfloat16).

    Raises:
        ConfigError: naming the key.
    """
    if cfg.name != "fsdp":
        return
    for key in ("param_dtype", "reduce_dtype"):
        if getattr(cfg, key) == "float16" and device != "cuda":
            raise ConfigError(f"strategy.{key}=float16 needs device=cuda (this run is on "
                              f"{device}): use bfloat16 or null on the CPU")
