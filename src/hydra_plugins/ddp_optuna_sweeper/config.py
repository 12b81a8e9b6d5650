"""The config of ``hydra/sweeper=ddp_optuna`` (registered in Hydra's ConfigStore on import).

Keys (``hydra.sweeper.<key>``): ``params`` (Hydra's sweep grammar: ``choice(...)``,
``range(...)``, ``interval(...)``, ``tag(log, interval(...))``), ``n_trials``, ``n_jobs``,
``sampler`` (``name``: tpe | random | grid, ``seed``), ``pruner`` (``name``: none | median |
successive_halving | hyperband and their main options), ``direction`` (minimize | maximize;
null: from ``trainer.monitor`` / ``trainer.monitor_mode``), ``study_name`` and ``storage`` (null:
an Optuna journal file ``optuna_journal.log`` in the sweep folder).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional  # noqa: UP035 (OmegaConf's dataclass annotations)

from hydra.core.config_store import ConfigStore


@dataclass
class SamplerConf:
    name: str = "tpe"  # tpe | random | grid
    seed: Optional[int] = None  # noqa: UP045


@dataclass
class PrunerConf:
    name: str = "none"  # none | median | successive_halving | hyperband
    # median: trials before pruning starts, epochs before a trial can be pruned
    n_startup_trials: int = 5
    n_warmup_steps: int = 0
    # successive_halving (ASHA) and hyperband: the first rung's epochs and the rungs' ratio
    min_resource: Optional[int] = None  # noqa: UP045 (null: 1)
    reduction_factor: Optional[int] = None  # noqa: UP045 (null: 4 (ASHA), 3 (hyperband))
    min_early_stopping_rate: int = 0  # successive_halving only
    max_resource: Optional[int] = None  # noqa: UP045 (hyperband; null: trainer.epochs)


@dataclass
class DDPOptunaSweeperConf:
    _target_: str = "hydra_plugins.ddp_optuna_sweeper.sweeper.DDPOptunaSweeper"
    sampler: SamplerConf = field(default_factory=SamplerConf)
    pruner: PrunerConf = field(default_factory=PrunerConf)
    direction: Optional[str] = None  # noqa: UP045
    study_name: Optional[str] = None  # noqa: UP045
    storage: Optional[str] = None  # noqa: UP045
    n_trials: int = 20
    n_jobs: int = 1
    params: Dict[str, Any] = field(default_factory=dict)  # noqa: UP006


ConfigStore.instance().store(group="hydra/sweeper", name="ddp_optuna",
                             node=DDPOptunaSweeperConf, provider="ddp_exp")
