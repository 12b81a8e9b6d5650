"""Checkpoint files on disk: one complete file per epoch whatever the world size, and a damaged
``last.pt`` names the intact checkpoint beside it.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import (
    QUIET,
    STEPS_3,
    load_ckpt,
    temp_files,
)


# ---------------------------------------------------------------- 6. checkpoint files (C13)
@pytest.mark.slow
@pytest.mark.parametrize("keep", [None, 2])
def test_three_ranks_write_one_complete_checkpoint_per_epoch(run_cli, keep):
    """C13: world_size=3, 3 epochs, a checkpoint every epoch: exactly epoch_0000..0002.pt plus
    last.pt (and best.pt), each loadable with weights_only=True and recording its epoch; no temp
    files. With keep_checkpoints=2 only the newest two epoch files stay."""
    extra = [f"trainer.keep_checkpoints={keep}"] if keep else []
    run = run_cli("world_size=3", "trainer.epochs=3", "trainer.checkpoint_every_n_epochs=1",
                  *extra, QUIET, timeout=240).ok()
    folder = run.job_dir / "checkpoints"
    epochs = [0, 1, 2] if keep is None else [1, 2]
    names = [f"epoch_{e:04d}.pt" for e in epochs]
    # best.pt: the best epoch's weights of trainer.monitor (val/loss by default), not an epoch
    # checkpoint.
    assert sorted(os.listdir(folder)) == sorted(names + ["last.pt", "best.pt"])
    assert temp_files(folder) == []
    assert load_ckpt(folder / "best.pt")["epoch"] in (0, 1, 2)
    for e, name in zip(epochs, names, strict=True):
        state = load_ckpt(folder / name)
        assert state["epoch"] == e, name
        assert state["global_step"] == (e + 1) * STEPS_3, name
    last = load_ckpt(folder / "last.pt")
    assert last["epoch"] == 2
    final = torch.load(run.job_dir / "model.pt", weights_only=True)
    assert last["model"].keys() == final.keys()
    for name in final:
        assert torch.equal(last["model"][name], final[name]), name


def test_a_truncated_last_pt_points_to_the_intact_checkpoint_beside_it(tmp_path):
    """R15: the line ended "(OSError: [Errno 22] Invalid argument)" and named no way out;
    ``best.pt`` as a hard link to the same truncated file is no way out either."""
    import torch

    from ddp_exp.config.errors import ConfigError
    from ddp_exp.io import checkpoint

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for epoch in (0, 1):
        torch.save({"format": checkpoint.FORMAT, "epoch": epoch}, folder / f"epoch_{epoch:04d}.pt")
    data = (folder / "epoch_0001.pt").read_bytes()
    last = folder / "last.pt"
    last.write_bytes(data[: len(data) // 2])
    os.link(last, folder / "best.pt")
    with pytest.raises(ConfigError) as info:
        checkpoint.load(str(last))
    message = str(info.value)
    assert message == (f"trainer.resume={str(last)!r}: cannot load it as a checkpoint: not a "
                       "complete torch.save file: truncated or corrupt; an intact checkpoint "
                       f"beside it: trainer.resume={folder / 'epoch_0001.pt'}"), message
    for name in ("epoch_0000.pt", "epoch_0001.pt"):
        (folder / name).unlink()
    with pytest.raises(ConfigError) as info:  # no intact one: nothing is promised
        checkpoint.load(str(last))
    assert str(info.value).endswith("truncated or corrupt"), str(info.value)
