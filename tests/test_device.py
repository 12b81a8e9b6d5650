"""Where ranks compute (issue 6): the device/backend rules, the data path, and the CUDA runs.

The rules and the data-path choice are pure functions, tested here on any machine. The CUDA
tests at the bottom skip without a GPU; where one is lent they run as
``pytest tests/test_device.py -m cuda`` (``make test-cuda``).
"""

from __future__ import annotations

import pytest
import torch
import yaml

from ddp_exp.config.checks import check_precision
from ddp_exp.config.errors import ConfigError
from ddp_exp.config.schema import DataConfig
from ddp_exp.data.loaders import loader_options, placement
from ddp_exp.distributed import process_group as distributed
from ddp_exp.distributed.process_group import resolve_placement

CPU, CUDA0 = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture
def nccl_built(monkeypatch):
    """Rules as on a CUDA build of torch (this CPU wheel has no NCCL)."""
    monkeypatch.setattr(distributed.dist, "is_nccl_available", lambda: True)


@pytest.mark.parametrize(("device", "backend", "local", "gpus", "expected"), [
    ("auto", "auto", 2, 0, ("cpu", "gloo")),      # no GPU: CPU and gloo
    ("auto", "auto", 2, 1, ("cpu", "gloo")),      # fewer GPUs than local ranks: CPU
    ("auto", "auto", 2, 2, ("cuda", "nccl")),     # a GPU per local rank: cuda:LOCAL_RANK, nccl
    ("auto", "auto", 4, 8, ("cuda", "nccl")),
    ("auto", "gloo", 2, 2, ("cpu", "gloo")),      # an explicit gloo means the CPU
    ("auto", "nccl", 2, 2, ("cuda", "nccl")),
    ("cpu", "auto", 2, 2, ("cpu", "gloo")),       # GPUs there, CPU asked for
    ("cuda", "auto", 2, 2, ("cuda", "nccl")),
    ("cuda", "gloo", 2, 2, ("cuda", "gloo")),     # gloo reduces CUDA tensors too
    ("cpu", "gloo", 1, 0, ("cpu", "gloo")),
])
def test_device_and_backend_rules(nccl_built, device, backend, local, gpus, expected):
    assert resolve_placement(device, backend, local, gpus=gpus) == expected


@pytest.mark.parametrize(("device", "backend", "local", "gpus", "words"), [
    ("cuda", "auto", 2, 1, ["device=cuda", "one CUDA device per local rank (2 here)", "found 1",
                            "device=cpu"]),
    ("cuda", "nccl", 1, 0, ["device=cuda", "found 0"]),
    ("auto", "nccl", 2, 0, ["backend=nccl", "(2 here)", "found 0", "backend=gloo"]),
    ("cpu", "nccl", 2, 2, ["backend=nccl needs device=cuda"]),
])
def test_impossible_placements_name_the_key(nccl_built, device, backend, local, gpus, words):
    with pytest.raises(ConfigError) as err:
        resolve_placement(device, backend, local, gpus=gpus)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert "\n" not in str(err.value)


def test_auto_falls_back_to_gloo_on_cuda_without_nccl(monkeypatch):
    monkeypatch.setattr(distributed.dist, "is_nccl_available", lambda: False)
    assert resolve_placement("auto", "auto", 1, gpus=1) == ("cuda", "gloo")
    with pytest.raises(ConfigError, match="no NCCL"):
        resolve_placement("auto", "nccl", 1, gpus=1)


def test_fp16_needs_cuda_bf16_does_not():
    with pytest.raises(ConfigError, match="trainer.precision=16-mixed needs device=cuda"):
        check_precision("16-mixed", "cpu")
    check_precision("16-mixed", "cuda")
    check_precision("bf16-mixed", "cpu")


@pytest.mark.parametrize(("device", "workers", "in_memory", "expected", "pinned"), [
    (CPU, 0, True, (False, True), False),     # in memory, on the CPU: nothing to move
    (CPU, 2, True, (False, False), False),    # workers on the CPU: no pinning (it needs CUDA)
    (CUDA0, 0, True, (False, True), False),   # the set copied to the GPU once: no copy per step
    (CUDA0, 2, True, (True, False), True),    # workers: pinned host batches, non-blocking copy
    (CUDA0, 0, False, (True, False), False),  # lazy data is read on the host, even without workers
    (CPU, 0, False, (False, False), False),
])
def test_data_path_placement(device, workers, in_memory, expected, pinned):
    """(move each batch to the device, keep the set on the device), and data.pin_memory=auto"""
    assert placement(device, workers, in_memory) == expected
    options = loader_options(DataConfig(num_workers=workers, pin_memory="auto"), device)
    assert options["pin_memory"] is pinned


def test_resolved_device_is_recorded(run_cli):
    """The job records what ran (cpu/gloo here), not ``auto``, in metrics.json and the config
    the ranks used."""
    run = run_cli("world_size=2", "trainer.epochs=1", "device=auto", "print_config=true").ok()
    assert (run.metrics["device"], run.metrics["backend"]) == ("cpu", "gloo")
    assert "device cpu" in run.stdout
    dumped = run.stdout.split("config:\n", 1)[1]
    assert "device: cpu" in dumped.split("\n[", 1)[0]
    composed = yaml.safe_load((run.job_dir / ".hydra" / "config.yaml").read_text())
    assert composed["device"] == "auto"  # Hydra's record of what was asked for


# ------------------------------------------------------------------------------ CUDA
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA_RUN = ("world_size=1", "trainer.epochs=3", "print_config=false", "trainer.progress=off")


@pytest.mark.cuda
@needs_cuda
def test_digits_on_cuda_with_nccl_and_bf16_matches_the_cpu_run(run_cli):
    """The digits job on cuda:0, nccl, bf16 autocast: within tolerance of fp32 on the CPU."""
    cpu = run_cli(*CUDA_RUN, "device=cpu", job="cpu").ok().metrics
    gpu = run_cli(*CUDA_RUN, "device=cuda", "backend=nccl", "trainer.precision=bf16-mixed",
                  job="cuda").ok().metrics
    assert (gpu["device"], gpu["backend"]) == ("cuda", "nccl")
    assert gpu["val/num_samples"] == cpu["val/num_samples"]
    assert gpu["val/accuracy"] == pytest.approx(cpu["val/accuracy"], abs=0.02)
    assert gpu["val/loss"] == pytest.approx(cpu["val/loss"], rel=0.1)
    assert gpu["train/epoch_loss"] == pytest.approx(cpu["train/epoch_loss"], rel=0.1)


@pytest.mark.cuda
@needs_cuda
def test_pinned_worker_batches_train_like_device_resident_data(run_cli):
    """data.num_workers=2 (pinned host batches, non-blocking copies) trains the model that the
    device-resident path trains, fp32 on cuda:0."""
    resident = run_cli(*CUDA_RUN, "device=cuda", job="resident").ok().metrics
    pinned = run_cli(*CUDA_RUN, "device=cuda", "data.num_workers=2", job="pinned").ok().metrics
    for key in ("train/epoch_loss", "val/loss"):
        assert pinned[key] == pytest.approx(resident[key], rel=1e-4), key
    assert pinned["val/accuracy"] == pytest.approx(resident["val/accuracy"], abs=1 / 297)


@pytest.mark.cuda
@needs_cuda
def test_resume_on_cuda_continues_exactly(run_cli, tmp_path):
    """A checkpoint loaded onto cuda:0 (RNG states included) continues the run."""
    straight = run_cli(*CUDA_RUN, "device=cuda", job="straight").ok().metrics
    first = ("world_size=1", "print_config=false", "device=cuda", "trainer.progress=off")
    run_cli(*first, "trainer.epochs=2", job="resumed").ok()
    resumed = run_cli(*first, "trainer.epochs=3", "trainer.resume=auto", job="resumed").ok()
    for key in ("train/epoch_loss", "val/loss"):
        assert resumed.metrics[key] == pytest.approx(straight[key], rel=1e-5), key
