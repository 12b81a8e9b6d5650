"""Each tracker's run ids in the job folder (``trackers.json``), so a resume reopens its run.

Read by the sinks (:mod:`ddp_exp.metrics.mlflow_sink`, :mod:`ddp_exp.metrics.wandb_sink`) and by
:mod:`ddp_exp.metrics.trackers`; a module of its own so that none of them imports another.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from ddp_exp.io.files import atomic_write, read_json

RECORD = "trackers.json"  # each tracker's run id, in the job folder


def read_record(job_dir: str) -> dict[str, Any]:
    """``<job_dir>/trackers.json``: tracker name -> its run's ids (empty without one)."""
    record = read_json(os.path.join(job_dir, RECORD))
    return record if isinstance(record, dict) else {}


def write_record(job_dir: str, name: str, ids: Mapping[str, Any]) -> None:
    """Set tracker ``name``'s entry of ``<job_dir>/trackers.json`` (atomically)."""
    record = read_record(job_dir)
    record[name] = dict(ids)
    text = json.dumps(record, indent=2, sort_keys=True) + "\n"
    atomic_write(os.path.join(job_dir, RECORD), lambda fh: fh.write(text.encode()))
