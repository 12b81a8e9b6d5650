"""ddp_exp: Hydra-configured experiments with PyTorch DistributedDataParallel.

The packages follow the pipeline, each importing only those below it (checked by
``make lint``, :mod:`tests.test_layers`): :mod:`ddp_exp.cli` > ``hydra_plugins`` (the sweeper
the entry registers) > :mod:`ddp_exp.launch` >
:mod:`ddp_exp.rank` > :mod:`ddp_exp.train` > :mod:`ddp_exp.metrics` > :mod:`ddp_exp.data` |
:mod:`ddp_exp.job` > :mod:`ddp_exp.distributed` > :mod:`ddp_exp.io` > :mod:`ddp_exp.config` >
:mod:`ddp_exp.compat`.

Module paths of the flat layout before version 0.4 (``ddp_exp.models.MLP``,
``ddp_exp.jobdir.NewFoldersCallback``, ...) still import, as the modules that replaced them:
configs in users' hands name them in ``_target_`` keys.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

#: Old flat module -> the module that replaced it. Old names that are now packages
#: (``ddp_exp.config``, ``ddp_exp.launch``, ``ddp_exp.train``, ``ddp_exp.metrics``,
#: ``ddp_exp.distributed``) cannot be aliased; no ``_target_`` named them.
OLD_PATHS = {
    "ddp_exp.models": "ddp_exp.train.models",
    "ddp_exp.gpt": "ddp_exp.train.gpt",
    "ddp_exp.objective": "ddp_exp.train.objective",
    "ddp_exp.optimizer": "ddp_exp.train.optimizer",
    "ddp_exp.schedule": "ddp_exp.train.schedule",
    "ddp_exp.monitor": "ddp_exp.train.monitor",
    "ddp_exp.evaluation": "ddp_exp.train.evaluation",
    "ddp_exp.train_state": "ddp_exp.train.state",
    "ddp_exp.sync_batchnorm": "ddp_exp.distributed.sync_batchnorm",
    "ddp_exp.batches": "ddp_exp.data.batches",
    "ddp_exp.confusion": "ddp_exp.metrics.confusion",
    "ddp_exp.dashboard": "ddp_exp.metrics.dashboard",
    "ddp_exp.lm": "ddp_exp.metrics.lm",
    "ddp_exp.perf": "ddp_exp.metrics.perf",
    "ddp_exp.progress": "ddp_exp.metrics.progress",
    "ddp_exp.train_loss": "ddp_exp.metrics.train_loss",
    "ddp_exp.jobdir": "ddp_exp.job.folder",
    "sweep": "ddp_exp.job.sweep",
    "ddp_exp.pruning": "ddp_exp.job.pruning",
    "ddp_exp.earlier_run": "ddp_exp.job.earlier_run",
    "ddp_exp.files": "ddp_exp.io.files",
    "ddp_exp.checkpoint": "ddp_exp.io.checkpoint",
    "ddp_exp.schema": "ddp_exp.config.schema",
    "ddp_exp.build": "ddp_exp.launch.build",
    "ddp_exp.cluster": "ddp_exp.launch.cluster",
    "ddp_exp.rendezvous": "ddp_exp.launch.rendezvous",
    "ddp_exp.user_input": "ddp_exp.launch.user_input",
    "ddp_exp.worker": "ddp_exp.rank.worker",
    "ddp_exp.failures": "ddp_exp.rank.failures",
    "ddp_exp.usage": "ddp_exp.cli.usage",
}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path (:data:`OLD_PATHS`) as the module that replaced it: the same
    module object, so ``ddp_exp.models.MLP is ddp_exp.train.models.MLP``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in OLD_PATHS:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(OLD_PATHS[spec.name])

    def exec_module(self, module):
        pass  # already executed under its own name


if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
    sys.meta_path.append(_OldPaths())
