"""What a job folder holds of a run's outputs (:func:`earlier_outputs`), read by the folder's
lock (:mod:`ddp_exp.job.lock`: a refused run keeps the folder's record where an earlier run's
outputs are) and by :mod:`ddp_exp.job.earlier_run` (whether a new run may start there). Below
both, so that neither imports the other (the circle ``folder`` -> ``lock`` -> ``earlier_run`` ->
``folder``, issue 42 item 5). A temp file (``.<name>.<tag>.tmp``) is never an output.

May use: nothing of ddp_exp.
"""

from __future__ import annotations

import os


def earlier_outputs(job_dir: str) -> list[str]:
    """What an earlier run left in ``job_dir``: ``metrics.json``, checkpoints, event files. A
    temp file (``.last.pt.<tag>.tmp``, left by a writer killed mid-write) is not an output."""
    found = [name for name in ("metrics.json", "model.pt")
             if os.path.isfile(os.path.join(job_dir, name))]
    for sub, pattern in (("checkpoints", ".pt"), ("tensorboard", "tfevents")):
        folder = os.path.join(job_dir, sub)
        if any(pattern in f and not is_temp(f) for f in names_in(folder)):
            found.append(f"{sub}/")
    return found


def names_in(folder: str) -> list[str]:
    """``os.listdir(folder)``; empty when there is no such folder (under torchrun, rank 0 may
    be deleting a killed attempt's folders while another rank looks)."""
    try:
        return os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []


def is_temp(name: str) -> bool:
    """A temp file of :func:`ddp_exp.io.files.atomic_write` (``.<name>.<random>.tmp``)."""
    return name.startswith(".") and name.endswith(".tmp")
