"""Test-only phase markers for a ``python -m ddp_exp`` started with this folder on PYTHONPATH
(Python imports ``sitecustomize`` at start-up; see ``conftest.PHASE_SITE``). Nothing here runs
unless ``DDP_EXP_TEST_PHASE`` names a phase. At that phase the process touches
``$DDP_EXP_TEST_MARKER`` and waits there (up to 60 s), so that a test's signal lands inside the
phase, not at a moment a sleep guessed:

- ``import``: the entry point imports torch (after ``ddp_exp.cli.entry`` set its import-time
  SIGINT handler, before Hydra runs): the first look-up of ``torch`` by the import system waits;
- ``fork``: the launcher has forked the second of its ranks (``launcher.start_method=fork``:
  an ``os.register_at_fork`` hook in the launching process, while
  ``ddp_exp.compat.elastic_agent.start_ranks_safely`` holds signals back). It waits until the agent
  has noted a
  signal (``ddp_exp.compat.elastic_agent._held``), then touches ``$DDP_EXP_TEST_MARKER.held``: the
  proof that
  the signal came inside the fork window.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

WAIT_S = 60.0


def _touch(path: str) -> None:
    Path(path).touch()


class _WaitWhileTorchImports:
    """A meta path finder that finds nothing: the first look-up of ``torch`` touches the marker
    and waits, inside ddp_exp's own imports."""

    def __init__(self, marker: str):
        self.marker, self.done = marker, False

    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not self.done:
            self.done = True
            _touch(self.marker)
            time.sleep(WAIT_S)
        return None


def _wait_after_the_second_rank_fork(marker: str) -> None:
    forks = [0]

    def after_fork_in_parent() -> None:
        agent = sys.modules.get("ddp_exp.compat.elastic_agent")
        if agent is None or agent.FORK_GATE_ENV not in os.environ:  # not a rank's fork
            return
        forks[0] += 1
        if forks[0] != 2:
            return
        _touch(marker)
        deadline = time.monotonic() + WAIT_S
        while not agent._held and time.monotonic() < deadline:
            time.sleep(0.01)  # the agent's handler runs between two of these
        if agent._held:
            _touch(marker + ".held")

    os.register_at_fork(after_in_parent=after_fork_in_parent)


_phase, _marker = os.environ.get("DDP_EXP_TEST_PHASE"), os.environ.get("DDP_EXP_TEST_MARKER")
if _phase == "import" and _marker:
    sys.meta_path.insert(0, _WaitWhileTorchImports(_marker))
elif _phase == "fork" and _marker:
    _wait_after_the_second_rank_fork(_marker)
