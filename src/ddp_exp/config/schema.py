"""The config schema: every key a user can set, its type, its default and its range.

Each config group's options are dataclasses here, plus the top-level :class:`Config`;
:data:`SCHEMAS` names them in Hydra's ConfigStore (group ``schema``, stored by
:func:`ddp_exp.config.compose.register_configs`). The YAML options of ``conf/`` extend them and
set only what differs: a default is written here once. Types are checked when Hydra composes
(a key whose values are names has an Enum of :mod:`ddp_exp.config.choices`); each section's
``__post_init__`` checks its ranges (:mod:`ddp_exp.config.ranges`) when
:func:`ddp_exp.config.checks.validate` builds the typed config, which then checks the relations
between keys. Uses :mod:`ddp_exp.config.choices`, :mod:`ddp_exp.config.ranges` and OmegaConf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, SI

from ddp_exp.config import choices, ranges
from ddp_exp.config.choices import CLUSTERS as CLUSTERS  # allowed values, as before the Enums
from ddp_exp.config.choices import SCHEDULER_INTERVALS as SCHEDULER_INTERVALS
from ddp_exp.config.loggers import LoggerConfig, RecordConfig
from ddp_exp.config.strategy import StrategyConfig


# ----------------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    """Keys every dataset has; ``_target_`` returns an :class:`ddp_exp.data.ArrayDataset`, a
    map-style dataset or a ``(train, val)`` pair of them (see :mod:`ddp_exp.data`)."""

    _target_: str = MISSING
    batch_size: int = 32  # per rank; the global batch is batch_size * world_size
    # samples per optimizer step over the world (null: data.batch_size per rank); set, it gives
    # data.batch_size and trainer.accumulate_grad_batches for each world size
    global_batch_size: int | None = None
    max_batch_size_per_rank: int | None = None  # with global_batch_size: the rest accumulates
    val_size: int = 297  # held-out validation samples, chosen by the top-level seed
    shuffle: bool = True
    num_workers: int = 0  # > 0 serves batches through torch's DataLoader with worker processes
    persistent_workers: bool | None = None  # null: true when num_workers > 0
    prefetch_factor: int | None = None  # batches each worker loads ahead (null: torch's 2)
    pin_memory: Any = "auto"  # auto (on CUDA only) | true | false
    test_size: int = 0  # held-out test samples, chosen by the seed alone (disjoint from val)

    def __post_init__(self) -> None:
        ranges.data(vars(self))


@dataclass
class DigitsDataConfig(DataConfig):
    _target_: str = "ddp_exp.data.load_digits"


@dataclass
class SyntheticDataConfig(DataConfig):
    _target_: str = "ddp_exp.data.make_synthetic"
    num_samples: int = 4096
    num_features: int = 32
    num_classes: int = 0  # 0: regression y = x @ w + noise; k > 0: k classes from a linear teacher
    noise_std: float = 0.1
    seed: int = SI("${seed}")
    val_size: int = 512


@dataclass
class FileDataConfig(DataConfig):
    _target_: str = "ddp_exp.data.load_file"
    path: str = MISSING
    task: str = "auto"  # auto: integer targets are class labels, anything else is regression
    val_size: int = 0
    standardize: bool = False  # (x - mean) / std per feature, statistics of the training split


@dataclass
class ImageFolderDataConfig(DataConfig):
    """``data=image_folder``: ``data.path/<class>/<image>`` (or its train/ and val/)."""

    _target_: str = "ddp_exp.data.images.load_image_folder"
    path: str = MISSING
    image_size: int | None = None  # side after resize + centre crop (null: the files' size)
    channels: int = 3  # 1 (grey) or 3 (RGB, as torchvision's loader)
    augment: bool = False  # training only: random rotation, shift and zoom; no flip (Kornia)
    mean: list[float] | None = None  # per-channel normalisation (null: none)
    std: list[float] | None = None
    transform: Any = None  # a _target_ node: the user's transform of each training sample
    val_size: int = 0
    num_workers: int = 2  # decoding processes per rank


@dataclass
class TorchDatasetConfig(DataConfig):
    """``data=dataset``: ``data._target_`` returns any map-style Dataset or a (train, val)
    pair; other keys given with ``+data.<key>=...`` are its arguments."""

    _target_: str = MISSING
    input_key: str | None = None  # items that are mappings: the input's key
    target_key: str | None = None  # ... and the target's key
    num_classes: int | None = None  # null: the dataset's `classes`, if it has them
    task: str = "auto"  # auto: integer targets are class labels, anything else is regression
    val_size: int = 0
    ignore_index: int = -100  # per-element labels (tokens, pixels) that count nowhere
    pad_value: float = 0  # inputs of different lengths are padded per batch with it
    shift_labels: bool = False  # predict label t+1 at position t (Hugging Face causal-LM labels)


@dataclass
class TokensDataConfig(DataConfig):
    """``data=tokens``: windows of a token stream (:mod:`ddp_exp.data.tokens`)."""

    _target_: str = "ddp_exp.data.tokens.load_tokens"
    path: str | None = None  # a .bin (data.dtype) or 1-D .npy of tokens; null: built-in corpus
    dtype: str = "uint16"  # a .bin's token type: uint16 | uint32
    vocab_size: int | None = None  # required for a file; the built-in corpus is bytes (256)
    block_size: int = 128  # tokens per window (the model's context)
    val_size: int | None = None  # held-out windows at the stream's tail (null: about 10%)
    batch_size: int = 16  # windows per rank


# ---------------------------------------------------------------------------------- model
@dataclass
class MLPConfig:
    _target_: str = "ddp_exp.train.models.MLP"
    hidden_sizes: list[int] = field(default_factory=lambda: [128])
    dropout: float = 0.0

    def __post_init__(self) -> None:
        ranges.model(vars(self))


@dataclass
class GPTConfig:
    """``model=gpt``: :class:`ddp_exp.train.gpt.GPT`; the vocabulary comes from the data, and
    the context too unless block_size is set."""

    _target_: str = "ddp_exp.train.gpt.GPT"
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128  # divisible by n_head
    dropout: float = 0.0
    bias: bool = True
    block_size: int | None = None  # longest sequence (positions); null: the data's item length


@dataclass
class CNNConfig:
    _target_: str = "ddp_exp.train.models.CNN"
    channels: list[int] = field(default_factory=lambda: [32, 64])
    hidden_size: int = 128
    batch_norm: bool = False  # BatchNorm2d after each convolution


@dataclass
class LinearConfig:
    _target_: str = "ddp_exp.train.models.Linear"


# ---------------------------------------------------------------------------------- optim
@dataclass
class OptimConfig:
    """Keys every optimizer has; ``lr_scaling`` and ``reference_batch_size`` are ours, the rest
    go to the ``_target_`` optimizer class."""

    _target_: str = MISSING
    _partial_: bool = True
    lr: float = MISSING  # base learning rate, at the reference global batch size
    lr_scaling: str = "none"  # none | linear | sqrt: scale lr by global batch / reference
    reference_batch_size: int = 64  # the global batch size at which lr is the base lr

    def __post_init__(self) -> None:
        ranges.optim(vars(self))


@dataclass
class SGDConfig(OptimConfig):
    _target_: str = "torch.optim.SGD"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    nesterov: bool = False


@dataclass
class AdamWConfig(OptimConfig):
    _target_: str = "torch.optim.AdamW"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01


# ------------------------------------------------------------------------------ scheduler
@dataclass
class SchedulerConfig:
    """Keys every scheduler has (see :mod:`ddp_exp.train.schedule`); ``_target_: null`` is none."""

    _target_: str | None = None  # a torch.optim.lr_scheduler class (or ours); null: constant lr
    interval: str = "step"  # step: once per optimizer step | epoch: once per epoch

    def __post_init__(self) -> None:
        ranges.scheduler(vars(self))


@dataclass
class CosineSchedulerConfig(SchedulerConfig):
    _target_: str | None = "ddp_exp.train.schedule.warmup_cosine"
    warmup_steps: int = 0  # optimizer steps of linear warmup
    min_lr: float = 0.0  # the learning rate of the run's last optimizer step


@dataclass
class StepSchedulerConfig(SchedulerConfig):
    _target_: str | None = "ddp_exp.train.schedule.step_decay"
    step_size_epochs: int = 30
    gamma: float = 0.1
    interval: str = "epoch"


# ------------------------------------------------------------------------- trainer & world
@dataclass
class TrainerConfig:
    epochs: int = 10
    max_steps: int | None = None  # stop after this many optimizer steps, even mid-epoch
    log_every_n_steps: int = 10
    accumulate_grad_batches: int = 1  # micro-batches per optimizer step (no_sync for all but last)
    precision: str = "32-true"  # 32-true | bf16-mixed | 16-mixed (CUDA only)
    compile: bool = False  # torch.compile the DDP model
    progress: choices.Progress = choices.Progress.auto  # auto: a bar on a terminal, else log lines
    save_last: bool = True  # checkpoints/last.pt after every epoch (resume, elastic restarts)
    checkpoint_every_n_epochs: int = 0  # also checkpoints/epoch_NNNN.pt every N epochs (0: never)
    checkpoint_every_n_steps: int | None = None  # checkpoints/last.pt mid-epoch too (null: off)
    checkpoint_every_n_minutes: float | None = None  # ... every N minutes, rank 0's clock
    keep_checkpoints: int = 3  # newest epoch_NNNN.pt files kept
    resume: str | None = None  # null | auto (this job's last.pt, if any) | a checkpoint path
    resume_allow_changes: bool = False  # resume even with another seed / data split
    # the scheduler's warning before it stops the job: a step checkpoint, status preempted and a
    # requeue (auto: USR1 under launcher.cluster=slurm, submitit's USR2 under submitit, else off)
    preempt_signal: str | None = "auto"
    perf_metrics: bool = True  # perf/* scalars: per-rank step timing, stragglers, memory
    log_histograms_every_n_epochs: int = 0  # parameter/gradient histograms (0: never)
    gradient_clip_val: float | None = None  # max global L2 norm of the gradients (null: off)
    monitor: str | None = "val/loss"  # reduced validation metric for best.pt / early stopping
    monitor_mode: choices.MonitorMode | None = None  # null: max for val/accuracy, else min
    early_stopping_patience: int | None = None  # epochs without improvement (null: off)
    test_weights: choices.ScoredWeights | None = None  # null: best when a monitor exists
    output_key: str = "logits"  # a model returning a mapping: the output's key
    # per-element labels [B, *dims]: logits [B, *dims, C] (last) or [B, C, *dims] (1)
    class_dim: str = "last"
    # validation on the first limit_val_batches global batches of samples (x the global batch:
    # batch_size x world_size x accumulate_grad_batches; the same set for any world size with
    # the same global batch; null: all of them)
    limit_val_batches: int | None = None
    peak_flops: float | None = None  # FLOP/s of one device: perf/mfu (data=tokens, model=gpt)
    sample_every_n_epochs: int = 1  # data=tokens: rank 0's text sample (TensorBoard, 0: never)
    sample_prompt: str = "The "  # ... continued from this prompt (the run's tokenizer)
    # validate every N global steps (best.pt, early stopping, pruning, samples follow); null:
    # after each epoch
    val_every_n_steps: int | None = None

    def __post_init__(self) -> None:
        ranges.trainer(vars(self))


@dataclass
class DistributedConfig:
    backend: choices.Backend = choices.Backend.auto  # set through the `backend` group
    timeout_s: float = 600.0  # collective timeout of the process group, seconds

    def __post_init__(self) -> None:
        ranges.distributed(vars(self))


@dataclass
class LauncherConfig:
    """The world's shape and how the elastic launcher starts it (torch.distributed.launcher.api)."""

    nnodes: int = 1
    max_restarts: int = 0
    rdzv_backend: choices.RdzvBackend = choices.RdzvBackend.c10d  # c10d | static
    rdzv_endpoint: str = "127.0.0.1:0"  # port 0: a free port chosen at launch (one node only)
    rdzv_id: str | None = None  # c10d: the same id on every node of a multi-node world
    node_rank: int | None = None  # static: this node's index, 0..nnodes-1 (node 0 hosts it)
    cluster: str | None = None  # null | submitit | slurm: nodes and rendezvous from the job
    rdzv_timeout_s: int = 900
    start_method: choices.StartMethod = choices.StartMethod.fork
    monitor_interval_s: float = 0.1  # seconds between the agent's checks of its ranks (torch's)

    def __post_init__(self) -> None:
        ranges.launcher(vars(self))


@dataclass
class DDPConfig:
    """Options passed to torch.nn.parallel.DistributedDataParallel."""

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    find_unused_parameters: bool = False
    sync_batchnorm: bool = False  # BatchNorm statistics over the world's global batch

    def __post_init__(self) -> None:
        ranges.ddp(vars(self))


@dataclass
class Config:
    data: Any = MISSING
    model: Any = MISSING
    optim: Any = MISSING
    scheduler: Any = None  # the scheduler group: none | cosine | step (or a _target_)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)  # the `logger` group's trackers
    record: RecordConfig = field(default_factory=RecordConfig)  # run.json
    strategy: StrategyConfig = field(default_factory=StrategyConfig)  # the strategy group
    loss: Any = None  # null: cross-entropy / MSE by task; or a _target_ per-sample loss
    metrics: Any = field(default_factory=dict)  # name -> _target_ per-sample validation metric
    world_size: int = 2  # total number of ranks
    device: choices.Device = choices.Device.auto  # auto | cpu | cuda (each rank on cuda:LOCAL_RANK)
    seed: int = 0
    print_config: bool = True

    def __post_init__(self) -> None:
        ranges.top(vars(self))


# Hydra's ConfigStore entries, (group under schema/, name, node): conf/<group>/<option>.yaml
# extends /schema/<group>/<name>; the primary config's defaults start with ddp_exp_schema.
SCHEMAS = [
    ("data", "digits", DigitsDataConfig),
    ("data", "synthetic", SyntheticDataConfig),
    ("data", "file", FileDataConfig),
    ("data", "image_folder", ImageFolderDataConfig),
    ("data", "dataset", TorchDatasetConfig),
    ("data", "tokens", TokensDataConfig),
    ("data", "base", DataConfig),
    ("model", "mlp", MLPConfig),
    ("model", "cnn", CNNConfig),
    ("model", "gpt", GPTConfig),
    ("model", "linear", LinearConfig),
    ("optim", "sgd", SGDConfig),
    ("optim", "adamw", AdamWConfig),
    ("optim", "base", OptimConfig),
    ("scheduler", "none", SchedulerConfig),
    ("scheduler", "cosine", CosineSchedulerConfig),
    ("scheduler", "step", StepSchedulerConfig),
    ("trainer", "default", TrainerConfig),
    ("launcher", "local", LauncherConfig),
]
# Schemas that a user's own ``_target_`` extends (``conf/data/dataset.yaml``, a user's data YAML
# over ``/schema/data/base``): stored as nodes that take the target's own arguments as extra keys
# (:func:`ddp_exp.config.compose.open_node`), their fields still typed.
OPEN_SCHEMAS = (("data", "dataset"), ("data", "base"))
