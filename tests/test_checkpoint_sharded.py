"""Sharded checkpoints (``strategy=fsdp``, ``strategy.checkpoint=sharded``; issue 40 items 2
and 3): every rank writes its shard into a folder that lands atomically, a world killed once a
step checkpoint inside an epoch is on disk resumes with ``trainer.resume=auto`` at another world
size (1 and 3 ranks, the same global batch) to the uninterrupted run's weights, TensorBoard
shows every step once, and a folder a kill left half-written is never loaded.

The kill lands where ``resume_support.HoldingMLP`` holds rank 0 once ``last.pt`` names a step
checkpoint inside epoch 2 (the test waits for the file, never for a time); the whole process
group gets SIGKILL (``helpers.kill_when_held``, as the step-checkpoint tests do). The expected
weights are the uninterrupted run's ``model.pt``, never the resumed code's own output.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from helpers import QUIET, kill_when_held, run_tagged, tensorboard_series
from helpers import tests_on_path as on_path
from resume_support import mid_epoch, write_holding_yaml

# SGD on digits, a global batch of 48 (32 steps per epoch), 60 steps, a step checkpoint every 5.
# epoch_0000.pt: the sharded checkpoint at the first epoch's end (step 32).
COMMON = ["strategy=fsdp", "optim=sgd", "optim.lr=0.05", "trainer.epochs=2",
          "trainer.max_steps=60", "trainer.checkpoint_every_n_steps=5",
          "trainer.checkpoint_every_n_epochs=1", QUIET]


def world(n: int) -> list[str]:
    return [f"world_size={n}", f"data.batch_size={48 // n}"]


def run(job: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    proc, _ = run_tagged([sys.executable, "-m", "ddp_exp", *args, f"hydra.run.dir={job}"], cwd,
                         uuid.uuid4().hex, 240, on_path())
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def weights(job: Path) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in torch.load(job / "model.pt", weights_only=True).items()}


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The uninterrupted run (2 ranks) and a copy of it SIGKILLed at step 38, with the step
    checkpoint of step 35 (inside epoch 2) on disk."""
    root = tmp_path_factory.mktemp("sharded_kill")
    plain = write_holding_yaml(root / "plain")  # HoldingMLP that never holds
    reference = root / "reference"
    run(reference, root, *plain, *COMMON, *world(2))
    job, marker = root / "killed", root / "held"
    last = job / "checkpoints" / "last.pt"
    held = write_holding_yaml(root / "conf", 38, str(last), 0, str(marker))
    kill_when_held(job, root, [*held, *COMMON, *world(2)], marker)
    return root, plain, reference, job


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_killed_world_resumes_at_one_and_three_ranks(killed, tmp_path):
    root, plain, reference, job = killed
    from ddp_exp.config.errors import ConfigError
    from ddp_exp.io import checkpoint

    state = mid_epoch(job / "checkpoints" / "last.pt")
    assert state is not None and state["global_step"] == 35 and state["position"] == 3 * 48
    named = checkpoint.shards_of(str(job / "checkpoints" / "last.pt"))
    assert sorted(p.name for p in Path(named).iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]
    assert not (job / "metrics.json").exists()
    # What a kill inside the next checkpoint's write leaves: every rank's shard, no metadata.
    partial = job / "checkpoints" / "sharded" / ".5eed-8.tmp"
    partial.mkdir()
    for shard in Path(named).glob("__*.distcp"):
        shutil.copy(shard, partial / shard.name)
    with pytest.raises(ConfigError, match="half-written"):
        checkpoint.load(str(partial))
    want = weights(reference)
    want_steps = [s for s, _ in tensorboard_series(reference, "train/loss")]
    for n in (1, 3):
        copy = tmp_path / f"resumed{n}"
        shutil.copytree(job, copy)
        proc = run(copy, root, *plain, *COMMON, *world(n), "trainer.resume=auto")
        out = proc.stdout + proc.stderr
        assert "resumed from" in out and "step 35, inside epoch 2" in out, out[-2000:]
        metrics = json.loads((copy / "metrics.json").read_text())
        assert metrics["global_step"] == 60 and metrics["world_size"] == n
        got = weights(copy)
        assert got.keys() == want.keys()
        for name in want:
            rel = float((got[name] - want[name]).norm() / want[name].norm())
            assert rel <= 1e-5, (n, name, rel)
        steps = [s for s, _ in tensorboard_series(copy, "train/loss")]
        assert len(steps) == len(set(steps)) and steps == want_steps, (n, steps)
        assert not (copy / "checkpoints" / "sharded" / partial.name).exists()  # cleaned up
        folders = sorted(p.name for p in (copy / "checkpoints" / "sharded").iterdir())
        named_now = {Path(checkpoint.shards_of(str(p))).name
                     for p in (copy / "checkpoints").glob("*.pt")}
        assert set(folders) == named_now  # no folder that no name names
    # The uninterrupted run's checkpoint at the first epoch's end, by path, at 3 ranks in a
    # folder of its own: the same end.
    epoch_end = reference / "checkpoints" / "epoch_0000.pt"
    assert checkpoint.load(str(epoch_end))["global_step"] == 32
    fresh = tmp_path / "from_epoch_end"
    proc = run(fresh, root, *plain, *COMMON, *world(3), f"trainer.resume={epoch_end}")
    assert "epoch 1 done, step 32" in proc.stdout + proc.stderr
    got = weights(fresh)
    assert max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want) <= 1e-5


@pytest.mark.parametrize("overrides, named", [
    (["strategy=ddp", "strategy.checkpoint=sharded"], "strategy.checkpoint=sharded needs"),
    (["strategy=fsdp", "strategy.checkpoint=zip"], "strategy.checkpoint='zip'"),
])
def test_checkpoint_kind_refused_before_any_rank(compose, tmp_path, overrides, named):
    from helpers import refused_before_ranks

    assert named in refused_before_ranks(compose(*overrides), tmp_path / "job")


def test_a_first_sharded_checkpoint_killed_mid_write_starts_afresh(tmp_path):
    """A world killed while it wrote its first sharded checkpoint leaves a temp folder (and
    maybe a sealed folder no name names yet): no checkpoint, so trainer.resume=auto starts the
    run afresh there, and the start deletes the temp folder; a named folder is a checkpoint."""
    from ddp_exp.job.earlier_run import killed_first_epoch
    from ddp_exp.job.folder import remove_partial_files

    job = tmp_path / "run"
    partial = job / "checkpoints" / "sharded" / ".5eed-1.tmp"
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"x")
    (job / "checkpoints" / "sharded" / "step_00000005").mkdir()
    assert killed_first_epoch(str(job)) is None
    assert remove_partial_files(str(job)) == [str(partial)]
    assert not partial.exists()
    torch.save({"format": "ddp_exp/checkpoint/v1", "shards": "sharded/step_00000005"},
               job / "checkpoints" / "last.pt")
    assert killed_first_epoch(str(job)) == "it holds a checkpoint"


def test_a_folder_that_does_not_fit_says_which_tensor(tmp_path):
    """A sharded checkpoint read into another model fails with DCP's own one-line reason (the
    tensor named), not its ``CheckpointException`` (a ``BaseException`` holding every rank's
    traceback); the same model reads it back exactly, optimizer state included."""
    import torch.distributed.checkpoint as dcp

    from ddp_exp.io import sharded

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(sharded.state_tensors(model, optimizer), checkpoint_id=tmp_path, no_dist=True)
    same = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    same_optimizer = torch.optim.SGD(same.parameters(), lr=0.1, momentum=0.9)
    sharded.load_model(str(tmp_path), same, no_dist=True)
    sharded.load_optimizer(str(tmp_path), same, same_optimizer, no_dist=True)
    for p, q in zip(model.parameters(), same.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(optimizer.state[p]["momentum_buffer"],
                           same_optimizer.state[q]["momentum_buffer"])
    wider = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    with pytest.raises(ValueError, match=r"Size mismatch.*model\.0\.weight"):
        sharded.load_model(str(tmp_path), wider, no_dist=True)
    deeper = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2),
                                 torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=r"Missing key.*model\.2\.weight"):
        sharded.load_model(str(tmp_path), deeper, no_dist=True)


@pytest.mark.slow
@pytest.mark.float_sensitive  # which epoch is the best
def test_test_split_with_best_weights_reads_the_sharded_best(tmp_path):
    """``trainer.test_weights=best`` under FSDP: every rank reads its slices of the folder
    ``best.pt`` names (epoch 2 is the best here, not the last), and the test metrics and the
    final ``model.pt`` (the last weights, put back) equal those of the same run with full
    checkpoints, bit for bit (the same weights, the same computation)."""
    args = ["strategy=fsdp", *world(2), "trainer.epochs=3", "data.test_size=150",
            "trainer.test_weights=best", "trainer.monitor=val/accuracy", QUIET]
    sharded_run = run(tmp_path / "sharded", tmp_path, *args)
    run(tmp_path / "full", tmp_path, *args, "strategy.checkpoint=full")
    assert "best weights, epoch 2" in sharded_run.stdout + sharded_run.stderr
    assert (tmp_path / "sharded" / "checkpoints" / "sharded").is_dir()
    got, want = (json.loads((tmp_path / n / "metrics.json").read_text())
                 for n in ("sharded", "full"))
    for key in ("test/loss", "test/accuracy", "test/num_samples"):
        assert got[key] == want[key], key
    a, b = weights(tmp_path / "sharded"), weights(tmp_path / "full")
    assert all(torch.equal(a[k], b[k]) for k in b)
