"""The keys whose values are names (``backend``, ``device``, ``launcher.start_method``,
``launcher.rdzv_backend``, ``trainer.progress``, ``trainer.monitor_mode``,
``trainer.test_weights``): an Enum each, which the schema's fields take as their type, so that
OmegaConf refuses any other value when it composes the config (it matches a member by its
name); and :func:`refused_choice`, the one line the entry point prints for that refusal, the
line :func:`ddp_exp.config.checks.validate` printed when these keys were plain strings.

Uses nothing of ddp_exp but :mod:`ddp_exp.config.errors`.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

# Keys whose values stay strings (not identifiers, or open to more), and what they accept:
# checked by ddp_exp.config.ranges and ddp_exp.config.checks.
TASKS = ("auto", "classification", "regression")  # data.task
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")  # trainer.precision
LR_SCALINGS = ("none", "linear", "sqrt")  # optim.lr_scaling
CLUSTERS = ("submitit", "slurm")  # launcher.cluster: where nodes and the rendezvous come from
SCHEDULER_INTERVALS = ("step", "epoch")  # scheduler.interval


class Choice(str, Enum):
    """One of a few names. Each member's value is its name, and a member is a ``str``: it
    compares equal to its name (``Backend.gloo == "gloo"``), hashes, prints, formats and
    serialises (JSON, YAML through OmegaConf) as that name, so code that reads the config
    sees the plain value it saw when the key was a string."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Backend(Choice):
    """``distributed.backend`` (set through the ``backend`` group)."""

    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


class Device(Choice):
    """``device``: auto | cpu | cuda (each rank on cuda:LOCAL_RANK)."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class StartMethod(Choice):
    """``launcher.start_method``: how the elastic agent starts its ranks."""

    fork = "fork"
    forkserver = "forkserver"
    spawn = "spawn"


class RdzvBackend(Choice):
    """``launcher.rdzv_backend``: c10d (elastic, needs rdzv_id) | static (needs node_rank)."""

    c10d = "c10d"
    static = "static"


class Progress(Choice):
    """``trainer.progress``: auto (a bar on a terminal, else log lines) | bar | log | off."""

    auto = "auto"
    bar = "bar"
    log = "log"
    off = "off"


class MonitorMode(Choice):
    """``trainer.monitor_mode``: whether the monitored metric is better lower or higher."""

    min = "min"
    max = "max"


class ScoredWeights(Choice):
    """``trainer.test_weights``: the weights the test split scores, best.pt's or the last."""

    best = "best"
    last = "last"


def _one_of(choice: type[Choice]) -> str:
    return f"one of {', '.join(choice.__members__)}"


# full key -> (the key as the refusal names it, its Enum, what is valid): the words
# ddp_exp.config.checks.validate used for these keys before they were Enums.
REFUSALS: dict[str, tuple[str, type[Choice], str]] = {
    "device": ("device", Device, _one_of(Device)),
    "distributed.backend": ("backend", Backend, _one_of(Backend)),
    "launcher.start_method": ("launcher.start_method", StartMethod, _one_of(StartMethod)),
    "launcher.rdzv_backend": ("launcher.rdzv_backend", RdzvBackend,
                              "c10d (elastic: nodes join by launcher.rdzv_id) or static (fixed "
                              "launcher.node_rank)"),
    "trainer.progress": ("trainer.progress", Progress, _one_of(Progress)),
    "trainer.monitor_mode": ("trainer.monitor_mode", MonitorMode,
                             "null (from the metric) or one of min, max"),
    "trainer.test_weights": ("trainer.test_weights", ScoredWeights,
                             "null (best when a monitor exists), best or last"),
}


def refused_choice(error: BaseException) -> str | None:
    """The one line for OmegaConf's refusal of a value that names no member of a key's Enum
    (``device=gpu``: ``device='gpu' is invalid: one of auto, cpu, cuda``); None for any other
    error. A YAML file's unquoted ``off`` (or ``on``, ``yes``, ``no``) is a boolean to YAML: the
    line says to quote it.

    Args:
        error: the exception OmegaConf raised (a ``ValidationError`` with ``full_key`` and
            ``value``), as Hydra's composition error carries it as its cause.
    """
    from omegaconf.errors import ValidationError

    entry = REFUSALS.get(str(getattr(error, "full_key", "")))
    if not isinstance(error, ValidationError) or entry is None:
        return None
    key, choice, valid = entry
    value: Any = getattr(error, "value", None)
    line = f"{key}={'null' if value is None else repr(str(value))} is invalid: {valid}"
    word = next((m for m in choice.__members__ if m in YAML_BOOLEANS), None)
    if isinstance(value, bool) and word:  # trainer.progress: off in a YAML file
        line += f" (YAML reads an unquoted {word} as {str(value).lower()}: write '{word}')"
    return line


YAML_BOOLEANS = ("off", "on", "yes", "no", "y", "n")  # YAML 1.1 booleans, as OmegaConf loads them
