"""What a library already does (issue 27 item 4), and the tests' own house (item 6): the job
folder's lock is ``filelock``'s, a job's overrides are read by Hydra's own override parser,
resize-and-crop is Pillow's ``ImageOps.fit``; helpers live in ``helpers.py`` and no test module
imports another."""

from __future__ import annotations

import ast
import errno
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import TESTS, session_dir

# ------------------------------------------------------------ the job folder's lock (4a)
HOLD = """
import sys
from ddp_exp.job.lock import job_folder_lock  # no torch: the holder starts at once
with job_folder_lock(sys.argv[1], sys.argv[2]):
    print("held", flush=True)
    sys.stdin.readline()
"""


def _job(tmp_path: Path, config: str) -> tuple[Path, Path]:
    job = tmp_path / "run"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "config.yaml").write_text(config)
    return job, job / ".hydra"


def test_a_folder_held_by_another_process_is_busy_and_keeps_its_record(tmp_path):
    """Another process holds the folder (its record in the lock file): this run is refused
    with JobFolderBusy, the holder's record goes back into ``.hydra/`` (Hydra had rewritten it
    for the refused run) and stays in the lock file (a contender must not truncate it); once the
    holder ends, the folder is free at once and the lock file, kept under ``.hydra/``, still
    holds the record."""
    from ddp_exp.job.folder import LOCK_FILE, JobFolderBusy, job_folder_lock

    job, hydra = _job(tmp_path, "seed: 1\n")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(job), str(hydra)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (hydra / "config.yaml").write_text("seed: 2\n")  # Hydra's record of the refused run
        with pytest.raises(JobFolderBusy, match="in use by another running job"):
            with job_folder_lock(str(job), str(hydra)):
                pass
        assert (hydra / "config.yaml").read_text() == "seed: 1\n"
        assert json.loads((hydra / LOCK_FILE).read_text())["config.yaml"] == "seed: 1\n"
    finally:
        holder.communicate("\n", timeout=60)
    assert holder.returncode == 0
    with job_folder_lock(str(job), str(hydra)):
        pass
    assert sorted(p.name for p in job.iterdir()) == [".hydra"]
    assert json.loads((hydra / LOCK_FILE).read_text()) == {"config.yaml": "seed: 1\n"}


def test_a_finished_folders_lock_file_is_free(tmp_path):
    """The lock file a finished run leaves (``.hydra/.ddp_exp.lock``, holding the record) is
    not held by anyone: any ``filelock`` on it is taken at once, and a lock held through
    ``filelock`` by another tool makes the folder busy."""
    from filelock import FileLock

    from ddp_exp.job.folder import LOCK_FILE, JobFolderBusy, job_folder_lock

    job, hydra = _job(tmp_path, "seed: 0\n")
    with job_folder_lock(str(job), str(hydra)):
        pass
    lock = FileLock(hydra / LOCK_FILE, blocking=False, preserve_lock_file=True)
    with lock:  # free: no Timeout
        with pytest.raises(JobFolderBusy):
            with job_folder_lock(str(job), str(hydra)):
                pass
    assert json.loads((hydra / LOCK_FILE).read_text()) == {"config.yaml": "seed: 0\n"}


def test_a_folder_that_cannot_be_locked_says_so(tmp_path, monkeypatch):
    """A file system without ``flock`` (some network mounts: ENOLCK) is one line naming the
    lock file and what to do, not "in use by another running job"; the folder's record stays."""
    import filelock

    from ddp_exp.job.folder import LOCK_FILE, JobFolderBusy, LeaveFolderAlone, job_folder_lock

    def no_locks(self, *args, **kwargs):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(filelock.FileLock, "acquire", no_locks)
    job, hydra = _job(tmp_path, "seed: 0\n")
    (hydra / LOCK_FILE).write_text(json.dumps({"config.yaml": "seed: 1\n"}))
    with pytest.raises(LeaveFolderAlone) as info:
        with job_folder_lock(str(job), str(hydra)):
            pass
    assert not isinstance(info.value, JobFolderBusy)
    assert str(info.value) == (f"hydra.run.dir={str(job)!r}: cannot lock {hydra / LOCK_FILE} "
                               "(No locks available); give the run a folder on a local disk")
    assert (hydra / "config.yaml").read_text() == "seed: 1\n"


# ------------------------------------------------- a job's overrides, Hydra's parser (4b)
def _job_folder(sweep: Path, name: str, overrides: list[str], status: bool) -> None:
    """A finished job folder of a sweep: its overrides in status.json, or (status=False, a job
    killed before writing one) only in Hydra's ``.hydra/overrides.yaml``."""
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(
        "".join(f"- {json.dumps(o)}\n" for o in overrides))
    (job / "metrics.json").write_text(json.dumps({"val/loss": 0.5 + int(name) / 10}))
    if status:
        (job / "status.json").write_text(json.dumps(
            {"status": "completed", "overrides": overrides, "wall_s": 1.0, "error": None}))


def test_a_quoted_override_with_a_space_and_a_comma_is_one_swept_value(tmp_path):
    """Regression: the summary split each job's overrides at spaces, so ``+tag='a b, c'``
    became three "overrides" (``+tag='a``, ``b,``, ``c'``): the swept key was lost (the plot's x
    axis fell back to the job number) and keys that are not keys appeared. Hydra's own parser
    reads each override: one key, its value unquoted; summary.csv shows the overrides as
    before."""
    from ddp_exp.job.summary import collect, override_items, swept_keys, write_summary

    sweep = tmp_path / "sweep"
    _job_folder(sweep, "0", ["data.batch_size=16", "+tag='a b, c'"], status=True)
    _job_folder(sweep, "1", ["data.batch_size=16", "+tag='a d'"], status=False)
    rows = collect(str(sweep))
    assert swept_keys(rows) == ["+tag"]
    assert [override_items(r["overrides"]) for r in rows] == [
        {"data.batch_size": "16", "+tag": "a b, c"}, {"data.batch_size": "16", "+tag": "a d"}]
    write_summary(str(sweep), rows)
    lines = (sweep / "summary.csv").read_text().splitlines()
    assert lines[1].startswith("0,\"data.batch_size=16 +tag='a b, c'\",completed,"), lines
    assert lines[2].startswith("1,data.batch_size=16 +tag='a d',completed,"), lines
    # A row as summary.csv shows it (one string) reads the same.
    assert override_items("data.batch_size=16 +tag='a b, c'") == override_items(
        rows[0]["overrides"])


# --------------------------------------------------- resize-and-crop, ImageOps.fit (4c)
def _symmetric(w: int, h: int) -> np.ndarray:
    """A grey ``h x w`` image symmetric about its centre, row for row and column for column."""
    yy, xx = np.mgrid[0:h, 0:w]
    return (np.abs(yy - (h - 1) / 2) * 20 + np.abs(xx - (w - 1) / 2) * 20).astype(np.uint8)


@pytest.mark.parametrize("size", [(10, 21), (21, 10), (20, 30)], ids=["tall", "wide", "9px"])
def test_resize_and_crop_takes_the_exact_centre(tmp_path, size):
    """Regression: an image symmetric about its centre stays symmetric once resized and
    cropped to ``data.image_size``. Resizing first (10x21 -> 8x17) and cropping whole pixels of
    the result, as ddp_exp did before Pillow's ``ImageOps.fit``, took the square half a pixel
    off centre (rows 4-11 of 17): mirrored rows differed by up to 26 levels (112 at 20x30 -> 9)."""
    from PIL import Image

    from ddp_exp.data.images import decode

    Image.fromarray(_symmetric(*size), mode="L").save(tmp_path / "a.png")
    side = 9 if size == (20, 30) else 8
    out = decode(str(tmp_path / "a.png"), image_size=side, channels=1)[0].astype(int)
    assert out.shape == (side, side)
    assert np.array_equal(out, out[::-1]) and np.array_equal(out, out[:, ::-1]), out


@pytest.mark.parametrize("size", [(8, 8), (8, 11), (13, 8)])
def test_an_image_whose_short_side_is_the_size_is_cropped_not_resampled(tmp_path, size):
    """``data.image_size`` equal to the files' shorter side (the bundled digits: 8x8) keeps
    every pixel: the central square in whole pixels (rows 1-8 of 11), no resampling."""
    from PIL import Image

    from ddp_exp.data.images import decode

    w, h = size
    pixels = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(pixels, mode="RGB").save(tmp_path / "a.png")
    out = decode(str(tmp_path / "a.png"), image_size=8, channels=3)
    top, left = (h - 8) // 2, (w - 8) // 2
    assert np.array_equal(out, pixels[top:top + 8, left:left + 8].transpose(2, 0, 1))


# ------------------------------------------------------------------ tests as a house (6)
def test_no_test_module_imports_another():
    """Shared helpers live in helpers.py: a test module importing another runs that module's
    collection-time code twice and ties the two together."""
    modules = {p.stem for p in TESTS.glob("test_*.py")}
    found = []
    for path in sorted(TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            found += [f"{path.name}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0] in modules]
    assert found == []


def test_helpers_are_not_collected_as_tests():
    """pytest collects any function named ``test*`` in a test module, a helper imported into it
    included (``tests_on_path`` ran as a test of test_dashboards.py and warned that it returned
    a dict): every such helper says ``__test__ = False``."""
    import helpers

    named_like_tests = [n for n, f in vars(helpers).items() if n.startswith("test")
                        and callable(f) and getattr(f, "__test__", True)]
    assert named_like_tests == []


def test_a_shared_run_is_made_once_per_session(tmp_path_factory, monkeypatch):
    """:func:`helpers.shared_run` runs the CLI once for every process of a session that asks
    for the same overrides (xdist workers wait on its filelock and read its record)."""
    import helpers

    calls = []

    def fake_run_once(root: Path, *overrides: str) -> helpers.Run:
        calls.append(overrides)
        (root / "run").mkdir()
        return helpers.Run(0, "out", "", root / "run", 1.5)

    monkeypatch.setattr(helpers, "run_once", fake_run_once)
    key = ("trainer.epochs=1", f"+shared_run_test={tmp_path_factory.getbasetemp().name}")
    first = helpers.shared_run(tmp_path_factory, *key)
    again = helpers.shared_run(tmp_path_factory, *key)
    assert calls == [key] and first == again
    assert first.job_dir.parent.parent == session_dir(tmp_path_factory) / "shared-runs"
    assert [p.name for p in first.job_dir.parent.iterdir()] == ["run"]
