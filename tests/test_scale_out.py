"""Beyond one launcher (issue 6): two "nodes" on loopback, the world-shape errors, submitit."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid

import pytest
import torch
from helpers import (
    HANG_S,
    QUIET,
    assert_no_orphans,
    cli_env,
    free_port,
    refused_before_ranks,
    start_cli,
)

from ddp_exp.config.errors import ConfigError


def _start_two_nodes(tmp_path, rendezvous: str, *node_overrides: list[str]
                     ) -> tuple[list[int], list[str]]:
    """Start two launcher processes ("nodes", one rank each) on loopback at once; returns
    their exit codes and outputs. ``node_overrides[i]``: extra overrides for node i."""
    port, rdzv_id, tag = free_port(), uuid.uuid4().hex, uuid.uuid4().hex
    procs = []
    for node in range(2):
        join = ([f"launcher.rdzv_id={rdzv_id}"] if rendezvous == "c10d" else
                ["launcher.rdzv_backend=static", f"launcher.node_rank={node}"])
        extra = [o.format(port=port) for o in
                 (node_overrides[node] if node < len(node_overrides) else [])]
        cmd = [sys.executable, "-m", "ddp_exp", "world_size=2", "launcher.nnodes=2",
               f"launcher.rdzv_endpoint=localhost:{port}", *join,
               "trainer.epochs=2", "print_config=false", f"hydra.run.dir={tmp_path}/node{node}",
               *extra]
        # Each "node" believes it owns both cores: one thread each, as on separate machines.
        procs.append(start_cli(cmd, tmp_path, cli_env(tag, OMP_NUM_THREADS="1")))
    try:
        outputs = ["".join(p.communicate(timeout=HANG_S)) for p in procs]
    finally:
        for p in procs:  # a hang fails the test, and leaves no process behind
            p.kill()
    assert_no_orphans(tag)
    return [p.returncode for p in procs], outputs


@pytest.mark.slow
@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
@pytest.mark.float_sensitive
def test_two_nodes_on_loopback_train_the_single_node_world(default_run_2_epochs, tmp_path,
                                                           rendezvous):
    """Two launcher processes (one rank each) meet on loopback, through c10d rendezvous (an id,
    ranks numbered by the rendezvous) or the static one (fixed node ranks, torchrun's
    --node-rank), and train one world of 2: the same metrics and weights as world_size=2 on one
    node (the session's world_size=2, 2-epoch run)."""
    single = default_run_2_epochs
    codes, outputs = _start_two_nodes(tmp_path, rendezvous)
    assert codes == [0, 0], outputs
    assert all("waiting for 2 node(s)" in out for out in outputs), outputs
    written = [d for d in (tmp_path / "node0", tmp_path / "node1") if (d / "metrics.json").exists()]
    assert len(written) == 1  # the node that got rank 0 writes; the other writes nothing
    if rendezvous == "static":
        assert written == [tmp_path / "node0"]  # ranks numbered node by node
    other = ({tmp_path / "node0", tmp_path / "node1"} - set(written)).pop()
    assert not (other / "tensorboard").exists() and not (other / "model.pt").exists()
    assert "rank 0, on another node, wrote the outputs" in outputs[int(other.name[-1])]
    multi = json.loads((written[0] / "metrics.json").read_text())
    for key in ("train/epoch_loss", "val/loss", "val/accuracy", "global_step", "world_size"):
        assert multi[key] == pytest.approx(single.metrics[key], rel=1e-6), key
    a = torch.load(written[0] / "model.pt", weights_only=True)
    b = torch.load(single.job_dir / "model.pt", weights_only=True)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize(("node1", "key"), [
    (["optim.lr=0.5"], "optim.lr=0.5 (rank 0: 0.05)"),     # silently trained a wrong model
    (["data.batch_size=64"], "data.batch_size=64"),        # aborted inside gloo
    (["data.val_size=300"], "data.val_size=300"),          # different data splits
    (["data.num_workers=1", "launcher.rdzv_endpoint=127.0.0.1:{port}"], None),  # node-local
])
def test_nodes_started_with_different_settings_fail_clearly(tmp_path, node1, key):
    """Each node composes its own config: the ranks compare theirs with rank 0's first."""
    codes, outputs = _start_two_nodes(tmp_path, "static", [], node1)
    if key is None:  # how a node joins and loads is its own business: the same world trains
        assert codes == [0, 0], outputs
        return
    assert codes[0] != 0 and codes[1] != 0, outputs
    assert any(f"the nodes disagree: rank 1 has {key}" in out for out in outputs), outputs
    assert not (tmp_path / "node0" / "tensorboard").exists()


@pytest.mark.slow
@pytest.mark.parametrize("failed", [1, 0])
def test_a_node_that_fails_before_its_ranks_start_ends_the_others_at_once(tmp_path, failed):
    """Regression: a node whose launcher failed before its agent started was never heard from,
    and the other node waited launcher.rdzv_timeout_s (900 s by default; a slurm_local job's
    node 0 waited for node 1, dead 0.7 s after its start) to say only that the rendezvous
    timed out. The nodes now meet at a gate first (ddp_exp.launch.node_gate): the other node
    ends at once, naming the node that failed and its error. 600 s here: a wait for it would
    run into the hang detector."""
    missing = tmp_path / "missing.pt"
    bad = [f"trainer.resume={missing}", "launcher.rdzv_timeout_s=600"]
    good = ["launcher.rdzv_timeout_s=600"]
    codes, outputs = _start_two_nodes(tmp_path, "static", *((good, bad) if failed else (bad, good)))
    other = 1 - failed
    assert codes[failed] == 2 and codes[other] != 0, outputs
    own = [ln for ln in outputs[failed].splitlines() if ln.startswith("error:")]
    assert len(own) == 1 and "trainer.resume" in own[0], outputs[failed]
    heard = [ln for ln in outputs[other].splitlines() if ln.startswith("error:")]
    if other == 0:  # the node that speaks for the world says why it did not start
        assert len(heard) == 1, outputs[other]
        assert heard[0].startswith(f"error: node {failed} of 2 failed before its ranks started: "
                                   "trainer.resume"), heard
    assert f"node {failed} of 2 failed before its ranks started" in outputs[other]
    assert "Traceback" not in outputs[0] + outputs[1]
    assert not (tmp_path / "node0" / "tensorboard").exists()


def test_the_node_gate_meets_nodes_and_bounds_every_wait(monkeypatch):
    """ddp_exp.launch.node_gate in-process, two "nodes" as threads: both ready -> both pass;
    one failed -> the other raises NodeFailed with its line (node 0 stays until node 1, which
    connected at its start, has heard); a lone node 0 waits at most its timeout, and a lone
    failed node 0 no longer than ARRIVAL_S after its start."""
    import threading

    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    from ddp_exp.launch import node_gate

    line = "trainer.resume='x.pt': no such checkpoint file"

    def meet(failed: int | None) -> dict[int, object]:
        endpoint, outcome = f"127.0.0.1:{free_port()}", {}

        def node(rank: int) -> None:
            gate = node_gate.NodeGate(endpoint, rank, 2, timeout_s=60)
            try:
                if rank == failed:
                    if rank == 0:  # node 1 is connected (and still building) first
                        while gate.store.add(node_gate.PRESENT, 0) < 1:
                            time.sleep(0.01)
                    gate.announce_failure(line)
                    outcome[rank] = "failed"
                else:
                    gate.wait_for_every_node()
                    outcome[rank] = gate.passed
            except node_gate.NodeFailed as exc:
                outcome[rank] = str(exc)
            finally:
                gate.close()

        threads = [threading.Thread(target=node, args=(rank,)) for rank in (0, 1)]
        threads[0].start()
        time.sleep(0.05)  # node 0 serves first, as it does when it starts first
        threads[1].start()
        for thread in threads:
            thread.join(timeout=60)
        return outcome

    assert meet(None) == {0: True, 1: True}
    heard = f"failed before its ranks started: {line}"
    assert meet(1) == {0: f"node 1 of 2 {heard}", 1: "failed"}
    assert meet(0) == {0: "failed", 1: f"node 0 of 2 {heard}"}
    lone = node_gate.NodeGate(f"127.0.0.1:{free_port()}", 0, 2, timeout_s=0.5)
    with pytest.raises(RendezvousTimeoutError, match="1 of 2 nodes ready"):
        lone.wait_for_every_node()
    monkeypatch.setattr(node_gate, "NOTICE_S", 600.0)  # a wait would run into pytest's limit
    monkeypatch.setattr(node_gate, "ARRIVAL_S", 0.3)
    node_gate.NodeGate(f"127.0.0.1:{free_port()}", 0, 2, timeout_s=600).announce_failure("x")


WORLD_SHAPE_ERRORS = [  # (overrides, the key the one line must name)
    (["world_size=3", "launcher.nnodes=2"], "world_size"),
    (["world_size=2", "launcher.nnodes=2", "launcher.rdzv_endpoint=localhost:29400"],
     "launcher.rdzv_id"),
    (["world_size=2", "launcher.nnodes=2", "launcher.rdzv_id=x"], "launcher.rdzv_endpoint"),
    (["launcher.rdzv_endpoint=garbage"], "launcher.rdzv_endpoint"),
    (["world_size=2", "launcher.nnodes=2", "launcher.rdzv_backend=static",
      "launcher.rdzv_endpoint=localhost:29400"], "launcher.node_rank"),
    (["world_size=2", "launcher.nnodes=2", "launcher.rdzv_backend=static",
      "launcher.node_rank=2", "launcher.rdzv_endpoint=localhost:29400"], "launcher.node_rank"),
    (["launcher.node_rank=0"], "launcher.node_rank"),
    # launcher.rdzv_backend=etcd: refused at composition, tests/test_schema.py CHOICE_REFUSALS
    (["launcher.cluster=slurm"], "launcher.cluster"),
    (["launcher.cluster=submitit"], "launcher.cluster"),  # not inside a submitit job
]


@pytest.mark.parametrize(("overrides", "key"), WORLD_SHAPE_ERRORS)
def test_world_shape_errors_are_refused_before_anything_starts(compose, tmp_path, overrides,
                                                              key):
    """A world that cannot be laid out on the nodes is refused by the steps the CLI runs
    before any rank (in-process: validate, or the cluster's layout)."""
    message = refused_before_ranks(compose(*overrides), tmp_path / "run")
    assert message.startswith(key), message


@pytest.mark.parametrize(("overrides", "key"), [WORLD_SHAPE_ERRORS[0], WORLD_SHAPE_ERRORS[-1]],
                         ids=["validate", "cluster layout"])
def test_world_shape_errors_fail_at_once(run_cli, overrides, key):
    """A world that cannot be laid out on the nodes fails before anything starts, through the
    CLI: one refusal of each kind (every case in-process, above)."""
    run = run_cli(*overrides)
    assert run.returncode == 2
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


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_slurm_layout_runs_here_through_submitit_local(run_cli, tmp_path,
                                                     default_run_2_epochs):
    """launcher=slurm_local: every job is 2 submitit tasks standing for 2 nodes (one rank each,
    static rendezvous); each trains the single-node world_size=2 model and task 0 alone owns
    the job folder."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    common = ("world_size=2", "trainer.epochs=2", "print_config=false")
    single = {32: default_run_2_epochs.metrics,  # data.batch_size=32: the default
              64: run_cli(*common, "data.batch_size=64", job="single64").ok().metrics}
    sweep = tmp_path / "sweep"
    run_cli("-m", "launcher=slurm_local", "launcher.nnodes=2", *common,
            "data.batch_size=32,64", f"hydra.sweep.dir={sweep}", run_dir=False, timeout=300).ok()
    for job, batch in (("0", 32), ("1", 64)):
        folder = sweep / job
        metrics = json.loads((folder / "metrics.json").read_text())
        for key in ("train/epoch_loss", "val/loss", "val/accuracy", "global_step", "world_size"):
            assert metrics[key] == pytest.approx(single[batch][key], rel=1e-6), (job, key)
        assert len(list((folder / "tensorboard").glob("events.out.tfevents*"))) == 1
        assert json.loads((folder / "status.json").read_text())["status"] == "completed"
        log = (folder / "ddp_exp.log").read_text()
        assert "node 0 of 2" in log and "node 1 of 2" in log
        assert log.count("epoch 2/2") == 1 and log.count("Job completed successfully") == 1
    assert (sweep / "summary.csv").read_text().count("completed") == 2


def _fake_slurm_env(monkeypatch, **values):
    for key in [k for k in os.environ if k.startswith(("SLURM_", "SUBMITIT_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("_TEST_CLUSTER_", "slurm")  # submitit's switch for its job environment
    for key, value in values.items():
        monkeypatch.setenv(key, str(value))


SLURM_TWO_NODES = dict(SLURM_JOB_ID=123456, SLURM_NTASKS=2, SLURM_JOB_NUM_NODES=2,
                       SLURM_JOB_NODELIST="gpu[07-08]", SLURM_LOCALID=0)


@pytest.mark.parametrize(("task", "node"), [(0, 0), (1, 1)])
def test_slurm_task_reads_its_node_and_the_first_host(monkeypatch, task, node):
    pytest.importorskip("submitit")
    from ddp_exp.launch.cluster import submitit_layout

    _fake_slurm_env(monkeypatch, **SLURM_TWO_NODES, SLURM_PROCID=task, SLURM_NODEID=node)
    layout = submitit_layout()
    assert (layout.nnodes, layout.node_rank, layout.job_id) == (2, task, "123456")
    assert layout.rdzv_endpoint == "gpu07:13456"  # 10000 + 123456 mod 20000, on node 0
    assert submitit_layout(29400).rdzv_endpoint == "gpu07:29400"  # a configured port wins


def test_slurm_array_task_gets_its_own_rendezvous(monkeypatch):
    """Sweep jobs are array tasks: each has its own SLURM_JOB_ID, hence port and run id."""
    pytest.importorskip("submitit")
    from ddp_exp.launch.cluster import submitit_layout

    ports = set()
    for job_id, array_task in ((2001, 0), (2002, 1)):
        _fake_slurm_env(monkeypatch, **{**SLURM_TWO_NODES, "SLURM_JOB_ID": job_id},
                        SLURM_PROCID=0, SLURM_NODEID=0, SLURM_ARRAY_JOB_ID=2000,
                        SLURM_ARRAY_TASK_ID=array_task)
        layout = submitit_layout()
        assert layout.job_id == f"2000_{array_task}"
        ports.add(layout.rdzv_endpoint)
    assert ports == {"gpu07:12001", "gpu07:12002"}


def test_slurm_tasks_must_be_one_per_node(monkeypatch):
    pytest.importorskip("submitit")
    from ddp_exp.launch.cluster import submitit_layout

    _fake_slurm_env(monkeypatch, **{**SLURM_TWO_NODES, "SLURM_NTASKS": 4}, SLURM_PROCID=0,
                    SLURM_NODEID=0)
    with pytest.raises(ConfigError, match="hydra.launcher.tasks_per_node"):
        submitit_layout()


def test_rendezvous_port_stays_in_its_range():
    from ddp_exp.launch.cluster import rendezvous_port

    assert rendezvous_port("0") == 10000 and rendezvous_port("19999") == 29999
    assert rendezvous_port("20000") == 10000
    assert 10000 <= rendezvous_port("abc_1") < 30000


def test_slurm_preset_maps_world_size_onto_nodes_and_gpus(monkeypatch, tmp_path):
    """launcher=slurm world_size=16 launcher.nnodes=2: the sbatch script submitit would submit
    asks for 2 nodes, 1 task per node and 8 GPUs per node."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    import submitit
    from hydra import compose, initialize_config_module
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import instantiate
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    from ddp_exp.config.compose import register_configs

    register_configs()
    with initialize_config_module("ddp_exp.conf", version_base="1.3"):
        cfg = compose("config", ["launcher=slurm", "world_size=16", "launcher.nnodes=2",
                                 "hydra.launcher.partition=gpu"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    assert cfg.launcher.cluster == "submitit" and cfg.launcher.rdzv_backend == "static"
    params = instantiate(cfg.hydra.launcher).params  # resolved as Hydra's launcher sees them
    assert (params["nodes"], params["tasks_per_node"], params["gpus_per_node"]) == (2, 1, 8)
    # submitit's SLURM executor wants srun on PATH; a stand-in lets it write the script.
    (tmp_path / "srun").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()
                                  if k not in ("submitit_folder", "max_num_timeout")})
    script = executor._executor._make_submission_file_text("python -m x", "%j")
    for line in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--partition=gpu"):
        assert f"#SBATCH {line}\n" in script, script


def test_slurm_preset_rejects_a_world_that_does_not_divide(run_cli):
    """world_size=3 on 2 SLURM nodes fails at submission, before any job is queued."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    run = run_cli("-m", "launcher=slurm", "world_size=3", "launcher.nnodes=2", run_dir=False)
    assert run.returncode != 0
    assert "world_size=3" in run.stderr and "launcher.nnodes=2" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_missing_submitit_plugin_gets_an_install_hint(monkeypatch):
    """launcher=slurm without the slurm extra: Hydra cannot find hydra/launcher/submitit_slurm;
    the entry adds the line that installs it."""
    import importlib.util

    from ddp_exp.cli.errors import missing_plugin_hint

    error = "In 'launcher/slurm': Could not find 'hydra/launcher/submitit_slurm'"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if "submitit" in name else real(name, *a))
    assert missing_plugin_hint(error) == ("hint: this needs Hydra's submitit plugin: "
                                          "pip install -e '.[slurm]'")
    assert missing_plugin_hint("Could not find 'data/digitz'") is None

    def no_plugins_at_all(name, *a):  # no plugin installed: no hydra_plugins package either
        if name.startswith("hydra_plugins"):
            raise ModuleNotFoundError("No module named 'hydra_plugins'", name="hydra_plugins")
        return real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", no_plugins_at_all)
    assert missing_plugin_hint("Could not find 'hydra/launcher/joblib'") == (
        "hint: this needs Hydra's joblib plugin: pip install -e '.[sweeps]'")
    monkeypatch.setattr(importlib.util, "find_spec", real)
    assert missing_plugin_hint(error) is None  # installed here: Hydra's own message is enough


@pytest.mark.parametrize("preset", ["slurm", "slurm_local"])
def test_cluster_presets_validate_as_composed_and_as_filled_in(monkeypatch, preset):
    """Regression: a filled-in static layout (node_rank set by the task) was rejected as if
    node_rank were given to c10d, so every slurm_local job failed."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_module

    from ddp_exp.config.checks import validate
    from ddp_exp.config.compose import register_configs
    from ddp_exp.launch.cluster import apply_layout

    register_configs()
    with initialize_config_module("ddp_exp.conf", version_base="1.3"):
        cfg = compose("config", [f"launcher={preset}", "world_size=4", "launcher.nnodes=2"])
    validate(cfg)  # as composed: node_rank is left to each task
    _fake_slurm_env(monkeypatch, **{**SLURM_TWO_NODES, "SLURM_JOB_ID": 77}, SLURM_PROCID=1,
                    SLURM_NODEID=1)
    apply_layout(cfg)
    assert (cfg.launcher.node_rank, cfg.launcher.rdzv_backend) == (1, "static")
    assert (cfg.launcher.rdzv_endpoint, cfg.launcher.rdzv_id) == ("gpu07:10077", "77")
    validate(cfg)  # as one task runs it
    cfg.launcher.node_rank = 2
    with pytest.raises(ConfigError, match="launcher.node_rank"):
        validate(cfg)


def test_non_owner_task_leaves_the_shared_folder_alone(monkeypatch, tmp_path):
    """Regression (1 sweep in 11 crashed): task 1 of a submitit job cleaned temp files out of
    task 0's folder while task 0 was writing status.json."""
    import torch.distributed.launcher.api as launcher_api
    from omegaconf import OmegaConf

    from ddp_exp.config.schema import LauncherConfig
    from ddp_exp.launch import elastic as launch

    cfg = OmegaConf.create({"launcher": OmegaConf.structured(LauncherConfig)})
    inputs = type("Inputs", (), {"backend": "gloo", "job_dir": str(tmp_path)})()
    monkeypatch.setattr(launcher_api, "elastic_launch", lambda config, fn: lambda *a: {1: None})
    partial = tmp_path / ".status.json.abc123.tmp"
    partial.write_text("{")
    assert launch._elastic_launch(cfg, 1, inputs, owns_folder=False) == {1: None}
    assert partial.exists()  # another process's write in progress
    launch._elastic_launch(cfg, 1, inputs, owns_folder=True)
    assert not partial.exists()  # the owner cleans up after its ranks


@pytest.mark.parametrize("task", [0, 1])
def test_only_task_0_changes_the_shared_folder_before_the_ranks_start(
        compose, monkeypatch, tmp_path, caplog, task):
    """Regression (a slurm_local sweep hung 1 time in 4 under load): before any rank started,
    each task of a cluster job built the world in the shared job folder as if it owned it.
    Task 0 deleted the temp file of task 1's ``run.json`` write (the clean-up of a killed
    writer's files), task 1's task ended with FileNotFoundError, which Hydra's submitit
    launcher keeps to itself, and task 0 waited for it at the rendezvous. Every task still
    judges the folder (so that all refuse together); task 0 alone changes it: its temp files,
    ``run.json``, the trackers' run, the warnings. Here through ``run_job``, up to the launch."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from ddp_exp.launch import elastic

    job = tmp_path / "job"
    job.mkdir()
    writing = job / ".run.json.abc123.tmp"  # the other task's write in progress
    writing.write_text("{")
    overrides = ["launcher.cluster=slurm", "world_size=2", "trainer.resume=auto",
                 "print_config=true"]
    hydra_cfg = hydra.compose("config", overrides=overrides, return_hydra_config=True)
    with open_dict(hydra_cfg):
        hydra_cfg.hydra.runtime.output_dir = str(job)
    HydraConfig.instance().set_config(hydra_cfg)
    _fake_slurm_env(monkeypatch, **{**SLURM_TWO_NODES, "SLURM_JOB_ID": 77}, SLURM_PROCID=task,
                    SLURM_NODEID=task)
    launched = []
    monkeypatch.setattr(elastic.node_gate, "gate_for", lambda la: None)  # gpu07: not here
    monkeypatch.setattr(elastic, "_elastic_launch",
                        lambda cfg, nproc, inputs, owner, held: launched.append(owner) or {})
    threads = torch.get_num_threads()
    try:
        with caplog.at_level("INFO", logger="ddp_exp"):
            elastic.run_job(compose(*overrides))
    finally:
        torch.set_num_threads(threads)
    assert launched == [task == 0]
    said = caplog.text
    if task == 0:
        assert not writing.exists() and (job / "run.json").is_file()
        assert "nothing to resume" in said and "world_size: 2" in said  # the config printed
    else:
        assert writing.read_text() == "{" and not (job / "run.json").exists()
        assert "nothing to resume" not in said and "world_size: 2" not in said


def test_slurm_preset_off_slurm_says_so_in_one_line(run_cli):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    if shutil.which("srun"):
        pytest.skip("SLURM here: the preset would submit")
    run = run_cli("-m", "launcher=slurm", "world_size=2", "launcher.nnodes=2", run_dir=False)
    assert run.returncode == 2, run.stderr
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "launcher=slurm_local" in lines[0], run.stderr


def test_a_node_that_never_comes_ends_in_rdzv_timeout(run_cli):
    """Regression: c10d ignored launcher.rdzv_timeout_s (torch reads join_timeout, 600 s):
    a lone node hung silently. Now it ends after the timeout with one line and status.json."""
    run = run_cli("world_size=2", "launcher.nnodes=2", f"launcher.rdzv_endpoint=127.0.0.1:"
                  f"{free_port()}", "launcher.rdzv_id=lonely", "launcher.rdzv_timeout_s=5",
                  timeout=90)
    assert run.returncode == 1, run.stderr  # a hang runs into run_cli's timeout
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "rendezvous" in errors[0] and "Traceback" not in run.stderr
    assert json.loads((run.job_dir / "status.json").read_text())["status"] == "failed"


def test_slurm_job_with_fewer_gpus_than_ranks_fails_clearly(monkeypatch):
    """A world_size sweep under launcher=slurm asks every job for the base config's GPUs; a job
    whose ranks outnumber its GPUs says so instead of falling back to the CPU."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_module

    from ddp_exp.config.compose import register_configs
    from ddp_exp.launch.cluster import apply_layout

    register_configs()
    with initialize_config_module("ddp_exp.conf", version_base="1.3"):
        cfg = compose("config", ["launcher=slurm", "world_size=16", "launcher.nnodes=2"])
    _fake_slurm_env(monkeypatch, **SLURM_TWO_NODES, SLURM_PROCID=0, SLURM_NODEID=0,
                    SLURM_GPUS_ON_NODE=4)
    with pytest.raises(ConfigError, match="8 rank.s. per node but SLURM gave this node 4 GPU"):
        apply_layout(cfg)


def _free_slurm_job_id() -> int:
    """A job id whose derived rendezvous port (10000 + id mod 20000) is free here now."""
    import random

    from ddp_exp.launch.cluster import rendezvous_port

    while True:
        job_id = random.randrange(100_000, 10_000_000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", rendezvous_port(str(job_id))))
            except OSError:
                continue
        return job_id


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [2, 1], ids=["task-per-node", "task-per-rank"])
@pytest.mark.float_sensitive
def test_plain_srun_tasks_share_one_job_folder_and_train_the_single_node_world(
        default_run_2_epochs, tmp_path, nodes):
    """U03: two srun tasks of ``launcher.cluster=slurm`` faked on loopback: one task per node
    (2 "nodes" on localhost, each its node's agent) or one task per rank (2 tasks on 1 node,
    joining as under torchrun). Both derive one job folder from SLURM_JOB_ID, write one event
    stream, and train the single-node world_size=2 model (the session's 2-epoch run)."""
    single = default_run_2_epochs
    job_id, tag = _free_slurm_job_id(), uuid.uuid4().hex
    work = tmp_path / "work"
    work.mkdir()
    procs = []
    for task in range(2):
        slurm = dict(SLURM_JOB_ID=str(job_id), SLURM_NTASKS="2", SLURM_PROCID=str(task),
                     SLURM_JOB_NUM_NODES=str(nodes), SLURM_NODEID=str(task if nodes == 2 else 0),
                     SLURM_LOCALID=str(0 if nodes == 2 else task),
                     SLURM_JOB_NODELIST="localhost", OMP_NUM_THREADS="1")
        env = {k: v for k, v in cli_env(tag, **slurm).items()
               if not k.startswith("SLURM_") or k in slurm}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "ddp_exp", "launcher.cluster=slurm", "trainer.epochs=2", QUIET],
            cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            stdin=subprocess.DEVNULL))
    try:
        outputs = [p.communicate(timeout=HANG_S)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert_no_orphans(tag)
    assert [p.returncode for p in procs] == [0, 0], outputs
    job = work / "outputs" / "runs" / f"slurm-{job_id}"
    assert [p for p in work.rglob("*") if p.is_dir() and (p / ".hydra").is_dir()] == [job]
    assert len(list(work.rglob("events.out.tfevents*"))) == 1
    assert len(list((job / "tensorboard").glob("events.out.tfevents*"))) == 1
    assert sorted(work.rglob("metrics.json")) == [job / "metrics.json"]
    assert json.loads((job / "status.json").read_text())["status"] == "completed"
    multi = json.loads((job / "metrics.json").read_text())
    for key in ("train/epoch_loss", "val/loss", "val/accuracy", "global_step", "world_size"):
        assert multi[key] == pytest.approx(single.metrics[key], rel=1e-6), key
    a = torch.load(job / "model.pt", weights_only=True)
    b = torch.load(single.job_dir / "model.pt", weights_only=True)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


def test_plain_srun_layouts_from_the_slurm_environment(monkeypatch, tmp_path):
    """launcher.cluster=slurm without submitit: one task per node is node SLURM_PROCID's agent
    at the first host; several tasks per node are ranks with torchrun's variables."""
    from ddp_exp.launch.cluster import slurm_hostnames, slurm_layout

    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol: the compressed list is parsed
    # submitit's parser (the test extras install it)
    assert slurm_hostnames("gpu[07-08,10],cpu3") == ["gpu07", "gpu08", "gpu10", "cpu3"]
    assert slurm_hostnames("a1,b2") == ["a1", "b2"]
    base = dict(SLURM_JOB_ID=123456, SLURM_JOB_NODELIST="a1,b2", SLURM_JOB_NUM_NODES=2)
    _fake_slurm_env(monkeypatch, **base, SLURM_NTASKS=2, SLURM_PROCID=1, SLURM_LOCALID=0)
    agent = slurm_layout()
    assert (agent.nnodes, agent.node_rank, agent.rdzv_endpoint, agent.ranks) == (
        2, 1, "a1:13456", None)
    _fake_slurm_env(monkeypatch, **base, SLURM_NTASKS=8, SLURM_PROCID=5, SLURM_LOCALID=1)
    rank = slurm_layout(29400)
    assert rank.ranks == {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
                          "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "a1", "MASTER_PORT": "29400"}
    _fake_slurm_env(monkeypatch, **base, SLURM_NTASKS=3, SLURM_PROCID=0)
    with pytest.raises(ConfigError, match="3 tasks on 2 nodes"):
        slurm_layout()
    _fake_slurm_env(monkeypatch)
    with pytest.raises(ConfigError, match="launcher.cluster=slurm: this process is not a SLURM"):
        slurm_layout()
