"""Beyond one launcher (issue 6): two "nodes" on loopback, the world-shape errors, submitit."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid

import pytest
import torch
from conftest import assert_no_orphans, cli_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_loopback_train_the_single_node_world(run_cli, tmp_path):
    """Two launcher processes (one rank each) meet through c10d rendezvous on loopback and
    train one world of 2: the same metrics and weights as world_size=2 on one node."""
    single = run_cli("world_size=2", "trainer.epochs=2", "print_config=false", job="single").ok()
    port, rdzv_id, tag = _free_port(), uuid.uuid4().hex, uuid.uuid4().hex
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "ddp_exp", "world_size=2", "launcher.nnodes=2",
               f"launcher.rdzv_endpoint=localhost:{port}", f"launcher.rdzv_id={rdzv_id}",
               "trainer.epochs=2", "print_config=false", f"hydra.run.dir={tmp_path}/node{node}"]
        # Each "node" believes it owns both cores: one thread each, as on separate machines.
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(tag, OMP_NUM_THREADS="1"),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, stdin=subprocess.DEVNULL))
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert_no_orphans(tag)
    written = [d for d in (tmp_path / "node0", tmp_path / "node1") if (d / "metrics.json").exists()]
    assert len(written) == 1  # the node that got rank 0 writes; the other writes nothing
    other = ({tmp_path / "node0", tmp_path / "node1"} - set(written)).pop()
    assert not (other / "tensorboard").exists() and not (other / "model.pt").exists()


    multi = json.loads((written[0] / "metrics.json").read_text())
    for key in ("train/loss", "val/loss", "val/accuracy", "global_step", "world_size"):
        assert multi[key] == pytest.approx(single.metrics[key], rel=1e-6), key
    a = torch.load(written[0] / "model.pt", weights_only=True)
    b = torch.load(single.job_dir / "model.pt", weights_only=True)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


@pytest.mark.parametrize(("overrides", "key"), [
    (["world_size=3", "launcher.nnodes=2"], "world_size"),
    (["world_size=2", "launcher.nnodes=2", "launcher.rdzv_endpoint=localhost:29400"],
     "launcher.rdzv_id"),
    (["world_size=2", "launcher.nnodes=2", "launcher.rdzv_id=x"], "launcher.rdzv_endpoint"),
    (["launcher.rdzv_endpoint=garbage"], "launcher.rdzv_endpoint"),
])
def test_world_shape_errors_fail_at_once(run_cli, overrides, key):
    """A world that cannot be laid out on the nodes fails before anything starts."""
    run = run_cli(*overrides)
    assert run.returncode == 2 and run.seconds < 10
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and key in lines[0], run.stderr
    assert not (run.job_dir / "tensorboard").exists()


@pytest.mark.slow
def test_submitit_local_sweep_completes(run_cli, tmp_path):
    """hydra/launcher=submitit_local: a 2-job sweep, each job a complete folder."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    run = run_cli("-m", "hydra/launcher=submitit_local", "world_size=2", "trainer.epochs=1",
                  "print_config=false", "data.batch_size=32,64", f"hydra.sweep.dir={sweep}",
                  run_dir=False, timeout=300).ok()
    for job, batch in (("0", 32), ("1", 64)):
        metrics = (sweep / job / "metrics.json").read_text()
        assert f'"batch_size": {batch}' in metrics
        assert len(list((sweep / job / "tensorboard").glob("events.out.tfevents*"))) == 1
        assert (sweep / job / "checkpoints" / "last.pt").exists()
    assert "completed" in (sweep / "summary.csv").read_text()
    assert run.returncode == 0
