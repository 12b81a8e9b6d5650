"""``strategy=fsdp`` (FSDP2 ``fully_shard``, issue 40 part 1): the meta-device build starts at
the unsharded build's weights, training equals DDP's (same world: AdamW; across worlds: SGD),
checkpoints are the plain layout and resume from DDP to FSDP and back, and what cannot hold
is refused in one line before any rank starts.

Expected values come from DDP runs (the strategy the invariants were first proved on) or from
an unsharded build in this process, never from the FSDP code's own output.
"""

from __future__ import annotations

import math
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import QUIET, load_ckpt, refused_before_ranks, run_once, scalars

pytestmark = pytest.mark.slow

# A tiny GPT on data=tokens: 2 blocks, width 32; clipping and accumulation 2; the whole
# validation set (limit_val_batches=null: the same windows at every world size).
GPT = ["model=gpt", "data=tokens", "data.block_size=32", "model.n_layer=2", "model.n_head=2",
       "model.n_embd=32", "trainer.gradient_clip_val=0.5", "trainer.accumulate_grad_batches=2",
       "trainer.limit_val_batches=null", "trainer.epochs=1", "trainer.max_steps=8",
       "trainer.log_every_n_steps=4", QUIET]


def per_rank(world_size: int, global_batch: int = 24) -> str:
    """The per-rank batch of a global batch (accumulation 2)."""
    return f"data.batch_size={global_batch // (2 * world_size)}"
SGD = ["optim=sgd", "optim.lr=0.05"]


def weights(run) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in load_ckpt(run.job_dir / "model.pt").items()}


def global_rel(a: dict, b: dict) -> float:
    """``||a - b|| / ||b||`` over every tensor together."""
    diff = math.sqrt(sum(float((a[k] - b[k]).pow(2).sum()) for k in b))
    return diff / math.sqrt(sum(float(b[k].pow(2).sum()) for k in b))


def worst_tensor_rel(a: dict, b: dict) -> float:
    """The largest per-tensor ``||a - b|| / ||b||``."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in b)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


NODE = {"_target_": "ddp_exp.train.gpt.GPT", "n_layer": 2, "n_head": 2, "n_embd": 16}


@pytest.fixture(scope="module")
def one_rank_group():
    """A 1-rank gloo process group in this process (FSDP2 needs one)."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def fsdp_build(unsharded, **keys):
    from ddp_exp.config.strategy import StrategyConfig
    from ddp_exp.train.fsdp import FSDPStrategy

    cfg = SimpleNamespace(targets=SimpleNamespace(model=NODE), world_size=1)
    return FSDPStrategy(cfg, StrategyConfig(name="fsdp", **keys), unsharded,
                        torch.device("cpu"), (8,), 40)


def seeded_gpt(seed: int = 3):
    from ddp_exp.train.models import build_model

    torch.manual_seed(seed)
    return build_model(NODE, (8,), 40)  # as ddp_exp.launch.build seeds and builds it


def test_meta_build_equals_unsharded_build(one_rank_group):
    """The FSDP build (meta device, sharded, to_empty, each shard filled) holds, bit for bit,
    the weights of ``build_model`` under the same seed; its parameters are DTensors."""
    from torch.distributed.tensor import DTensor

    unsharded = seeded_gpt()
    expected = {k: v.clone() for k, v in unsharded.state_dict().items()}
    strategy = fsdp_build(unsharded)
    assert all(isinstance(p, DTensor) for p in strategy.module.parameters())
    got = strategy.model_state()
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def test_activation_checkpointing_and_no_reshard_keep_gradients(one_rank_group):
    """Recomputing each block in backward and keeping gathered parameters change no gradient;
    bfloat16 parameters with float32 reduction stay near the float32 loss."""
    x = torch.randint(0, 40, (4, 8))
    plain = seeded_gpt()
    plain(x).float().pow(2).mean().backward()
    strategy = fsdp_build(seeded_gpt(), activation_checkpointing=True,
                          reshard_after_forward=False)
    strategy.module(x).pow(2).mean().backward()
    for (name, p), q in zip(strategy.module.named_parameters(), plain.parameters(), strict=True):
        assert torch.allclose(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-7), name
    bf16 = fsdp_build(seeded_gpt(), param_dtype="bfloat16", reduce_dtype="float32")
    with torch.no_grad():
        want = plain(x).float().pow(2).mean()
        got = bf16.module(x).float().pow(2).mean()
    assert got.item() == pytest.approx(want.item(), rel=2e-2)
    assert got.item() != want.item()  # it did compute in bfloat16


def test_last_block_stays_gathered_after_forward(one_rank_group):
    """``reshard_after_forward=true`` frees every block's gathered parameters after its forward
    but the last one's (its backward runs first, at once); an evaluation pass gathers all and
    gives each module its own setting back; ``false`` keeps every block gathered."""
    from torch.distributed.tensor import DTensor

    def gathered(strategy) -> list[bool]:  # per block: plain (unsharded) parameters?
        return [not any(isinstance(p, DTensor) for p in b.parameters())
                for b in strategy.module.blocks]

    x = torch.randint(0, 40, (4, 8))
    strategy = fsdp_build(seeded_gpt())
    loss = strategy.module(x).pow(2).mean()
    assert gathered(strategy) == [False, True]
    loss.backward()
    assert gathered(strategy) == [False, False]  # every block resharded after backward
    with strategy.evaluation(), torch.no_grad():
        strategy.module(x)
        assert gathered(strategy) == [True, True]
    assert gathered(strategy) == [False, False]
    strategy.module(x).pow(2).mean().backward()  # the settings restored: the same again
    loss = strategy.module(x).pow(2).mean()
    assert gathered(strategy) == [False, True]
    loss.backward()
    kept = fsdp_build(seeded_gpt(), reshard_after_forward=False)
    kept.module(x).pow(2).mean()
    assert gathered(kept) == [True, True]


def test_blocks_by_class_name_or_module_path():
    from ddp_exp.train.strategy import find_blocks

    model = seeded_gpt()
    assert find_blocks(model, None) == list(model.blocks)  # GPT.fsdp_blocks
    assert find_blocks(model, ["Block"]) == list(model.blocks)
    assert find_blocks(model, ["blocks.1", "ln_f"]) == [model.blocks[1], model.ln_f]
    mlp = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    assert find_blocks(mlp, None) == [mlp[0], mlp[2]]  # top-level children with parameters


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory):
    """AdamW at world_size 2 under each strategy; SGD under ddp at 1 and fsdp at 2 and 3."""
    root = tmp_path_factory.mktemp("fsdp_gpt")
    out = {}
    for name, args in {
        "adamw_ddp2": ["optim=adamw", "strategy=ddp", "world_size=2", per_rank(2)],
        "adamw_fsdp2": ["optim=adamw", "strategy=fsdp", "world_size=2", per_rank(2)],
        "sgd_ddp1": [*SGD, "strategy=ddp", "world_size=1", per_rank(1)],
        "sgd_fsdp2": [*SGD, "strategy=fsdp", "world_size=2", per_rank(2)],
        "sgd_fsdp3": [*SGD, "strategy=fsdp", "world_size=3", per_rank(3)],
    }.items():
        (root / name).mkdir()
        out[name] = run_once(root / name, *GPT, *args)
    return out


def test_adamw_fsdp_equals_ddp_same_world(gpt_runs):
    ddp, fsdp = gpt_runs["adamw_ddp2"], gpt_runs["adamw_fsdp2"]
    assert global_rel(weights(fsdp), weights(ddp)) <= 1e-6
    assert rel(fsdp.metrics["val/loss"], ddp.metrics["val/loss"]) <= 1e-6
    assert fsdp.metrics["global_step"] == ddp.metrics["global_step"] == 8
    # the global norm of sharded gradients (before clipping) is DDP's, at every logging step
    got, want = scalars(fsdp.job_dir, "train/grad_norm"), scalars(ddp.job_dir, "train/grad_norm")
    assert [s for s, _ in got] == [s for s, _ in want] == [4, 8]
    for (_, g), (_, w) in zip(got, want, strict=True):
        assert rel(g, w) <= 1e-5


def test_sgd_fsdp_across_worlds_equals_ddp_one_rank(gpt_runs):
    reference = gpt_runs["sgd_ddp1"]
    for name in ("sgd_fsdp2", "sgd_fsdp3"):
        run = gpt_runs[name]
        assert worst_tensor_rel(weights(run), weights(reference)) <= 1e-5, name
        assert rel(run.metrics["val/loss"], reference.metrics["val/loss"]) <= 1e-6, name
        assert run.metrics["val/num_samples"] == reference.metrics["val/num_samples"]


def test_state_per_rank_is_sharded(gpt_runs):
    """``perf/state_mb_per_rank``: parameters + gradients + AdamW's two moments, 16 bytes per
    parameter under DDP; FSDP at 2 ranks holds about half (the root's shards round up)."""
    ddp, fsdp = gpt_runs["adamw_ddp2"].metrics, gpt_runs["adamw_fsdp2"].metrics
    n = sum(v.numel() for k, v in weights(gpt_runs["adamw_ddp2"]).items()
            if k != "head.weight")  # tied to wte.weight: one parameter
    assert ddp["perf/state_mb_per_rank"] == pytest.approx(16 * n / 2 ** 20, rel=0.01)
    assert fsdp["perf/state_mb_per_rank"] <= 0.55 * ddp["perf/state_mb_per_rank"]
    for m in (ddp, fsdp):  # the steady state at the end of training, under the high-water mark
        assert 0 < m["perf/rss_mb"] <= m["perf/max_rss_mb"]
    assert "strategy fsdp" in gpt_runs["adamw_fsdp2"].stderr + gpt_runs["adamw_fsdp2"].stdout


def test_sample_reads_a_sharded_checkpoint(gpt_runs, tmp_path):
    """``ddp-exp sample`` continues a prompt from a sharded ``last.pt`` (step 8: the final
    weights) and from its folder given by path exactly as from the gathered ``model.pt``."""
    import shutil

    from ddp_exp.cli.sample import sample_text

    job = gpt_runs["adamw_fsdp2"].job_dir
    folder = job / "checkpoints" / load_ckpt(job / "checkpoints" / "last.pt")["shards"]
    assert (folder / ".metadata").is_file()
    bare = tmp_path / "bare"  # the run without checkpoints/: sample reads model.pt
    shutil.copytree(job, bare, ignore=shutil.ignore_patterns("checkpoints"))
    args = ["--prompt", "The ", "--max-new-tokens", "40", "--temperature", "1", "--seed", "3"]
    want = sample_text([str(bare), *args])
    from ddp_exp.io import checkpoint
    from ddp_exp.io.sharded import load_model
    from ddp_exp.train.models import build_model

    gathered = load_ckpt(job / "model.pt")  # the folder's shards, read whole in one process
    model = build_model(checkpoint.load(str(folder))["config"]["model"], (32,), 256)
    load_model(str(folder), model, no_dist=True)  # read in this process alone
    read = model.state_dict()
    assert read.keys() == gathered.keys()
    assert all(torch.equal(read[k], gathered[k]) for k in gathered)
    assert sample_text([str(job), "--checkpoint", "last", *args]) == want
    assert sample_text([str(job), "--checkpoint", str(folder), *args]) == want


# The digits MLP, SGD with clipping and accumulation 2, a global batch of 48; 40 steps cross the
# first epoch's end (32 steps).
DIGITS = ["model=mlp", "trainer.epochs=2", "trainer.gradient_clip_val=1.0", "optim.lr=0.05",
          "trainer.accumulate_grad_batches=2", QUIET]


@pytest.fixture(scope="module")
def digits_runs(tmp_path_factory):
    """Uninterrupted: DDP at 1 and 2 ranks, FSDP at 2 (full checkpoints). A chain: DDP at 2
    ranks to step 10 (inside epoch 1), FSDP at 3 ranks to step 25 (its ``last.pt``: sharded),
    DDP at 2 ranks to step 40; b resumes a's ``last.pt``, c the folder b's ``last.pt`` names."""
    root = tmp_path_factory.mktemp("fsdp_digits")
    out, last = {}, None
    for name, strategy, world, steps in [("ddp1", "ddp", 1, 40), ("ddp2", "ddp", 2, 40),
                                         ("fsdp2", "fsdp", 2, 40), ("a", "ddp", 2, 10),
                                         ("b", "fsdp", 3, 25), ("c", "ddp", 2, 40)]:
        (root / name).mkdir()
        resume = [f"trainer.resume={last}"] if name in ("b", "c") else []
        full = ["strategy.checkpoint=full"] if name == "fsdp2" else []
        out[name] = run_once(root / name, *DIGITS, f"strategy={strategy}", f"world_size={world}",
                             per_rank(world, 48), f"trainer.max_steps={steps}", *resume, *full)
        last = out[name].job_dir / "checkpoints" / "last.pt"
        if name == "b":
            last = last.parent / load_ckpt(last)["shards"]
    return out


def test_digits_mlp_fsdp_equals_ddp_one_rank(digits_runs):
    ddp, fsdp = digits_runs["ddp1"], digits_runs["fsdp2"]
    assert worst_tensor_rel(weights(fsdp), weights(ddp)) <= 1e-5
    for key in ("val/loss", "val/accuracy"):
        assert rel(fsdp.metrics[key], ddp.metrics[key]) <= 1e-6, key


def test_resume_ddp_to_fsdp_in_another_world_and_back(digits_runs):
    """The chain ends at the uninterrupted DDP run's weights: its FSDP leg resumed a DDP
    checkpoint taken inside an epoch at 2 ranks, at 3 ranks, and DDP at 2 ranks resumed
    FSDP's sharded one (3 shards, inside epoch 1) by its folder's path. An FSDP checkpoint
    with ``strategy.checkpoint=full`` holds the plain layout of DDP's."""
    saved = load_ckpt(digits_runs["a"].job_dir / "checkpoints" / "last.pt")
    assert saved["position"] == 480 and saved["global_step"] == 10  # inside epoch 1
    folder = digits_runs["b"].job_dir / "checkpoints" / load_ckpt(
        digits_runs["b"].job_dir / "checkpoints" / "last.pt")["shards"]
    assert sorted(p.name for p in folder.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "state.pt"]
    sharded_state = load_ckpt(folder / "state.pt")
    assert sharded_state["global_step"] == 25 and sharded_state["position"] == 25 * 48
    assert "model" not in sharded_state and "optimizer" not in sharded_state  # in the shards
    from_fsdp = load_ckpt(digits_runs["fsdp2"].job_dir / "checkpoints" / "last.pt")
    optimizer = from_fsdp["optimizer"]  # the plain layout: parameter ids, full tensors
    assert optimizer["param_groups"][0]["params"] == list(range(len(saved["model"])))
    assert from_fsdp["model"].keys() == saved["model"].keys()
    assert all(v.shape == saved["model"][k].shape for k, v in from_fsdp["model"].items())
    end, whole = digits_runs["c"], digits_runs["ddp2"]
    assert end.metrics["global_step"] == 40
    assert worst_tensor_rel(weights(end), weights(whole)) <= 1e-5
    assert global_rel(weights(end), weights(whole)) <= 1e-6
    assert rel(end.metrics["val/loss"], whole.metrics["val/loss"]) <= 1e-6


@pytest.mark.parametrize("overrides, named", [
    (["strategy=fsdp", "ddp.sync_batchnorm=true"], "ddp.sync_batchnorm"),
    (["strategy=fsdp", "strategy.blocks=[NoSuchBlock]"], "strategy.blocks"),
    (["strategy=fsdp", "strategy.param_dtype=float16"], "strategy.param_dtype=float16"),
    (["strategy=fsdp", "model=cnn", "model.batch_norm=true"], "BatchNorm"),
    (["strategy=fsdp", "trainer.compile=true"], "trainer.compile"),
    (["strategy=fsdp", "trainer.precision=16-mixed"], "trainer.precision=16-mixed"),
])
def test_refused_before_any_rank(compose, tmp_path, overrides, named):
    message = refused_before_ranks(compose(*overrides), tmp_path / "job")
    assert named in message


def test_refusal_is_one_line_exit_2(run_cli):
    run = run_cli("strategy=fsdp", "strategy.param_dtype=float16", QUIET, timeout=60)
    assert run.returncode == 2
    assert "strategy.param_dtype=float16" in run.stderr
    assert "Traceback" not in run.stderr + run.stdout
    assert not (Path(run.job_dir) / "metrics.json").exists()


def test_unknown_dtype_refused(compose):
    from ddp_exp.config.errors import ConfigError
    from ddp_exp.config.strategy import StrategyConfig

    with pytest.raises(ConfigError, match="strategy.param_dtype='fp8'"):
        StrategyConfig(name="fsdp", param_dtype="fp8")


@pytest.mark.parametrize("value", [-1, 64 * 2 ** 20, True, "big"])
def test_mmap_threshold_out_of_range_refused(value):
    from ddp_exp.config.errors import ConfigError
    from ddp_exp.config.strategy import StrategyConfig

    with pytest.raises(ConfigError, match=r"strategy.malloc_mmap_threshold=.* bytes from 0 to "
                                          r"33554432"):
        StrategyConfig(name="fsdp", malloc_mmap_threshold=value)


# Run in a fresh interpreter: the allocator's state is the process's. A 16 MiB block freed raises
# glibc's dynamic threshold to 16 MiB (its trim threshold to 32 MiB), so an 8 MiB tensor then
# comes from the heap and its pages stay resident after it is freed; with the threshold fixed
# at 128 KiB it is mapped on its own and unmapped on free; malloc_trim gives the heap's free
# pages back.
MMAP_PROBE = """
import sys, torch
from ddp_exp.compat.glibc_malloc import set_mmap_threshold, trim
threshold = None if sys.argv[1] == "null" else int(sys.argv[1])
print(int(set_mmap_threshold(threshold)))
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
big = torch.ones(4 * 2 ** 20)  # 16 MiB, mapped on its own at the start
del big
before = rss()
t = torch.ones(2 * 2 ** 20)  # 8 MiB, every page touched
del t
if sys.argv[2] == "trim":
    trim()
print(rss() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_fixed_mmap_threshold_or_a_trim_gives_freed_tensors_back():
    """``strategy.malloc_mmap_threshold=131072``, or ``strategy.malloc_trim`` after the step: a
    large tensor freed after a larger one was freed leaves the rank's RSS where it was; glibc's
    dynamic default alone (null, no trim) keeps its 8 MiB resident (the RSS creep FSDP's
    per-block buffers cause, issue 40)."""
    import subprocess
    import sys

    from ddp_exp.compat.glibc_malloc import _libc

    if _libc() is None:
        pytest.skip("not glibc")
    kib = {}
    for threshold, then in (("131072", "-"), ("null", "-"), ("null", "trim")):
        out = subprocess.run([sys.executable, "-c", MMAP_PROBE, threshold, then], check=True,
                             capture_output=True, text=True).stdout.split()
        assert out[0] == ("1" if threshold != "null" else "0")
        kib[threshold, then] = int(out[1])
    assert kib["131072", "-"] < 1024  # given back (RSS moves by a few pages at most)
    assert kib["null", "-"] >= 7 * 1024  # kept: the 8 MiB tensor's pages
    assert kib["null", "trim"] < 1024  # given back by the trim


@pytest.mark.parametrize("release", [True, False])
def test_the_trim_follows_every_optimizer_step_where_asked(monkeypatch, release):
    """``strategy.malloc_trim`` (on a CPU device): one ``malloc_trim`` after each optimizer
    step, none without it."""
    from ddp_exp.train import fsdp

    trims: list[int] = []
    monkeypatch.setattr(fsdp, "trim", lambda: trims.append(1) or True)
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.5)
    step = fsdp.FSDPOptimizerStep(optimizer, None, None, [param])
    step.release = release
    for _ in range(3):
        param.grad = torch.ones(3)
        step.step(measure_norm=False)
    assert param.detach().tolist() == [-0.5] * 3  # the optimizer stepped three times
    assert len(trims) == (3 if release else 0)


def test_the_state_estimate_runs_no_users_optimizer_hook():
    """Regression: the startup line's optimizer-state estimate steps a probe optimizer, and a
    global step hook (torch.optim.optimizer.register_optimizer_step_pre_hook) counted it as the
    run's first step (a preemption test's signal came one step early). The estimate is the same,
    the hooks see nothing and stay registered."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    from ddp_exp.train import strategy

    seen: list[str] = []
    pre = register_optimizer_step_pre_hook(lambda *a: seen.append("pre"))
    post = register_optimizer_step_post_hook(lambda *a: seen.append("post"))
    try:
        strategy._state_ratio.cache_clear()
        param = torch.nn.Parameter(torch.zeros(3))
        assert strategy.optimizer_bytes_per_byte(torch.optim.AdamW([param])) == 2.0  # was 0
        assert strategy.optimizer_bytes_per_byte(torch.optim.SGD([param], lr=0.1,
                                                                  momentum=0.9)) == 1.0
        assert seen == []
        param.grad = torch.zeros(3)
        torch.optim.SGD([param], lr=0.1).step()
        assert seen == ["pre", "post"]
    finally:
        pre.remove()
        post.remove()
