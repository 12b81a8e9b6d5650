"""Checks and derived values of a composed config, run once before any rank starts:
:func:`validate` checks ranges and relations of the composed config (types were checked by
OmegaConf at composition); :func:`effective_lr`, :func:`global_batch_size` and
:func:`ranks_per_node` are the values derived from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ddp_exp.config import schema
from ddp_exp.config.compose import group_options
from ddp_exp.config.errors import ConfigError, _check

OPTIM_OWN_KEYS = ("lr_scaling", "reference_batch_size")  # not arguments of the optimizer


def effective_lr(cfg: Mapping[str, Any]) -> float:
    """The learning rate the optimizer gets: ``optim.lr`` scaled by ``k = global batch /
    optim.reference_batch_size``: times k (``linear``, Goyal et al. 2017, "Accurate, Large
    Minibatch SGD"), times sqrt(k) (``sqrt``, Krizhevsky 2014 / Hoffer et al. 2017), or not."""
    optim = cfg["optim"]
    rule = optim.get("lr_scaling", "none")
    if rule == "none":
        return float(optim["lr"])
    k = global_batch_size(cfg) / optim["reference_batch_size"]
    return float(optim["lr"]) * (k if rule == "linear" else k ** 0.5)


def global_batch_size(cfg: Mapping[str, Any]) -> int:
    """Samples per optimizer step over the world:
    ``data.batch_size x world_size x trainer.accumulate_grad_batches``."""
    return (cfg["data"]["batch_size"] * cfg["world_size"]
            * cfg["trainer"]["accumulate_grad_batches"])


def batch_layout(global_batch: int, world_size: int, max_per_rank: int | None
                 ) -> tuple[int, int]:
    """``data.global_batch_size`` on ``world_size`` ranks: ``(per-rank micro-batch,
    accumulated micro-batches)``, the micro-batch the largest divisor of ``global_batch /
    world_size`` within ``max_per_rank`` (None: no cap), so that their product times the world
    is the global batch exactly. ``global_batch`` must be a multiple of ``world_size``
    (:func:`validate` refuses it otherwise)."""
    share = global_batch // world_size
    if max_per_rank is None or share <= max_per_rank:
        return share, 1
    accumulate = -(-share // max_per_rank)
    while share % accumulate:
        accumulate += 1
    return share // accumulate, accumulate


def apply_global_batch(cfg: Any, world_size: int) -> None:
    """With ``data.global_batch_size`` set, write the per-rank ``data.batch_size`` and
    ``trainer.accumulate_grad_batches`` that give it on ``world_size`` ranks
    (:func:`batch_layout`) into ``cfg`` (a DictConfig or plain dicts); without it, nothing.
    Called where the world's size is known: before any rank starts, and by a rank that finds
    itself in a world of another size (an elastic restart)."""
    data = cfg["data"]
    if data.get("global_batch_size") is None:
        return
    per_rank, accumulate = batch_layout(data["global_batch_size"], world_size,
                                        data.get("max_batch_size_per_rank"))
    data["batch_size"] = per_rank
    cfg["trainer"]["accumulate_grad_batches"] = accumulate


# ------------------------------------------------------------------------------ validation
MAX_MONITOR_INTERVAL_S = 3600.0  # the elastic agent's longest wait between two checks


def validate(cfg: DictConfig) -> None:
    """Check ranges and relations of a composed config (types were checked by OmegaConf).

    Raises:
        ConfigError: one line naming the first offending key and what would be valid.
    """
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        key = missing[0]
        if key == "data.path":
            hint = ("a folder <class>/<image> of images" if "image" in str(cfg.data._target_)
                    else "a .pt, .npz or .csv file of features and targets")
        elif key == "data._target_":
            hint = "a function or class returning a map-style Dataset"
        else:  # a group deleted with ~data: its options, as for a group given null
            options = group_options(key)
            hint = f"one of {', '.join(options)}" if options else "a value"
        raise ConfigError(f"{key} is required but was not set: add {key}=... ({hint})")

    known = {f.name for f in dataclasses.fields(schema.Config)}
    for key in cfg:
        _check(key in known, str(key), cfg[key], f"not a ddp_exp key (top-level keys: "
               f"{', '.join(sorted(known))})")
    for f in dataclasses.fields(schema.Config):  # typed nodes: a +key=... typo is no new key
        node_schema = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(node_schema) and f.name in cfg:
            keys = [k.name for k in dataclasses.fields(node_schema)]
            for key in cfg[f.name]:
                _check(key in keys, f"{f.name}.{key}", cfg[f.name][key],
                       f"not a key of {f.name} (its keys: {', '.join(keys)})")
    _check(cfg.world_size >= 1, "world_size", cfg.world_size, "a positive integer (1, 2, 3, ...)")
    _check(cfg.seed >= 0, "seed", cfg.seed, "a non-negative integer")
    d = cfg.data
    for key in ("_target_", "batch_size", "val_size", "shuffle", "num_workers"):
        _check(key in d, f"data.{key}", None,
               "every data config needs it (extend schema/data/base)")
    for key in ("batch_size", "val_size", "num_workers"):  # untyped user YAML included
        value = d[key]
        if key == "val_size" and value is None:  # data=tokens: about 10% of the stream
            continue
        _check(isinstance(value, int) and not isinstance(value, bool), f"data.{key}", value,
               "an integer")
    _check(d.batch_size >= 1, "data.batch_size", d.batch_size, "a positive integer (per rank)")
    _check_global_batch(cfg)
    _check(d.val_size is None or d.val_size >= 0, "data.val_size", d.val_size,
           "0 (no validation) or a positive count")
    _check(d.num_workers >= 0, "data.num_workers", d.num_workers, "0 or a positive integer")
    test_size = d.get("test_size", 0)
    _check(isinstance(test_size, int) and not isinstance(test_size, bool) and test_size >= 0,
           "data.test_size", test_size, "0 (no test split) or a positive count")
    if "task" in d:
        _check(d.task in schema.TASKS, "data.task", d.task, f"one of {', '.join(schema.TASKS)}")
    if "num_samples" in d:
        _check(d.num_samples >= 2, "data.num_samples", d.num_samples, "an integer >= 2")
    if "num_features" in d:
        _check(d.num_features >= 1, "data.num_features", d.num_features, "a positive integer")
    if d.get("num_classes") is not None:
        _check(d.num_classes != 1 and d.num_classes >= 0, "data.num_classes", d.num_classes,
               "0 (regression) or an integer >= 2")
    if d.get("prefetch_factor") is not None:
        _check(d.prefetch_factor >= 1, "data.prefetch_factor", d.prefetch_factor,
               "null (torch's default, 2) or a positive number of batches per worker")
        _check(d.num_workers > 0, "data.prefetch_factor", d.prefetch_factor,
               "null with data.num_workers=0 (no workers load ahead; torch refuses it too)")
    if "pin_memory" in d:
        _check(d.pin_memory in ("auto", True, False), "data.pin_memory", d.pin_memory,
               "auto (on CUDA only), true or false")
    if "channels" in d:
        _check(d.channels in (1, 3), "data.channels", d.channels, "1 (grey) or 3 (RGB)")
    if d.get("image_size") is not None:
        _check(d.image_size >= 1, "data.image_size", d.image_size,
               "null (the files' size) or a positive side in pixels")

    _check("_target_" in cfg.model, "model._target_", None, "a model class, e.g. model=mlp")
    if "hidden_sizes" in cfg.model:
        sizes = list(cfg.model.hidden_sizes)
        _check(all(s >= 1 for s in sizes), "model.hidden_sizes", sizes, "positive layer widths")
    _check("lr" in cfg.optim and cfg.optim.lr >= 0, "optim.lr", cfg.optim.get("lr"),
           "a non-negative learning rate")
    scaling = cfg.optim.get("lr_scaling", "none")
    _check(scaling in schema.LR_SCALINGS, "optim.lr_scaling", scaling,
           f"one of {', '.join(schema.LR_SCALINGS)}")
    if scaling != "none":
        ref = cfg.optim.get("reference_batch_size")
        _check(isinstance(ref, int) and ref >= 1, "optim.reference_batch_size", ref,
               "a positive global batch size")

    t = cfg.trainer
    _check(t.epochs >= 1, "trainer.epochs", t.epochs, "a positive integer")
    for key in ("limit_val_batches", "peak_flops"):  # null: all batches / no perf/mfu
        _check(t.get(key) is None or t[key] > 0, f"trainer.{key}", t.get(key),
               "null or a positive number")
    _check(t.get("sample_every_n_epochs", 0) >= 0, "trainer.sample_every_n_epochs",
           t.get("sample_every_n_epochs"), "0 (never) or a positive number of epochs")
    _check(t.max_steps is None or t.max_steps >= 1, "trainer.max_steps", t.max_steps,
           "null (no cap) or a positive integer")
    _check(t.log_every_n_steps >= 1, "trainer.log_every_n_steps", t.log_every_n_steps,
           "a positive integer")
    _check(t.accumulate_grad_batches >= 1, "trainer.accumulate_grad_batches",
           t.accumulate_grad_batches, "a positive integer")
    _check(t.checkpoint_every_n_epochs >= 0, "trainer.checkpoint_every_n_epochs",
           t.checkpoint_every_n_epochs, "0 (never) or a positive number of epochs")
    for key, unit in (("checkpoint_every_n_steps", "optimizer steps"),
                      ("checkpoint_every_n_minutes", "minutes")):
        _check(t.get(key) is None or t[key] > 0, f"trainer.{key}", t.get(key),
               f"null (off) or a positive number of {unit}")
    _check(t.log_histograms_every_n_epochs >= 0, "trainer.log_histograms_every_n_epochs",
           t.log_histograms_every_n_epochs, "0 (never) or a positive number of epochs")
    _check(t.keep_checkpoints >= 1, "trainer.keep_checkpoints", t.keep_checkpoints,
           "a positive integer")
    _check(t.progress in schema.PROGRESS_MODES, "trainer.progress", t.progress,
           f"one of {', '.join(schema.PROGRESS_MODES)}")
    _check(t.precision in schema.PRECISIONS, "trainer.precision", t.precision,
           f"one of {', '.join(schema.PRECISIONS)}")
    _validate_recipe(cfg)

    _check(cfg.device in schema.DEVICES, "device", cfg.device,
           f"one of {', '.join(schema.DEVICES)}")
    dist = cfg.distributed
    _check(dist.backend in schema.BACKENDS, "backend", dist.backend,
           f"one of {', '.join(schema.BACKENDS)}")
    _check(dist.timeout_s > 0, "distributed.timeout_s", dist.timeout_s,
           "a positive number of seconds")

    la = cfg.launcher
    _check(la.nnodes >= 1, "launcher.nnodes", la.nnodes, "a positive integer")
    _check(cfg.world_size % la.nnodes == 0, "world_size", cfg.world_size,
           f"a multiple of launcher.nnodes={la.nnodes} (the same number of ranks on every node)")
    host, _, port = la.rdzv_endpoint.rpartition(":")
    _check(bool(host) and port.isdigit() and int(port) < 65536, "launcher.rdzv_endpoint",
           la.rdzv_endpoint, "HOST:PORT, e.g. 127.0.0.1:0 (port 0: a free port, one node only)")
    _check(la.rdzv_backend in schema.RDZV_BACKENDS, "launcher.rdzv_backend", la.rdzv_backend,
           "c10d (elastic: nodes join by launcher.rdzv_id) or static (fixed launcher.node_rank)")
    _check(la.cluster is None or la.cluster in schema.CLUSTERS, "launcher.cluster", la.cluster,
           f"null (nodes from the config) or one of {', '.join(schema.CLUSTERS)}")
    # As composed, a cluster preset leaves node_rank to each task of the job
    # (ddp_exp.launch.cluster).
    filled_per_task = la.cluster is not None and la.node_rank is None
    if la.rdzv_backend == "static" and not filled_per_task:
        _check(la.node_rank is not None and 0 <= la.node_rank < la.nnodes, "launcher.node_rank",
               la.node_rank, f"this node's index, 0..{la.nnodes - 1}, with rdzv_backend=static")
        _check(int(port) > 0, "launcher.rdzv_endpoint", la.rdzv_endpoint,
               "HOST:PORT of node 0 with a fixed port every node can reach, with "
               "rdzv_backend=static")
    elif la.rdzv_backend == "c10d":
        _check(la.node_rank is None, "launcher.node_rank", la.node_rank,
               "null with rdzv_backend=c10d (it numbers the nodes itself); add "
               "launcher.rdzv_backend=static to fix each node's rank")
    if la.nnodes > 1 and la.rdzv_backend == "c10d":
        _check(bool(la.rdzv_id), "launcher.rdzv_id", la.rdzv_id,
               "a job id shared by every node, required when launcher.nnodes > 1")
        _check(int(port) > 0, "launcher.rdzv_endpoint", la.rdzv_endpoint,
               "HOST:PORT of the rendezvous with a fixed port every node can reach, when "
               "launcher.nnodes > 1")
    _check(la.max_restarts >= 0, "launcher.max_restarts", la.max_restarts, "0 or more")
    _check(la.start_method in schema.START_METHODS, "launcher.start_method", la.start_method,
           f"one of {', '.join(schema.START_METHODS)}")
    _check(0 < la.monitor_interval_s <= MAX_MONITOR_INTERVAL_S, "launcher.monitor_interval_s",
           la.monitor_interval_s, f"seconds, > 0 and <= {MAX_MONITOR_INTERVAL_S:g}")
    _check(la.rdzv_timeout_s > 0, "launcher.rdzv_timeout_s", la.rdzv_timeout_s,
           "a positive number of seconds")
    _check(cfg.ddp.bucket_cap_mb > 0, "ddp.bucket_cap_mb", cfg.ddp.bucket_cap_mb, "> 0 MiB")


def _validate_recipe(cfg: DictConfig) -> None:
    """The recipe keys (issue 15) that need no data: clipping, monitor, patience, test weights,
    the scheduler's own ranges. What needs the data's size or metrics is checked by the
    build step (``ddp_exp.launch.build.prepare``)."""
    t = cfg.trainer
    clip = t.gradient_clip_val
    _check(clip is None or clip > 0, "trainer.gradient_clip_val", clip,
           "null (off) or a positive max L2 norm of the gradients")
    _check(t.monitor is None or str(t.monitor).startswith("val/"), "trainer.monitor", t.monitor,
           "null or a validation metric: val/loss, val/accuracy, val/<metric>")
    _check(t.monitor_mode is None or t.monitor_mode in schema.MONITOR_MODES, "trainer.monitor_mode",
           t.monitor_mode, "null (from the metric) or one of min, max")
    patience = t.early_stopping_patience
    _check(patience is None or patience >= 1, "trainer.early_stopping_patience", patience,
           "null (off) or a positive number of epochs")
    _check(patience is None or t.monitor is not None, "trainer.early_stopping_patience",
           patience, "needs trainer.monitor (early stopping watches the monitored metric)")
    _check(t.test_weights is None or t.test_weights in schema.TEST_WEIGHTS, "trainer.test_weights",
           t.test_weights, "null (best when a monitor exists), best or last")
    _check(t.test_weights != "best" or t.monitor is not None, "trainer.test_weights",
           t.test_weights, "best needs trainer.monitor (which epoch is best); or last")
    s = cfg.get("scheduler") or {}
    _check_scheduler_keys(s)
    if s.get("_target_") is None:
        return
    _check(s.get("interval") in schema.SCHEDULER_INTERVALS, "scheduler.interval", s.get("interval"),
           f"one of {', '.join(schema.SCHEDULER_INTERVALS)}")
    if "warmup_steps" in s:
        _check(s.warmup_steps >= 0, "scheduler.warmup_steps", s.warmup_steps,
               "0 or a positive number of optimizer steps")
    if "min_lr" in s:
        _check(s.min_lr >= 0, "scheduler.min_lr", s.min_lr, "a non-negative learning rate")
    if "step_size_epochs" in s:
        _check(s.step_size_epochs >= 1, "scheduler.step_size_epochs", s.step_size_epochs,
               "a positive number of epochs")
    if "gamma" in s:
        _check(s.gamma > 0, "scheduler.gamma", s.gamma, "a positive factor")


def _check_scheduler_keys(s: Mapping[str, Any]) -> None:
    """Refuse a ``scheduler.*`` key that the chosen scheduler does not use, rather than ignore
    it: with ``scheduler=none`` (no ``_target_``: a constant learning rate, nothing is stepped)
    any key that differs from the schema's default (``scheduler.interval=batch``,
    ``+scheduler.warmup_steps=5``), with ``cosine`` or ``step`` a key outside its schema
    (:data:`ddp_exp.config.schema.SCHEMAS`). A user's own ``_target_`` receives the keys as its
    arguments and rejects unknown ones when built.

    Raises:
        ConfigError: naming the first such key.
    """
    target = s.get("_target_")
    ours = [(name, {f.name: f.default for f in dataclasses.fields(node)})
            for group, name, node in schema.SCHEMAS if group == "scheduler"]
    found = [(name, defaults) for name, defaults in ours if defaults["_target_"] == target]
    if not found:
        return
    name, defaults = found[0]
    for key in s:
        if target is None:
            unused = key != "_target_" and (key not in defaults or s.get(key) != defaults[key])
            _check(not unused, f"scheduler.{key}", s.get(key), "scheduler=none (a constant "
                   "learning rate) uses no scheduler key; choose a schedule: scheduler=cosine|step")
        else:
            keys = ", ".join(k for k in defaults if k != "_target_")
            _check(key in defaults, f"scheduler.{key}", s.get(key),
                   f"not a key of scheduler={name} (its keys: {keys})")


def check_precision(precision: str, device: str) -> None:
    """``16-mixed`` needs CUDA (fp16 autocast with loss scaling); bf16 autocast runs on CPU
    and GPU.

    Args:
        precision: ``trainer.precision``.
        device: the resolved device type, ``cpu`` or ``cuda``.

    Raises:
        ConfigError: 16-mixed on the CPU.
    """
    if precision == "16-mixed" and device != "cuda":
        raise ConfigError("trainer.precision=16-mixed needs device=cuda; use bf16-mixed or "
                          "32-true on the CPU")


def _check_global_batch(cfg: DictConfig) -> None:
    """``data.global_batch_size`` (null, or a positive multiple of ``world_size``) and
    ``data.max_batch_size_per_rank`` (null or positive); with a global batch, the
    accumulation is derived, so ``trainer.accumulate_grad_batches`` must be left at 1."""
    d, world = cfg.data, cfg.world_size
    cap = d.get("max_batch_size_per_rank")
    _check(cap is None or cap >= 1, "data.max_batch_size_per_rank", cap,
           "null (no cap) or a positive number of samples per rank")
    total = d.get("global_batch_size")
    if total is None:
        return
    _check(total >= 1, "data.global_batch_size", total,
           "null (data.batch_size per rank) or a positive number of samples per optimizer step")
    lower, upper = total // world * world, -(-total // world) * world
    _check(total % world == 0, "data.global_batch_size", total,
           f"a multiple of world_size={world} (every rank takes an equal share), e.g. "
           f"{lower or upper}" + (f" or {upper}" if lower and upper != lower else ""))
    _check(cfg.trainer.accumulate_grad_batches == 1, "trainer.accumulate_grad_batches",
           cfg.trainer.accumulate_grad_batches,
           "1 with data.global_batch_size set (the accumulation follows from "
           "data.max_batch_size_per_rank)")
