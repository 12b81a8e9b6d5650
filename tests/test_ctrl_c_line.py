"""A Ctrl-C during training ends with one line of ours (issue 41 item 4): torch's elastic
agent's "Received 2 death signal, shutting down workers" warning no longer precedes
``interrupted (SIGINT)`` (``ddp_exp.compat.messages.DEATH_SIGNAL``)."""

from __future__ import annotations

import inspect
import json
import os
import signal
import sys
import uuid

import pytest
from helpers import QUIET, assert_no_orphans, start_watched


@pytest.mark.slow
def test_ctrl_c_while_training_prints_our_line_alone(tmp_path):
    tag, job = uuid.uuid4().hex, tmp_path / "run"
    watched = start_watched([sys.executable, "-m", "ddp_exp", "world_size=2",
                             "trainer.epochs=1000", QUIET, f"hydra.run.dir={job}"],
                            tmp_path, tag, "epoch 1/1000")
    try:
        assert watched.seen.wait(120), watched.text
        os.killpg(watched.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole group
        watched.proc.wait(timeout=90)
    finally:
        if watched.proc.poll() is None:
            os.killpg(watched.proc.pid, signal.SIGKILL)
    watched.reader.join(10)
    out = watched.text
    assert watched.proc.returncode == 130, out
    assert "death signal" not in out, out
    assert out.strip().splitlines()[-1] == "interrupted (SIGINT)", out
    assert json.loads((job / "status.json").read_text())["status"] == "interrupted"
    assert_no_orphans(tag)


def test_contract_torchs_agent_says_death_signal_in_these_words():
    """The record the filter hides, as torch 2.13's agent logs it."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    from ddp_exp.compat import messages

    assert f'"{messages.DEATH_SIGNAL} death signal' not in inspect.getsource(
        SimpleElasticAgent.run)  # the constant is the template's start, not doubled
    assert f'"{messages.DEATH_SIGNAL}, shutting down workers"' in inspect.getsource(
        SimpleElasticAgent.run)
    assert messages.agent_closing_process("Received %s death signal, shutting down workers")
