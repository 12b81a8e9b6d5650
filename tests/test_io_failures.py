"""I/O failures are one line naming the file (issue 32 item 5, R16, R20): a full disk under the
job folder (by fault injection in-process, and once for real on a small tmpfs where the machine
lets the test mount one), bookkeeping writes that stay best-effort, and an image deleted while a
run reads its folder (a runtime I/O failure, not a config error).
"""

from __future__ import annotations

import errno
import os

import pytest
from helpers import QUIET


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

    def part_then_full(src, dst):  # the copy stops part-way: the disk filled
        dst.write(b"{")
        dst.flush()
        _no_space()

    monkeypatch.setattr(files, "_copy_into", part_then_full)
    jobdir.keep_error_files(SimpleNamespace(failures={0: failure}), str(tmp_path / "job"))
    assert failure.error_file.startswith("<not kept: ")
    # Whole or not at all (a fresh user's full disk left a 0-byte errors/rank0.json).
    assert os.listdir(tmp_path / "job" / "errors") == []
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


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux's /proc")
def test_a_checkpoints_permissions_come_from_the_umask_read_without_changing_it(tmp_path,
                                                                               monkeypatch):
    """``atomic_write`` gives the file the usual permissions (0666 less the umask) and reads
    the umask without setting it: ``os.umask(0)`` and back, on the writer thread at every
    checkpoint, left a window in which a file another thread made (TensorBoard's, the log)
    got mode 0666."""
    from ddp_exp.io import files

    old = os.umask(0o027)
    try:
        def refused(mask):
            raise AssertionError(f"os.umask({mask:#o}) called: the umask changed")

        monkeypatch.setattr(files.os, "umask", refused)
        assert files.process_umask() == 0o027
        files.atomic_write(str(tmp_path / "last.pt"), lambda fh: fh.write(b"x"))
        assert (tmp_path / "last.pt").stat().st_mode & 0o777 == 0o640
    finally:
        monkeypatch.undo()
        os.umask(old)
