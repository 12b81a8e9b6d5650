"""Hydra callbacks for tests, plugged in from the command line
(``+hydra.callbacks.<name>._target_=hydra_hooks.<Class>`` with this folder on PYTHONPATH)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SlowJobStart(Callback):
    """Holds job ``job`` (its ``hydra.job.num``; 0 for a single run) in Hydra's ``on_job_start``
    for ``seconds``: after Hydra made the job's folder, its log and ``.hydra/``, before the
    task runs. Touches ``$DDP_EXP_TEST_MARKER`` (outside the job folder) when it starts
    waiting, so that a test can signal the process inside that window."""

    def __init__(self, job: int = 0, seconds: float = 60.0):
        self.job, self.seconds = int(job), float(seconds)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        num = config.hydra.job.get("num")
        if int(num or 0) != self.job:
            return
        Path(os.environ["DDP_EXP_TEST_MARKER"]).touch()
        time.sleep(self.seconds)
