"""The range checks of each config section: one function per section, over the section's
values (any mapping: a schema dataclass's ``vars``, or a plain dict). Each schema dataclass
runs its section's function in ``__post_init__``, so building the typed config
(``OmegaConf.to_object``, in :func:`ddp_exp.config.checks.validate`) checks every range;
validate runs the same function on a section that no dataclass holds (a user's own data or
model YAML, a scheduler target's own keys). Relations between keys are checked in
:mod:`ddp_exp.config.checks`, in one place.

A key that is absent, MISSING (``???``) or an unresolved interpolation is not checked here (a
dataclass built with its defaults holds those); validate checks presence.

Uses :mod:`ddp_exp.config.choices` and :mod:`ddp_exp.config.errors`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ddp_exp.config.choices import CLUSTERS, LR_SCALINGS, PRECISIONS, TASKS
from ddp_exp.config.errors import _check

MAX_MONITOR_INTERVAL_S = 3600.0  # the elastic agent's longest wait between two checks


def _given(values: Mapping[str, Any], key: str) -> bool:
    """``key`` is in ``values`` with a value to check: not ``???``, not ``${...}``."""
    if key not in values:
        return False
    value = values[key]
    return not (isinstance(value, str) and (value == "???" or "${" in value))


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def top(c: Mapping[str, Any]) -> None:
    """``world_size`` and ``seed``."""
    if _given(c, "world_size"):
        _check(c["world_size"] >= 1, "world_size", c["world_size"],
               "a positive integer (1, 2, 3, ...)")
    if _given(c, "seed"):
        _check(c["seed"] >= 0, "seed", c["seed"], "a non-negative integer")


def data(d: Mapping[str, Any]) -> None:
    """``data.*``: sizes, counts and the values a loader accepts."""
    for key in ("batch_size", "val_size", "num_workers"):  # untyped user YAML included
        if not _given(d, key) or (key == "val_size" and d[key] is None):  # tokens: ~10%
            continue
        _check(_integer(d[key]), f"data.{key}", d[key], "an integer")
    if _given(d, "batch_size"):
        _check(d["batch_size"] >= 1, "data.batch_size", d["batch_size"],
               "a positive integer (per rank)")
    cap = d.get("max_batch_size_per_rank")
    _check(cap is None or cap >= 1, "data.max_batch_size_per_rank", cap,
           "null (no cap) or a positive number of samples per rank")
    total = d.get("global_batch_size")
    _check(total is None or total >= 1, "data.global_batch_size", total,
           "null (data.batch_size per rank) or a positive number of samples per optimizer step")
    if _given(d, "val_size"):
        _check(d["val_size"] is None or d["val_size"] >= 0, "data.val_size", d["val_size"],
               "0 (no validation) or a positive count")
    if _given(d, "num_workers"):
        _check(d["num_workers"] >= 0, "data.num_workers", d["num_workers"],
               "0 or a positive integer")
    test_size = d.get("test_size", 0)
    _check(_integer(test_size) and test_size >= 0, "data.test_size", test_size,
           "0 (no test split) or a positive count")
    if "task" in d:
        _check(d["task"] in TASKS, "data.task", d["task"], f"one of {', '.join(TASKS)}")
    if "num_samples" in d:
        _check(d["num_samples"] >= 2, "data.num_samples", d["num_samples"], "an integer >= 2")
    if "num_features" in d:
        _check(d["num_features"] >= 1, "data.num_features", d["num_features"],
               "a positive integer")
    if d.get("num_classes") is not None:
        _check(d["num_classes"] != 1 and d["num_classes"] >= 0, "data.num_classes",
               d["num_classes"], "0 (regression) or an integer >= 2")
    if d.get("prefetch_factor") is not None:
        _check(d["prefetch_factor"] >= 1, "data.prefetch_factor", d["prefetch_factor"],
               "null (torch's default, 2) or a positive number of batches per worker")
    if "pin_memory" in d:
        _check(d["pin_memory"] in ("auto", True, False), "data.pin_memory", d["pin_memory"],
               "auto (on CUDA only), true or false")
    if "channels" in d:
        _check(d["channels"] in (1, 3), "data.channels", d["channels"], "1 (grey) or 3 (RGB)")
    if d.get("image_size") is not None:
        _check(d["image_size"] >= 1, "data.image_size", d["image_size"],
               "null (the files' size) or a positive side in pixels")


def model(m: Mapping[str, Any]) -> None:
    """``model.hidden_sizes``: positive widths (any model that has the key)."""
    if _given(m, "hidden_sizes"):
        sizes = list(m["hidden_sizes"])
        _check(all(s >= 1 for s in sizes), "model.hidden_sizes", sizes, "positive layer widths")


def optim(o: Mapping[str, Any]) -> None:
    """``optim.lr`` and ``optim.lr_scaling``."""
    if _given(o, "lr"):
        _check(math.isfinite(o["lr"]) and o["lr"] >= 0, "optim.lr", o["lr"],
               "a finite, non-negative learning rate")
    scaling = o.get("lr_scaling", "none")
    _check(scaling in LR_SCALINGS, "optim.lr_scaling", scaling,
           f"one of {', '.join(LR_SCALINGS)}")


def scheduler(s: Mapping[str, Any]) -> None:
    """The built-in schedules' ranges (and a user's target's keys of the same names); nothing
    without a ``_target_`` (``scheduler=none``: validate refuses any key it is given)."""
    if s.get("_target_") is None:
        return
    if "warmup_steps" in s:
        _check(s["warmup_steps"] >= 0, "scheduler.warmup_steps", s["warmup_steps"],
               "0 or a positive number of optimizer steps")
    if "min_lr" in s:
        _check(s["min_lr"] >= 0, "scheduler.min_lr", s["min_lr"], "a non-negative learning rate")
    if "step_size_epochs" in s:
        _check(s["step_size_epochs"] >= 1, "scheduler.step_size_epochs", s["step_size_epochs"],
               "a positive number of epochs")
    if "gamma" in s:
        _check(s["gamma"] > 0, "scheduler.gamma", s["gamma"], "a positive factor")


def trainer(t: Mapping[str, Any]) -> None:
    """``trainer.*``: counts, intervals, precision, clipping and the monitored metric's name."""
    _check(t["epochs"] >= 1, "trainer.epochs", t["epochs"], "a positive integer")
    for key in ("limit_val_batches", "peak_flops"):  # null: all batches / no perf/mfu
        _check(t.get(key) is None or t[key] > 0, f"trainer.{key}", t.get(key),
               "null or a positive number")
    _check(t.get("val_every_n_steps") is None or t["val_every_n_steps"] >= 1,
           "trainer.val_every_n_steps", t.get("val_every_n_steps"),
           "null (after each epoch) or a positive number of optimizer steps")
    _check(t.get("sample_every_n_epochs", 0) >= 0, "trainer.sample_every_n_epochs",
           t.get("sample_every_n_epochs"), "0 (never) or a positive number of epochs")
    _check(t["max_steps"] is None or t["max_steps"] >= 1, "trainer.max_steps", t["max_steps"],
           "null (no cap) or a positive integer")
    _check(t["log_every_n_steps"] >= 1, "trainer.log_every_n_steps", t["log_every_n_steps"],
           "a positive integer")
    _check(t["accumulate_grad_batches"] >= 1, "trainer.accumulate_grad_batches",
           t["accumulate_grad_batches"], "a positive integer")
    _check(t["checkpoint_every_n_epochs"] >= 0, "trainer.checkpoint_every_n_epochs",
           t["checkpoint_every_n_epochs"], "0 (never) or a positive number of epochs")
    for key, unit in (("checkpoint_every_n_steps", "optimizer steps"),
                      ("checkpoint_every_n_minutes", "minutes")):
        _check(t.get(key) is None or t[key] > 0, f"trainer.{key}", t.get(key),
               f"null (off) or a positive number of {unit}")
    _check(t["log_histograms_every_n_epochs"] >= 0, "trainer.log_histograms_every_n_epochs",
           t["log_histograms_every_n_epochs"], "0 (never) or a positive number of epochs")
    _check(t["keep_checkpoints"] >= 1, "trainer.keep_checkpoints", t["keep_checkpoints"],
           "a positive integer")
    _check(t["precision"] in PRECISIONS, "trainer.precision", t["precision"],
           f"one of {', '.join(PRECISIONS)}")
    clip = t["gradient_clip_val"]
    _check(clip is None or clip > 0, "trainer.gradient_clip_val", clip,
           "null (off) or a positive max L2 norm of the gradients")
    monitor = t["monitor"]
    _check(monitor is None or str(monitor).startswith("val/"), "trainer.monitor", monitor,
           "null or a validation metric: val/loss, val/accuracy, val/<metric>")
    patience = t["early_stopping_patience"]
    _check(patience is None or patience >= 1, "trainer.early_stopping_patience", patience,
           "null (off) or a positive number of epochs")


def distributed(d: Mapping[str, Any]) -> None:
    """``distributed.timeout_s``."""
    _check(d["timeout_s"] > 0, "distributed.timeout_s", d["timeout_s"],
           "a positive number of seconds")


def launcher(la: Mapping[str, Any]) -> None:
    """``launcher.*`` one key at a time (how they fit together: validate)."""
    _check(la["nnodes"] >= 1, "launcher.nnodes", la["nnodes"], "a positive integer")
    endpoint = la["rdzv_endpoint"]
    host, _, port = endpoint.rpartition(":")
    _check(bool(host) and port.isdigit() and int(port) < 65536, "launcher.rdzv_endpoint",
           endpoint, "HOST:PORT, e.g. 127.0.0.1:0 (port 0: a free port, one node only)")
    cluster = la["cluster"]
    _check(cluster is None or cluster in CLUSTERS, "launcher.cluster", cluster,
           f"null (nodes from the config) or one of {', '.join(CLUSTERS)}")
    _check(la["max_restarts"] >= 0, "launcher.max_restarts", la["max_restarts"], "0 or more")
    interval = la["monitor_interval_s"]
    _check(0 < interval <= MAX_MONITOR_INTERVAL_S, "launcher.monitor_interval_s", interval,
           f"seconds, > 0 and <= {MAX_MONITOR_INTERVAL_S:g}")
    _check(la["rdzv_timeout_s"] > 0, "launcher.rdzv_timeout_s", la["rdzv_timeout_s"],
           "a positive number of seconds")


def ddp(d: Mapping[str, Any]) -> None:
    """``ddp.bucket_cap_mb``."""
    _check(d["bucket_cap_mb"] > 0, "ddp.bucket_cap_mb", d["bucket_cap_mb"], "> 0 MiB")
