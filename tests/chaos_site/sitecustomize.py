"""Test-only kill points for a ``python -m ddp_exp`` started with this folder on PYTHONPATH
(``test_chaos_resume.py``). Nothing here runs unless ``DDP_EXP_TEST_CHAOS`` names a point,
``<name>:<n>``: the ``n``-th ``os.replace`` onto a file called ``<name>`` in this process (the
rename that puts a checkpoint, ``model.pt`` or ``metrics.json`` in place) touches
``$DDP_EXP_TEST_MARKER`` and waits there (up to 60 s) before it renames, so that the test's
SIGKILL to the process group lands exactly there: the temp file written, the rename not done.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

WAIT_S = 60.0


def _pause_before_replace(name: str, nth: int, marker: str) -> None:
    replace = os.replace
    seen = [0]

    def paused_replace(src, dst, *args, **kwargs):
        if os.path.basename(os.fspath(dst)) == name:
            seen[0] += 1
            if seen[0] == nth:
                Path(marker).touch()
                time.sleep(WAIT_S)
        return replace(src, dst, *args, **kwargs)

    os.replace = paused_replace


_point, _marker = os.environ.get("DDP_EXP_TEST_CHAOS"), os.environ.get("DDP_EXP_TEST_MARKER")
if _point and _marker:
    _name, _, _nth = _point.partition(":")
    _pause_before_replace(_name, int(_nth or 1), _marker)
