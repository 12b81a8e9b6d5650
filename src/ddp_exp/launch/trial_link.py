"""A plain run never links to an Optuna trial.

A ``hydra/sweeper=ddp_optuna`` trial's line shows its overrides with the link to its trial
(``++hydra.job.env_set.DDP_EXP_OPTUNA_TRIAL='0'``, ``..._STORAGE``, ``..._STUDY``:
:mod:`ddp_exp.job.pruning`). A user who copied that line to rerun the trial trained an epoch,
then failed with Optuna's ``UpdateFinishedTrialError`` ("Trial#0 has already finished") when
the run reported to the finished trial. Only the sweeper's jobs (a multirun) link to a trial:
:func:`refuse_trial_link_in_a_plain_run` refuses it in one line before any rank starts.

May use: :mod:`ddp_exp.job.pruning` (the link's variables), :mod:`ddp_exp.config`.
"""

from __future__ import annotations

import os

from ddp_exp.config.errors import ConfigError
from ddp_exp.job import pruning

LINK_VARIABLES = (pruning.ENV, pruning.ENV_STORAGE, pruning.ENV_STUDY)


def refuse_trial_link_in_a_plain_run(multirun: bool, overrides: list[str]) -> None:
    """Refuse a single run (not ``multirun``) whose environment links it to an Optuna trial.

    Args:
        multirun: the job is one of a sweep's (where the ddp_optuna sweeper sets the link).
        overrides: the command's overrides as typed (``hydra.overrides.task``): the line names
            the copied ``hydra.job.env_set`` ones, else the shell's variable.

    Raises:
        ConfigError: one line naming the trial and what to drop.
    """
    trial = os.environ.get(pruning.ENV)
    if multirun or not trial:
        return
    copied = [o for o in overrides if any(f"hydra.job.env_set.{v}=" in o for v in LINK_VARIABLES)]
    if copied:
        named = [o for o in copied if f"hydra.job.env_set.{pruning.ENV}=" in o]
        given = (named or copied)[0]
        fix = (f"drop the {len(copied)} ++hydra.job.env_set.DDP_EXP_OPTUNA_* override(s) "
               "copied from the trial's line and keep its parameters")
    else:
        given = f"the environment variable {pruning.ENV}={trial}"
        fix = f"unset {' '.join(LINK_VARIABLES)}"
    raise ConfigError(f"{given} links this run to trial {trial} of an Optuna study, which only "
                      f"a hydra/sweeper=ddp_optuna sweep's own jobs do (a finished trial takes "
                      f"no more reports): {fix}")
