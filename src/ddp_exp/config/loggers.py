"""The ``logger`` config group's schema: which trackers receive rank 0's metrics.

``logger`` is a list of options, as lightning-hydra-template's ``many_loggers``: each option
(``conf/logger/<name>.yaml``) fills its own key, so ``logger=[tensorboard,csv,mlflow]`` (Hydra's
syntax for several options of one group) sets ``logger.tensorboard``, ``logger.csv`` and
``logger.mlflow`` and leaves the others null. :class:`LoggerConfig` types them; a tracker that is
null is off. What each tracker receives and where it writes: :mod:`ddp_exp.metrics.trackers`
and docs/trackers.md. Uses :mod:`ddp_exp.config.errors` (the range checks).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddp_exp.config.errors import _check

WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class TensorBoardLoggerConfig:
    """``logger=tensorboard``: ``<job>/tensorboard/``. The job folder's own event stream: it is
    written whatever the list says (resume, the HParams dashboard and ``ddp-exp runs`` read it)."""


@dataclass
class CSVLoggerConfig:
    """``logger=csv``: ``<job>/metrics.csv``, Lightning's CSVLogger layout (a ``step`` column
    and one per metric, sorted by name; a row per logged step)."""

    name: str = "metrics.csv"  # the file's name inside the job folder

    def __post_init__(self) -> None:
        _check(bool(self.name) and "/" not in self.name, "logger.csv.name", self.name,
               "a file name inside the job folder (no '/')")


@dataclass
class MLflowLoggerConfig:
    """``logger=mlflow``: one MLflow run per job (the ``mlflow`` extra)."""

    # null: sqlite:///<outputs>/mlflow.db, the `outputs` folder the job folder is under (else
    # the sweep's folder, or the job folder); or a server, http://host:5000
    tracking_uri: str | None = None
    experiment_name: str | None = None  # null: the experiment preset's name, else "ddp_exp"
    run_name: str | None = None  # null: the job folder's path under the store's folder

    def __post_init__(self) -> None:
        _check(self.experiment_name is None or bool(self.experiment_name.strip()),
               "logger.mlflow.experiment_name", self.experiment_name,
               "null (the experiment preset's name) or a non-empty name")


@dataclass
class WandbLoggerConfig:
    """``logger=wandb``: one W&B run per job (the ``wandb`` extra), offline by default
    (``wandb sync <job>/wandb/offline-run-*`` uploads it later)."""

    mode: str = "offline"  # offline | online (needs WANDB_API_KEY or `wandb login`) | disabled
    project: str | None = None  # null: as logger.mlflow.experiment_name
    entity: str | None = None  # the W&B team or user (online)
    run_name: str | None = None  # null: the job folder's path

    def __post_init__(self) -> None:
        _check(self.mode in WANDB_MODES, "logger.wandb.mode", self.mode,
               " | ".join(WANDB_MODES))


@dataclass
class LoggerConfig:
    """The trackers of a run: each a section, null when its option is not in the list."""

    tensorboard: TensorBoardLoggerConfig | None = None
    csv: CSVLoggerConfig | None = None
    mlflow: MLflowLoggerConfig | None = None
    wandb: WandbLoggerConfig | None = None


# The extra that installs each tracker's library (pyproject.toml), and the module it imports.
TRACKER_EXTRAS = {"mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}


@dataclass
class RecordConfig:
    """``record.*``: the reproducibility record ``<job>/run.json`` (:mod:`ddp_exp.job.record`)."""

    # false: each data file by size + modification time (instant); true: by a SHA-256 of its
    # content too (reads every byte once, in the launching process)
    hash_data: bool = False
