"""Test-only user code that marks the phase a CLI run has reached (with this folder on
PYTHONPATH; ``conftest.start_at_phase``): it touches ``$DDP_EXP_TEST_MARKER`` and waits there, so
that a test's signal lands inside that phase. The phases inside ddp_exp's own code (its imports,
the forks of the ranks) are marked by ``phase_site/sitecustomize.py``."""

from __future__ import annotations

import os
import time
from pathlib import Path

WAIT_S = 60.0


def slow_digits(**_options):
    """``data._target_`` that touches the marker, then waits up to 60 s before it loads the
    digits: the launcher is loading the data, and no rank exists yet."""
    from ddp_exp.data import load_digits

    Path(os.environ["DDP_EXP_TEST_MARKER"]).touch()
    time.sleep(WAIT_S)
    return load_digits()
