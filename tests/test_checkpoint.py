"""Checkpoint errors a user reads: a checkpoint of another model names the keys that differ."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from ddp_exp.io import checkpoint
from ddp_exp.io.checkpoint import model_mismatch
from ddp_exp.io.files import BackgroundWriter
from ddp_exp.train.models import CNN, MLP


def test_a_checkpoint_of_another_model_names_the_keys_and_the_model():
    """The refusal quoted torch's first line only ("Error(s) in loading state_dict for CNN:"),
    which names no key. It now names the state-dict keys and the model._target_ of each."""
    mlp, cnn = MLP((1, 8, 8), 10), CNN((1, 8, 8), 10)
    state = {"model": mlp.state_dict(),
             "config": {"model": {"_target_": "ddp_exp.train.models.MLP"}}}
    with pytest.raises(RuntimeError) as caught:
        cnn.load_state_dict(state["model"])
    line = model_mismatch(caught.value, state, {"_target_": "ddp_exp.train.models.CNN"})
    assert "\n" not in line
    assert "Missing key(s) in state_dict" in line and "Unexpected key(s) in state_dict" in line
    first_mlp_key = next(iter(mlp.state_dict()))
    assert f'"{first_mlp_key}"' in line, line
    assert line.endswith("the checkpoint was written with model._target_=ddp_exp.train.models.MLP, "
                         "this run has model._target_=ddp_exp.train.models.CNN")


def test_a_checkpoint_with_other_shapes_names_the_parameter():
    small, large = MLP((1, 8, 8), 10, hidden_sizes=[16]), MLP((1, 8, 8), 10, hidden_sizes=[32])
    state = {"model": small.state_dict(),
             "config": {"model": {"_target_": "ddp_exp.train.models.MLP"}}}
    with pytest.raises(RuntimeError) as caught:
        large.load_state_dict(state["model"])
    line = model_mismatch(caught.value, state, {"_target_": "ddp_exp.train.models.MLP"})
    name = next(k for k, v in small.state_dict().items()
                if v.shape != large.state_dict()[k].shape)
    assert f"size mismatch for {name}" in line, line
    assert "model._target_" not in line  # the same model class: only the shapes differ


# ------------------------------------------------------ checkpoints written in the background
def _state(value: float, epoch: int = 0) -> dict:
    return {"model": {"w": torch.full((4,), value)}, "epoch": epoch, "global_step": epoch + 1}


def test_background_writes_run_in_order_and_snapshot_the_tensors(tmp_path):
    """The loop's checkpoint is serialized when it is submitted (the next steps change the
    live tensors in place) and the files are written in submission order: the last write of a
    path wins, and an epoch file's pruning sees every earlier epoch file."""
    writer = BackgroundWriter()
    state = _state(1.0)
    checkpoint.save(str(tmp_path), state, keep_epoch_file=False, keep=2, writer=writer)
    state["model"]["w"].add_(100.0)  # what the next optimizer step does to a parameter
    for epoch in range(1, 4):
        checkpoint.save(str(tmp_path), _state(float(epoch), epoch), keep_epoch_file=True,
                        keep=2, writer=writer)
    checkpoint.save(str(tmp_path), _state(7.0, 4), keep_epoch_file=False, keep=2,
                    writer=writer, last=False, best=True)
    writer.close()
    folder = checkpoint.checkpoint_dir(str(tmp_path))
    assert sorted(os.listdir(folder)) == ["best.pt", "epoch_0002.pt", "epoch_0003.pt", "last.pt"]
    last = checkpoint.load(os.path.join(folder, "last.pt"))
    assert last["epoch"] == 3 and last["model"]["w"].tolist() == [3.0] * 4  # not best's
    best = checkpoint.load(checkpoint.best_path(str(tmp_path)))
    assert best["model"]["w"].tolist() == [7.0] * 4
    # The thread held back until the tensor has changed: the file still holds the snapshot.
    first = tmp_path / "first"
    writer = BackgroundWriter()
    release = threading.Event()
    writer.submit(release.wait)
    state = _state(1.0)
    checkpoint.save(str(first), state, keep_epoch_file=False, keep=1, writer=writer)
    state["model"]["w"].add_(100.0)
    release.set()
    writer.wait()
    saved = checkpoint.load(os.path.join(checkpoint.checkpoint_dir(str(first)), "last.pt"))
    assert saved["model"]["w"].tolist() == [1.0] * 4
    writer.close()


def test_a_failed_background_write_is_raised_by_the_next_call_and_leaves_the_old_file(
        tmp_path, monkeypatch):
    """A write that fails on the writer's thread (here: fsync, as on a full disk) is raised
    by the next submit or wait, once, and the previous complete checkpoint stays in place
    with no temp file beside it."""
    writer = BackgroundWriter()
    checkpoint.save(str(tmp_path), _state(1.0), keep_epoch_file=False, keep=1, writer=writer)
    writer.wait()
    real_fsync = os.fsync

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    checkpoint.save(str(tmp_path), _state(2.0, 1), keep_epoch_file=False, keep=1, writer=writer)
    with pytest.raises(OSError, match="No space left"):
        writer.wait()
    writer.wait()  # reported once
    monkeypatch.setattr(os, "fsync", real_fsync)
    folder = checkpoint.checkpoint_dir(str(tmp_path))
    assert os.listdir(folder) == ["last.pt"]
    assert checkpoint.load(os.path.join(folder, "last.pt"))["epoch"] == 0
    monkeypatch.setattr(os, "fsync", full_disk)
    checkpoint.save(str(tmp_path), _state(3.0, 2), keep_epoch_file=False, keep=1, writer=writer)
    while not writer.idle():  # the failure happens on the thread ...
        time.sleep(0.01)
    with pytest.raises(OSError, match="No space left"):  # ... and the next save raises it
        checkpoint.save(str(tmp_path), _state(4.0, 3), keep_epoch_file=False, keep=1,
                        writer=writer)
    monkeypatch.setattr(os, "fsync", real_fsync)
    writer.close()
    assert checkpoint.load(os.path.join(folder, "last.pt"))["epoch"] == 0


def test_background_writer_fsyncs_each_file_before_renaming_it(tmp_path, monkeypatch):
    """The background thread keeps atomic_write's order: the temp file's data reaches the
    disk (fsync) before the rename makes it the checkpoint."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace",
                        lambda a, b: (events.append("replace " + os.path.basename(b)),
                                      real_replace(a, b))[1])
    writer = BackgroundWriter()
    checkpoint.save(str(tmp_path), _state(1.0), keep_epoch_file=False, keep=1, writer=writer)
    checkpoint.save(str(tmp_path), _state(2.0, 1), keep_epoch_file=False, keep=1, writer=writer,
                    best=True)
    writer.close()
    # A new best epoch: serialized once, last.pt landed, best.pt a copy of its own, each
    # fsynced before its rename.
    assert events == ["fsync", "replace last.pt", "fsync", "replace last.pt", "fsync",
                      "replace best.pt"]


def test_a_best_epoch_is_written_under_every_name_it_is_due(tmp_path):
    """The epoch that is the monitor's new best writes its checkpoint under last.pt, best.pt
    and its epoch file, each a file of its own (no shared inode: issue 42); the next epoch's
    last.pt replaces that name only, and best.pt keeps the best epoch's checkpoint, whole (it
    can be resumed from)."""
    folder = checkpoint.checkpoint_dir(str(tmp_path))
    checkpoint.save(str(tmp_path), _state(1.0, 0), keep_epoch_file=True, keep=3, best=True)
    names = ["best.pt", "epoch_0000.pt", "last.pt"]
    assert sorted(os.listdir(folder)) == names
    inodes = {os.stat(os.path.join(folder, n)).st_ino for n in names}
    assert len(inodes) == 3 and os.stat(os.path.join(folder, "last.pt")).st_nlink == 1
    checkpoint.save(str(tmp_path), _state(2.0, 1), keep_epoch_file=False, keep=3)
    best = checkpoint.load(checkpoint.best_path(str(tmp_path)))
    last = checkpoint.load(os.path.join(folder, "last.pt"))
    assert (best["epoch"], best["model"]["w"].tolist()) == (0, [1.0] * 4)
    assert (last["epoch"], last["model"]["w"].tolist()) == (1, [2.0] * 4)
    assert set(best) == set(last)  # the whole state, not only the weights
    with pytest.raises(ValueError, match="neither"):
        checkpoint.save(str(tmp_path), _state(3.0, 2), keep_epoch_file=False, keep=3,
                        last=False)


def _gather_rng_rank(rank: int, world_size: int, port: int, out) -> None:
    """One rank of a gloo world: its own RNG stream (seed 100 + rank, advanced by rank + 1
    draws), then every rank's states gathered, on the default group and (as the checkpoint
    writer does) over a side group on another thread after this thread drew on; puts (rank,
    own state, the gathered lists)."""
    from ddp_exp.distributed.process_group import (
        World,
        destroy_process_group,
        gather_rng_states,
        init_process_group,
        side_group,
        start_rng_gather,
    )

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    init_process_group("gloo", World.from_env(), 60)
    torch.manual_seed(100 + rank)
    torch.rand(rank + 1)
    own = torch.get_rng_state()
    gathered = gather_rng_states(torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), own)  # gathering draws nothing
    deferred = start_rng_gather(torch.device("cpu"), side_group(60).group)
    torch.rand(7)  # the loop trains on before the writer gathers: the states read above count
    on_writer: list = []
    thread = threading.Thread(target=lambda: on_writer.extend(deferred.wait()))
    thread.start()
    thread.join(timeout=60)
    # bytes, pickled by value (a tensor would pass a file descriptor that dies with this
    # process); the storage size says whether each state is its own tensor
    out.put((rank, own.numpy().tobytes(),
             [[(s["torch"].numpy().tobytes(), s["torch"].untyped_storage().nbytes(), s["cuda"])
               for s in states] for states in (gathered, on_writer)]))
    destroy_process_group()


@pytest.mark.slow
def test_every_ranks_rng_state_is_gathered_in_rank_order():
    """A step checkpoint holds every rank's RNG states (one all_gather of one byte tensor per
    rank, not all_gather_object's pickles): in a world of 3, each rank's list holds rank r's
    own CPU state at index r, as separate tensors (not views of one buffer, which torch.save
    would store whole), and no CUDA state on the CPU. The same from a side group's gather,
    run on another thread after the rank drew on (the checkpoint writer's, issue 42): each
    rank's states as they were when it was started."""
    import torch.multiprocessing as mp
    from helpers import free_port

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_gather_rng_rank, args=(r, 3, port, out)) for r in range(3)]
    for p in procs:
        p.start()
    results = sorted((out.get(timeout=120) for _ in procs), key=lambda item: item[0])
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    owns = [own for _, own, _ in results]
    assert owns[0] != owns[1]  # the streams differ: the check can fail
    for _, _, both in results:
        for gathered in both:  # the default group's, the side group's on a thread
            assert len(gathered) == 3
            for r, (state, nbytes, cuda) in enumerate(gathered):
                assert state == owns[r] and cuda is None
                assert nbytes == len(owns[r])


def test_before_write_runs_on_the_writer_thread_before_the_file_lands(tmp_path):
    """A step checkpoint's TensorBoard events must be in their file before the checkpoint is
    (a resume's purge_step reads them): ``before_write`` runs on the background writer, and
    the checkpoint file does not exist yet while it runs."""
    seen = []
    writer = BackgroundWriter()

    def before() -> None:
        seen.append((threading.current_thread() is threading.main_thread(),
                     os.path.exists(os.path.join(checkpoint.checkpoint_dir(str(tmp_path)),
                                                 "last.pt"))))

    checkpoint.save(str(tmp_path), {"epoch": 0}, False, 1, writer, last=True,
                    before_write=before)
    writer.wait()
    assert seen == [(False, False)]
    assert os.path.exists(os.path.join(checkpoint.checkpoint_dir(str(tmp_path)), "last.pt"))


def test_a_background_checkpoint_holds_the_state_of_when_it_was_saved(tmp_path):
    """``checkpoint.save`` with the background writer serializes on the writer's thread, after
    the loop has trained on: what it writes must be the state at the call (tensors cloned,
    containers rebuilt), not the live parameters of a later step."""
    release = threading.Event()
    writer = BackgroundWriter()
    writer.submit(release.wait)  # the writer is busy: the save below waits behind it
    model = MLP((1, 8, 8), 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    groups = [{"lr": 0.1, "params": [0, 1]}]
    checkpoint.save(str(tmp_path), {"epoch": 0, "model": model.state_dict(),
                                    "optimizer": {"param_groups": groups}}, False, 1, writer)
    with torch.no_grad():  # the loop's next steps, before the file is written
        for p in model.parameters():
            p.add_(1.0)
    groups[0]["lr"] = 0.5
    release.set()
    writer.wait()
    saved = checkpoint.load(os.path.join(checkpoint.checkpoint_dir(str(tmp_path)), "last.pt"))
    first = next(iter(before))
    assert not torch.equal(saved["model"][first], model.state_dict()[first])  # it moved on
    for key, value in before.items():
        assert torch.equal(saved["model"][key], value), key
    assert saved["optimizer"]["param_groups"][0]["lr"] == 0.1


# ------------------------------------------------- the config: JSON text, encoded once per run
def test_the_config_is_stored_as_json_text_and_loaded_as_the_dict(tmp_path, compose):
    """A checkpoint stores the resolved config as one JSON string (``config_json``), encoded
    once per run: torch.save pickled the dict's ~170 objects at every checkpoint (issue 42).
    ``checkpoint.load`` gives it back as the dict ``config``, equal to the run's, with
    ``weights_only=True``; a checkpoint of the previous layout (the dict) loads as it was; a
    damaged text is one line naming the key; a dict JSON cannot give back (int keys) is
    stored as it is."""
    import dataclasses
    import json

    from omegaconf import OmegaConf

    from ddp_exp.config.errors import ConfigError
    from ddp_exp.config.view import rank_config

    plain = OmegaConf.to_container(compose("trainer.epochs=3", "optim.lr=0.05"), resolve=True,
                                   enum_to_str=True)
    cfg = rank_config(plain)
    assert cfg.stored_json is cfg.stored_json  # encoded once
    assert json.loads(cfg.stored_json) == plain
    state = {**_state(1.0), checkpoint.CONFIG_JSON: cfg.stored_json}
    path = checkpoint.save(str(tmp_path), state, keep_epoch_file=False, keep=1)
    raw = torch.load(path, weights_only=True)
    assert isinstance(raw[checkpoint.CONFIG_JSON], str) and "config" not in raw
    loaded = checkpoint.load(path)
    assert loaded["config"] == plain and checkpoint.CONFIG_JSON not in loaded
    assert loaded["config"]["optim"]["lr"] == 0.05 and loaded["config"]["trainer"]["epochs"] == 3
    # the previous layout: the dict itself
    old = checkpoint.save(str(tmp_path / "old"), {**_state(1.0), "config": plain},
                          keep_epoch_file=False, keep=1)
    assert checkpoint.load(old)["config"] == plain
    damaged = checkpoint.save(str(tmp_path / "damaged"),
                              {**_state(1.0), checkpoint.CONFIG_JSON: '{"seed": '},
                              keep_epoch_file=False, keep=1)
    with pytest.raises(ConfigError) as refused:
        checkpoint.load(damaged)
    assert str(refused.value) == (f"trainer.resume={damaged!r}: its config_json is not a JSON "
                                  "object: the checkpoint is damaged")
    assert dataclasses.replace(cfg, stored={**plain, "extra": {1: "a"}}).stored_json is None
