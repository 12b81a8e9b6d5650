"""Issue 5's training features: the two data paths, gradient accumulation under no_sync (with an
all-reduce count), bf16 autocast and torch.compile."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch
from helpers import free_port

from ddp_exp.config.compose import register_configs


def _state(job_dir):
    return torch.load(job_dir / "model.pt", weights_only=True)


def _max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.float_sensitive
def test_batched_path_equals_dataloader_path(run_cli):
    """num_workers=0 (batched tensor indexing) and num_workers=1 (torch DataLoader with a
    worker) train the same model: same losses, same weights."""
    common = ("world_size=2", "trainer.epochs=2", "print_config=false")
    fast = run_cli(*common, "data.num_workers=0", job="batched").ok()
    generic = run_cli(*common, "data.num_workers=1", job="dataloader").ok()
    for key in ("train/epoch_loss", "val/loss", "val/accuracy"):
        assert fast.metrics[key] == generic.metrics[key], key
    assert _max_abs_diff(_state(fast.job_dir), _state(generic.job_dir)) == 0.0


@pytest.mark.float_sensitive
def test_accumulation_equals_the_bigger_batch(run_cli):
    """accumulate_grad_batches=2 at batch 16 trains the model of batch 32 (the micro-batch
    losses are weighted by their share of the step's samples)."""
    common = ("world_size=2", "trainer.epochs=2", "print_config=false")
    acc = run_cli(*common, "data.batch_size=16", "trainer.accumulate_grad_batches=2",
                  job="acc").ok()
    big = run_cli(*common, "data.batch_size=32", job="big").ok()
    assert acc.metrics["global_step"] == big.metrics["global_step"] == 48
    assert acc.metrics["global_batch_size"] == big.metrics["global_batch_size"] == 64
    assert acc.metrics["val/loss"] == pytest.approx(big.metrics["val/loss"], rel=1e-5)
    assert _max_abs_diff(_state(acc.job_dir), _state(big.job_dir)) < 1e-5


def _count_allreduces(rank: int, world_size: int, port: int, cfgs: list[dict], job_dir: str,
                      out: mp.Queue) -> None:
    """One rank: for each config in turn, build ddp_exp's Trainer, wrap DDP's all-reduce in a
    counting comm hook, fit; one process group for them all (a world's start-up, ~2.5 s of
    imports per spawned rank, paid once)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from ddp_exp.config.view import rank_config
    from ddp_exp.data import build_datasets, load_digits
    from ddp_exp.distributed.process_group import World, destroy_process_group, init_process_group
    from ddp_exp.metrics.writer import MetricsWriter
    from ddp_exp.train.loop import Trainer
    from ddp_exp.train.models import MLP
    from ddp_exp.train.objective import Objective

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    world = World.from_env()
    init_process_group("gloo", world, 60)
    try:
        datasets = build_datasets(load_digits(), 297, 0, world_size)
        for cfg in cfgs:
            torch.manual_seed(0)
            model = MLP((1, 8, 8), 10, [128])
            trainer = Trainer(rank_config(cfg), world, datasets, model, Objective(10),
                              torch.device("cpu"),
                              MetricsWriter(job_dir, {}, enabled=False))
            calls = [0]

            def counting_allreduce(state, bucket, calls=calls):
                calls[0] += 1
                return default_hooks.allreduce_hook(state, bucket)

            trainer.ddp.register_comm_hook(None, counting_allreduce)
            trainer.fit()
            out.put((cfg["trainer"]["accumulate_grad_batches"], rank, calls[0],
                     trainer.global_step))
    finally:
        destroy_process_group()


@pytest.mark.slow
def test_one_gradient_all_reduce_per_optimizer_step(tmp_path):
    """DDP all-reduces gradients once per optimizer step, not per micro-batch: the forward and
    backward of all but the last micro-batch run inside no_sync(). The model fits in one
    bucket, so calls == optimizer steps; accumulating 1, 2 and 3 micro-batches, in one world."""
    import hydra
    from omegaconf import OmegaConf

    register_configs()
    accumulations = (1, 2, 3)
    with hydra.initialize_config_module(config_module="ddp_exp.conf", version_base="1.3"):
        cfgs = [OmegaConf.to_container(hydra.compose("config", overrides=[
            "world_size=2", "trainer.epochs=1", "data.batch_size=16", "trainer.save_last=false",
            f"trainer.accumulate_grad_batches={accumulate}", "trainer.progress=off"]),
            resolve=True) for accumulate in accumulations]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_count_allreduces, args=(r, 2, port, cfgs, str(tmp_path), out))
             for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=240) for _ in range(2 * len(accumulations)))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    micro_batches = -(-750 // 16)  # 750 samples per rank at batch 16
    want = [(a, rank, -(-micro_batches // a), -(-micro_batches // a))
            for a in accumulations for rank in (0, 1)]
    assert results == want  # (accumulated, rank, all-reduce calls, optimizer steps)


@pytest.mark.float_sensitive
def test_bf16_mixed_runs_close_to_fp32(run_cli, default_run_2_epochs):
    """bf16 autocast on the CPU: completes, and the final losses stay within 2% of fp32 (the
    session's default 2-epoch run; bf16 keeps 8 bits of mantissa: each matmul's inputs are
    rounded to ~0.4%)."""
    common = ("world_size=2", "trainer.epochs=2", "print_config=false")
    fp32 = default_run_2_epochs.metrics
    bf16 = run_cli(*common, "trainer.precision=bf16-mixed", job="bf16").ok().metrics
    assert bf16["val/loss"] == pytest.approx(fp32["val/loss"], rel=0.02)
    assert bf16["train/epoch_loss"] == pytest.approx(fp32["train/epoch_loss"], rel=0.02)
    assert abs(bf16["val/accuracy"] - fp32["val/accuracy"]) <= 0.02


@pytest.mark.slow
@pytest.mark.float_sensitive
@pytest.mark.skipif(os.environ.get("ATEN_CPU_CAPABILITY") == "default",
                    reason="inductor's C++ code does not build under ATEN_CPU_CAPABILITY=default "
                           "(torch 2.13 writes at::vec into it): make test-float's kernels")
def test_compile_runs_and_matches_eager(run_cli, default_run_1_epoch):
    """torch.compile of the DDP model on the CPU (inductor, C++ codegen): completes, and the
    losses match eager mode (the session's default 1-epoch run) within 1e-4 relative (fused
    kernels reorder float sums)."""
    common = ("world_size=2", "trainer.epochs=1", "print_config=false")
    eager = default_run_1_epoch.metrics
    compiled = run_cli(*common, "trainer.compile=true", job="compiled", timeout=600).ok().metrics
    assert compiled["val/loss"] == pytest.approx(eager["val/loss"], rel=1e-4)
    assert compiled["train/epoch_loss"] == pytest.approx(eager["train/epoch_loss"], rel=1e-4)
