"""Runs under torchrun, and torchrun's leftovers: variables left in a shell by an earlier torchrun
experiment launch the CLI's own world, a rank under torchrun needs the agent's run id, and the
wait of a torchrun rank (or a paused world) is bounded by and names ``distributed.timeout_s``.
"""

from __future__ import annotations

import os
from pathlib import Path

from helpers import QUIET


def test_leftover_torchrun_variables_launch_its_own_world(run_cli):
    """A shell left with an earlier torchrun's rank variables (no ``TORCHELASTIC_RUN_ID``, which
    every torchrun rank has): the run waited ``distributed.timeout_s`` for a rank 1 that never
    came; now it launches its own world at once and says in one line what it ignored."""
    from helpers import free_port

    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    run = run_cli("trainer.epochs=1", QUIET, "distributed.timeout_s=15", env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert ("warning: ignored RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: set, but "
            "no torchrun started this command") in run.stderr
    assert run.metrics["world_size"] == 2  # its own world, with rank 0 reporting
    assert (run.job_dir / "status.json").exists()


def test_under_torchrun_needs_the_agents_run_id(monkeypatch):
    from ddp_exp.launch.torchrun_env import ignore_leftover_torchrun_variables, under_torchrun

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"),
                       ("MASTER_PORT", "29500")):
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not under_torchrun()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert under_torchrun()
    assert ignore_leftover_torchrun_variables() == []  # a real torchrun rank keeps them
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert ignore_leftover_torchrun_variables() == ["RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                    "MASTER_PORT"]
    assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ


def test_a_torchrun_ranks_wait_names_distributed_timeout_s(monkeypatch, compose):
    """Under torchrun a rank waits for its peers ``distributed.timeout_s``: the line said
    ``launcher.rdzv_timeout_s`` / ``launcher.rdzv_endpoint``, which bound nothing there."""
    from torch.distributed import DistStoreError

    from ddp_exp.cli.errors import rendezvous_line

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"),
                       ("TORCHELASTIC_RUN_ID", "abc")):
        monkeypatch.setenv(key, value)
    line = rendezvous_line(DistStoreError("Timed out after 601 seconds waiting for clients"),
                           compose("distributed.timeout_s=30"))
    assert "within distributed.timeout_s=30 s" in line and "127.0.0.1:29500" in line, line
    assert "launcher." not in line and "\n" not in line, line


def test_the_troubleshooting_table_says_how_long_a_paused_world_may_wait():
    """A world stopped with Ctrl-Z for longer than ``distributed.timeout_s`` dies on resume
    with gloo's "Timed out waiting ... for recv": the README's troubleshooting table names
    the key that sets the bound."""

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("## Troubleshooting", 1)[1].split("\n## ", 1)[0]
    [row] = [ln for ln in table.splitlines() if "Ctrl-Z" in ln]
    assert "Timed out waiting" in row and "distributed.timeout_s" in row, row
