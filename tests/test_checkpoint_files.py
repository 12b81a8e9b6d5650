"""Checkpoint files that do not share a fate (issue 42 item 1): ``last.pt``, ``best.pt`` and
``epoch_NNNN.pt`` are files of their own (no hard link, so a file system without them works),
epoch files rotate by number past epoch 9,999, a kill while the writer lands an epoch's
checkpoint resumes from the one before, and a checkpoint of the previous release loads."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from helpers import QUIET, TESTS, load_ckpt

from ddp_exp.config.errors import ConfigError
from ddp_exp.io import checkpoint
from ddp_exp.io.files import BackgroundWriter, copy_file

# A checkpoint written by the previous release (commit 12b77ff, names hard-linked): the end of
# epoch 1 of `python -m ddp_exp world_size=2 trainer.epochs=1 model.hidden_sizes=[16]
# trainer.checkpoint_every_n_epochs=1`.
PREVIOUS_RELEASE = TESTS / "fixtures" / "checkpoint_v1_12b77ff.pt"
PREVIOUS_RUN = ["world_size=2", "model.hidden_sizes=[16]", QUIET]


def _state(value: float, epoch: int) -> dict:
    return {"model": {"w": torch.full((4,), value)}, "epoch": epoch, "global_step": epoch + 1}


def _no_link(src, dst, *args, **kwargs):
    raise PermissionError(errno.EPERM, "Operation not permitted", src, None, dst)


def test_damage_to_last_pt_leaves_best_pt_and_the_epoch_file_loadable(tmp_path, monkeypatch):
    """An epoch that is the new best lands under last.pt, best.pt and its epoch file; with
    ``os.link`` refused (exFAT, some network mounts) the saves complete all the same, each name
    a file of its own: ``truncate -s 0 last.pt`` leaves the other two loadable (it made them
    fail with EOFError when they were hard links), and the refusal to load last.pt names the
    intact epoch file."""
    monkeypatch.setattr(os, "link", _no_link)
    writer = BackgroundWriter()
    for epoch in range(3):
        checkpoint.save(str(tmp_path), _state(float(epoch), epoch), keep_epoch_file=True,
                        keep=2, writer=writer, best=epoch == 1)
    writer.close()
    folder = Path(checkpoint.checkpoint_dir(str(tmp_path)))
    assert sorted(p.name for p in folder.iterdir()) == [
        "best.pt", "epoch_0001.pt", "epoch_0002.pt", "last.pt"]
    assert len({p.stat().st_ino for p in folder.iterdir()}) == 4
    os.truncate(folder / "last.pt", 0)
    best = checkpoint.load(str(folder / "best.pt"))
    newest = checkpoint.load(str(folder / "epoch_0002.pt"))
    assert (best["epoch"], best["model"]["w"].tolist()) == (1, [1.0] * 4)
    assert (newest["epoch"], newest["model"]["w"].tolist()) == (2, [2.0] * 4)
    with pytest.raises(ConfigError, match="an intact checkpoint beside it: trainer.resume=.*"
                                          "epoch_0002.pt"):
        checkpoint.load(str(folder / "last.pt"))


def test_repairing_best_pt_copies_without_a_link(tmp_path, monkeypatch):
    """A run killed between last.pt and best.pt (the best epoch's) has best.pt put back before
    any rank starts: a copy of last.pt, also where ``os.link`` is refused."""
    monkeypatch.setattr(os, "link", _no_link)
    checkpoint.save(str(tmp_path), _state(0.0, 0), keep_epoch_file=False, keep=1, best=True)
    state = {**_state(5.0, 1), "monitor": {"best_epoch": 1}}
    checkpoint.save(str(tmp_path), state, keep_epoch_file=False, keep=1)
    last = os.path.join(checkpoint.checkpoint_dir(str(tmp_path)), "last.pt")
    assert checkpoint.repair_best(last, state)
    best = checkpoint.best_path(str(tmp_path))
    assert not os.path.samefile(last, best)
    assert checkpoint.load(best)["model"]["w"].tolist() == [5.0] * 4
    assert not checkpoint.repair_best(last, state)  # already the same checkpoint


def test_a_copy_falls_back_where_the_kernel_cannot_copy(tmp_path, monkeypatch):
    """Where neither a clone nor ``copy_file_range`` works (another file system, an old
    kernel), the copy is made in Python: the same bytes, a file of its own."""
    src, dst = tmp_path / "a.pt", tmp_path / "b.pt"
    payload = os.urandom(3 << 20)
    src.write_bytes(payload)

    def refused(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refused, raising=False)
    copy_file(str(src), str(dst))
    assert dst.read_bytes() == payload and not os.path.samefile(src, dst)
    monkeypatch.undo()
    dst.unlink()
    copy_file(str(src), str(dst))  # the kernel's copy (or a clone), where it works
    assert dst.read_bytes() == payload and not os.path.samefile(src, dst)


def test_epoch_files_rotate_by_number_past_epoch_9999(tmp_path):
    """``keep_checkpoints=2`` past epoch 9,999: ``epoch_10000.pt`` sorts below
    ``epoch_9999.pt`` as text, so a rotation by name deleted each new file as soon as it was
    written; by number the newest two stay, and the newest is the one named for resuming."""
    folder = Path(checkpoint.checkpoint_dir(str(tmp_path)))
    folder.mkdir()
    for epoch in (998, 9998, 9999):
        torch.save({"format": checkpoint.FORMAT, **_state(float(epoch), epoch)},
                   folder / f"epoch_{epoch:04d}.pt")
    assert checkpoint.rotate(str(folder), 2) == [str(folder / "epoch_0998.pt")]
    for epoch in (10000, 10001):
        checkpoint.save(str(tmp_path), _state(float(epoch), epoch), keep_epoch_file=True,
                        keep=2)
        assert (folder / f"epoch_{epoch}.pt").exists()
    assert sorted(p.name for p in folder.glob("epoch_*.pt")) == [
        "epoch_10000.pt", "epoch_10001.pt"]
    assert [n for n, _ in checkpoint.epoch_files(str(folder))] == [10000, 10001]
    assert checkpoint.newest_epoch_file(str(folder / "last.pt")) == str(folder /
                                                                        "epoch_10001.pt")
    os.truncate(folder / "last.pt", 0)
    assert checkpoint.intact_beside(str(folder / "last.pt")) == str(folder / "epoch_10001.pt")


def test_a_checkpoint_of_the_previous_release_loads():
    """The previous release's file (format v1) loads with weights_only=True and holds what a
    resume reads: the model, both ranks' RNG states, the epoch and step."""
    from ddp_exp.train.models import MLP

    state = checkpoint.load(str(PREVIOUS_RELEASE))
    assert (state["epoch"], state["global_step"], state["position"]) == (0, 24, 0)
    assert len(state["rng"]) == 2 and state["world_size"] == 2
    MLP((1, 8, 8), 10, [16]).load_state_dict(state["model"])


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_a_previous_release_checkpoint_resumes_exactly(run_cli):
    """Resumed from the previous release's checkpoint to epoch 2, a run ends with the weights
    of a run of two epochs never stopped (the same world, the same computation).

    The fixture's first epoch was computed on another CPU, whose kernels round differently
    (its weights differ from this machine's first epoch by up to 6e-8, and the two-epoch
    results by 1.8e-7, measured), so the runs must agree to 1e-6 per tensor, not bit for bit;
    the optimizer's momentum read as zeros moves them by 0.17."""
    whole = run_cli(*PREVIOUS_RUN, "trainer.epochs=2", job="whole").ok()
    resumed = run_cli(*PREVIOUS_RUN, "trainer.epochs=2", f"trainer.resume={PREVIOUS_RELEASE}",
                      job="resumed").ok()
    assert "epoch 1 done, step 24" in resumed.stdout + resumed.stderr
    got, want = (load_ckpt(r.job_dir / "model.pt") for r in (resumed, whole))
    assert got.keys() == want.keys()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-6, f"resumed weights differ from the uninterrupted run's by {worst:.2e}"


@pytest.mark.slow
def test_a_job_folder_without_hard_links_checkpoints_and_completes(run_cli):
    """A whole run where ``os.link`` raises PermissionError in every process (the launcher and
    both ranks: ``nolink_site``) checkpoints every epoch and completes (it exited 1 at its first
    checkpoint on exFAT); then ``truncate -s 0 last.pt`` leaves best.pt and the newest epoch
    file loadable, and a run resumed from that epoch file trains on."""
    env = {"DDP_EXP_TEST_NO_LINK": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS / "nolink_site"),
                                          os.environ.get("PYTHONPATH", "")])}
    run = ["world_size=2", QUIET, "trainer.checkpoint_every_n_epochs=1",
           "trainer.keep_checkpoints=2"]
    done = run_cli(*run, "trainer.epochs=3", env=env).ok()
    assert json.loads((done.job_dir / "status.json").read_text())["status"] == "completed"
    folder = done.job_dir / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [
        "best.pt", "epoch_0001.pt", "epoch_0002.pt", "last.pt"]
    os.truncate(folder / "last.pt", 0)
    assert load_ckpt(folder / "epoch_0002.pt")["epoch"] == 2
    assert load_ckpt(folder / "best.pt")["model"].keys()
    more = run_cli(*run, "trainer.epochs=4", f"trainer.resume={folder / 'epoch_0002.pt'}",
                   job="more", env=env).ok()
    assert more.metrics["epoch"] == 4


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_sigkill_while_the_writer_lands_an_epoch_checkpoint_resumes_from_the_one_before(
        default_run_2_epochs, tmp_path):
    """The whole world SIGKILLed while rank 0's background writer lands epoch 2's checkpoint
    (its temp file written, cut here to half to be a half-written file, not renamed): last.pt
    is epoch 1's, the half-written file is never loaded (deleted), and resume=auto ends with
    the uninterrupted run's outputs."""
    from kill_points import RUN, kill_at, resume_auto, same_outputs

    job = tmp_path / "run"
    kill_at(job, tmp_path, "last.pt:2")
    folder = job / "checkpoints"
    partial = list(folder.glob(".last.pt.*.tmp"))
    assert len(partial) == 1
    os.truncate(partial[0], partial[0].stat().st_size // 2)
    assert load_ckpt(folder / "last.pt")["epoch"] == 0
    resume_auto(job, tmp_path, *RUN)
    same_outputs(job, default_run_2_epochs.job_dir)
    assert not partial[0].exists()
