"""Issue 32 items 3-8: runs that survive their environment (the users'
cases R11, R12, R16, R19): ``group=null`` and ``~group``, a primary config of the user's own,
leftover torchrun variables, nohup, a full disk, and the smaller reports of item 8."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from helpers import QUIET
from omegaconf import OmegaConf

from ddp_exp.config.compose import group_options, null_group_line

HYDRA_NULL_GROUP = ValueError("Config group override must be a string or a list. Got NoneType")


# --- item 6 (R19): group=null and ~group -------------------------------------------------------

def test_null_group_names_the_option_that_means_none():
    """``scheduler=null`` was Hydra's 41-line ValueError, exit 1: now one line with the hint."""
    line = null_group_line(HYDRA_NULL_GROUP, ["world_size=2", "scheduler=null"])
    assert line == ("scheduler=null: a config group takes one of its options, not null; "
                    "scheduler=none")
    # the options are the packaged files of conf/model/, listed in order
    import ddp_exp.conf

    models = sorted(p.stem for p in Path(ddp_exp.conf.__file__).parent.joinpath(
        "model").glob("*.yaml"))
    assert null_group_line(HYDRA_NULL_GROUP, ["model=null"]).endswith(
        f"choose one of {', '.join(models)}")
    assert "leave debug out" in null_group_line(HYDRA_NULL_GROUP, ["debug=null"])
    # Another error, or a null that is not a group's (a key with a dot), is not this one.
    assert null_group_line(ValueError("other"), ["scheduler=null"]) is None
    assert null_group_line(HYDRA_NULL_GROUP, ["trainer.max_steps=null"]) is None
    assert group_options("scheduler") == ["cosine", "none", "step"]
    assert group_options("no_such_group") == []


def test_deleted_group_is_one_line_with_its_options(compose, tmp_path):
    """``~data`` was a 63-line MissingMandatoryValue traceback that left a folder."""
    from helpers import refused_before_ranks

    message = refused_before_ranks(compose("~data"), tmp_path / "run")
    assert message.startswith("data is required but was not set: add data=... (one of ")
    assert "digits" in message and "synthetic" in message


def test_null_group_on_the_command_line(run_cli):
    run = run_cli("scheduler=null")
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == ("error: scheduler=null: a config group takes one of its "
                                  "options, not null; scheduler=none")
    assert not run.job_dir.exists()


# --- item 7: a primary config of the user's own ------------------------------------------------

def test_primary_config_without_ddp_exps_is_one_line(run_cli, tmp_path):
    """``--config-dir D --config-name bare`` with a ``bare.yaml`` whose defaults list lacks
    ddp_exp's ``config`` was a 70-line "Key 'launcher' is not in struct", exit 1, a folder
    left: now one line saying what the primary config must include, before any folder."""
    conf = tmp_path / "myconf"
    conf.mkdir()
    (conf / "bare.yaml").write_text("defaults:\n  - data: digits\n  - _self_\nworld_size: 1\n")
    run = run_cli("--config-dir", str(conf), "--config-name", "bare")
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --config-name bare: "), run.stderr
    assert "defaults: [config, <your options>, _self_]" in lines[0]
    assert not run.job_dir.exists()


def test_primary_config_check_only_for_a_named_primary_config():
    from ddp_exp.config.compose import PrimaryConfigCheck, primary_config_overrides

    assert primary_config_overrides(["world_size=2", "--config-dir", "conf"]) == []
    for argv in (["--config-name", "bare"], ["-cn", "bare"], ["--config-name=bare"]):
        [override] = primary_config_overrides(argv)
        assert override.endswith("=ddp_exp.config.compose.PrimaryConfigCheck")
    with pytest.raises(SystemExit) as info:
        PrimaryConfigCheck().on_run_start(config=OmegaConf.create({"world_size": 1}),
                                          config_name="bare")
    assert info.value.code == 2


# --- item 4 (R12): leftover torchrun variables ------------------------------------------------

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
    from ddp_exp.launch.torchrun import ignore_leftover_torchrun_variables, under_torchrun

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


# --- item 3 (R11): nohup -----------------------------------------------------------------------

def test_a_signal_ignored_at_start_stays_ignored_in_the_launcher_and_every_rank(tmp_path):
    """Under ``nohup`` (SIGHUP ignored), a closed terminal's SIGHUP to the whole process group
    ended the run: exit 129, "interrupted (SIGHUP)" (torch's agent installs its handler, and
    the forked ranks inherit it; pytorch/pytorch #76894). Now the run trains to its end."""
    import signal
    import subprocess
    import sys
    import uuid

    from helpers import assert_no_orphans, cli_env

    def nohup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    tag, job = uuid.uuid4().hex, tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "ddp_exp", "trainer.epochs=20", QUIET,
                             f"hydra.run.dir={job}"], cwd=tmp_path, env=cli_env(tag),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=nohup)
    lines, sent = [], False
    for line in proc.stdout:  # the hangup comes while the ranks train (epoch 2 of 20)
        lines.append(line)
        if not sent and "epoch 2/20" in line:
            os.killpg(proc.pid, signal.SIGHUP)
            sent = True
    assert proc.wait(timeout=120) == 0, "".join(lines)
    assert sent and "epoch 20/20" in "".join(lines), "".join(lines)
    assert (job / "metrics.json").exists()
    assert_no_orphans(tag)


# --- item 5 (R16): a full disk ------------------------------------------------------------------
# In-process by fault injection (ENOSPC raised where the file is written), and once for real on a
# small tmpfs where this machine lets the test mount one (root with CAP_SYS_ADMIN; skipped
# elsewhere).

def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_atomic_write_on_a_full_disk_names_the_path_and_keeps_the_old_file(tmp_path):
    from ddp_exp.io.files import DiskFull, atomic_write

    path = tmp_path / "last.pt"
    path.write_bytes(b"epoch 3")

    def write(fh):
        fh.write(b"half")
        _no_space()

    with pytest.raises(DiskFull) as info:
        atomic_write(str(path), write)
    assert str(info.value).startswith(f"no space left on the disk that holds {path} ")
    assert "\n" not in str(info.value)
    assert path.read_bytes() == b"epoch 3" and [p.name for p in tmp_path.iterdir()] == [
        "last.pt"]


def test_bookkeeping_writes_are_best_effort_on_a_full_disk(tmp_path, monkeypatch, capsys):
    """``write_status`` raised from ``atomic_write`` with a traceback, and copying the error
    files raised again so torch's failure table never printed; a sweep's summary likewise."""
    from types import SimpleNamespace

    from ddp_exp.io import files
    from ddp_exp.job import folder as jobdir
    from ddp_exp.job import sweep

    monkeypatch.setattr(files, "_unwritten_reported", set(), raising=False)
    monkeypatch.setattr(files.tempfile, "mkstemp", _no_space)
    jobdir.write_status(str(tmp_path), "failed", [], 1.0, "rank 0 failed: ValueError: x")
    jobdir.write_status(str(tmp_path), "failed", [], 1.0, "again")  # one line per process
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: status.json not written: no space left on the disk that holds "
                   f"{tmp_path / 'status.json'} ([Errno 28] No space left on device): free "
                   "space there, or give hydra.run.dir a folder on another disk"], err
    # Where the run's own line says the disk is full, not a word more.
    monkeypatch.setattr(files, "_unwritten_reported", set(), raising=False)
    jobdir.write_status(str(tmp_path), "failed", [], 1.0,
                        "rank 0 failed: DiskFull: no space left on the disk that holds x")
    assert capsys.readouterr().err == ""
    assert not (tmp_path / "status.json").exists()

    error_file = tmp_path / "agent" / "error.json"
    error_file.parent.mkdir()
    error_file.write_text("{}")
    failure = SimpleNamespace(error_file=str(error_file), message={"message": "DiskFull: no "
                              "space left on the disk that holds x"})
    monkeypatch.setattr(jobdir.shutil, "copyfile", _no_space)
    jobdir.keep_error_files(SimpleNamespace(failures={0: failure}), str(tmp_path / "job"))
    assert failure.error_file.startswith("<not kept: ")
    row = {"job": "0", "overrides": "a=1", "status": "completed", "val/loss": 0.5,
           "val/accuracy": 0.9, "train/epoch_loss": 0.4, "samples_per_sec": 1e4, "wall_s": 3.0}
    sweep.write_summary(str(tmp_path), [row])
    assert capsys.readouterr().err == ""  # reported once already in this process


@pytest.mark.parametrize("filler_kib, where", [
    (360, "run/checkpoints/last.pt"),  # 40 KiB left: the first last.pt does not fit
    (372, "run"),  # 28 KiB left: TensorBoard's first event write fails, naming no file
], ids=["checkpoint", "event-file"])
def test_a_full_disk_is_one_line_naming_it(run_cli, tmp_path, filler_kib, where):
    """R16. The event-file case (fresh-user finding): TensorBoard's writer thread printed its
    traceback, the job log's handler printed '--- Logging error ---' and the line ended in
    'OSError: [Errno 28]' naming no path; now the rank's DiskFull line names the job folder."""
    import subprocess

    disk = tmp_path / "small"
    disk.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs",
                                  str(disk)], capture_output=True).returncode == 0
    except OSError:
        mounted = False
    if not mounted:
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
    try:
        (disk / "filler").write_bytes(b"\0" * (filler_kib * 1024))
        run = run_cli("trainer.epochs=3", QUIET, f"hydra.run.dir={disk / 'run'}",
                      run_dir=False)
        assert run.returncode == 1, run.stderr
        assert run.stderr.strip().splitlines() == [
            f"error: rank 0 failed: DiskFull: no space left on the disk that holds "
            f"{disk / where} ([Errno 28] No space left on device): "
            "free space there, or give hydra.run.dir a folder on another disk"], run.stderr
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


# --- item 8: the smaller reports ---------------------------------------------------------------

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


def test_an_image_deleted_mid_run_is_an_io_failure_not_a_config_error(tmp_path):
    """R20: an image deleted while the run reads the folder is a runtime I/O failure (exit 1,
    one line naming the file); it was reported as ``ddp_exp.config.errors.ConfigError``."""
    from PIL import Image

    from ddp_exp.config.errors import ConfigError
    from ddp_exp.data.images import decode

    gone = tmp_path / "cat" / "1.png"
    with pytest.raises(OSError) as info:
        decode(str(gone), 8, 1)
    assert isinstance(info.value, FileNotFoundError) and not isinstance(info.value, ConfigError)
    assert str(gone) in str(info.value) and "\n" not in str(info.value)
    bad = tmp_path / "bad.png"  # a file that is no image stays the data's (config) error
    bad.write_bytes(b"not an image")
    with pytest.raises(ConfigError):
        decode(str(bad), 8, 1)
    Image.new("L", (8, 8)).save(tmp_path / "ok.png")
    assert decode(str(tmp_path / "ok.png"), 8, 1).shape == (1, 8, 8)


def test_the_troubleshooting_table_says_how_long_a_paused_world_may_wait():
    """A world stopped with Ctrl-Z for longer than ``distributed.timeout_s`` dies on resume
    with gloo's "Timed out waiting ... for recv": the README's troubleshooting table names
    the key that sets the bound."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("## Troubleshooting", 1)[1].split("\n## ", 1)[0]
    [row] = [ln for ln in table.splitlines() if "Ctrl-Z" in ln]
    assert "Timed out waiting" in row and "distributed.timeout_s" in row, row
