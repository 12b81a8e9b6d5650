"""The suite as a reader finds it: test modules are named by what they test, and make test keeps
the guide's blocks together (issue 42 item 3)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# Names that say when a test was written, not what it tests.
ROUND = re.compile(r"round\d|followups?|first_day|first_use|everyday|session\d|issue\d|_i\d+\b")


def test_no_test_module_is_named_after_a_round():
    named_after_a_round = sorted(p.name for p in TESTS.glob("test_*.py") if ROUND.search(p.stem))
    assert named_after_a_round == [], "name it by the package or behaviour it tests"


def test_make_test_keeps_each_xdist_group_on_one_worker():
    """``xdist_group`` marks (the guide's blocks, a world shared by two tests) hold only under
    ``--dist loadgroup``: worksteal hands a later block to another worker, which replays every
    block before it."""
    makefile = (ROOT / "Makefile").read_text()
    runs = re.findall(r"^\t.*-m pytest -n .*$", makefile, re.M)
    assert runs and all("--dist loadgroup" in line or "--dist loadfile" in line
                        for line in runs), runs


SAMPLE_CONFTEST = '''
import importlib.util, sys
sys.path.insert(0, {tests!r})
spec = importlib.util.spec_from_file_location("suite_conftest", {conftest!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_collection_modifyitems = suite.pytest_collection_modifyitems
'''
SAMPLE_TESTS = '''
import os, time
import pytest

def _record(name):
    with open(os.path.join(os.environ["WORKERS_SEEN"], name), "w") as fh:
        fh.write(os.environ["PYTEST_XDIST_WORKER"])
    time.sleep(0.05)

@pytest.fixture(scope="module")
def shared():
    return 1

@pytest.mark.parametrize("i", range(6))
def test_shared(shared, i):
    _record(f"shared{{i}}")

@pytest.mark.xdist_group("named")
@pytest.mark.parametrize("i", range(6))
def test_named(i):
    _record(f"named{{i}}")

@pytest.mark.parametrize("i", range(12))
def test_free(i):
    _record(f"free{{i}}")
'''


@pytest.mark.slow  # a pytest with two xdist workers: ~5 s
def test_xdist_groups_reach_the_scheduler(tmp_path):
    """Under ``make test``'s ``-n 2 --dist loadgroup``, the tests of one ``xdist_group`` (named,
    or given by the suite's conftest to the users of a module's shared fixture) run on one
    worker, and the others are spread. pytest 9.2 with xdist 3.8 dropped every group silently
    (xdist rewrites ``item._nodeid``, which pytest 9.2 no longer reads): the guide's blocks and
    the shared runs were built on both workers."""
    import os
    import subprocess
    import sys

    (tmp_path / "conftest.py").write_text(SAMPLE_CONFTEST.format(
        tests=str(TESTS), conftest=str(TESTS / "conftest.py")))
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS.format())
    seen = tmp_path / "seen"
    seen.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
         "--dist", "loadgroup", "-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, env={**os.environ, "WORKERS_SEEN": str(seen)}, capture_output=True,
        text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers = {p.name: p.read_text() for p in seen.iterdir()}
    assert len(workers) == 24, sorted(workers)
    for group in ("shared", "named"):
        assert len({w for n, w in workers.items() if n.startswith(group)}) == 1, (group, workers)
    assert len(set(workers.values())) == 2, workers  # both workers had work


def _as_under_nohup() -> None:
    """``preexec_fn``: SIGHUP and SIGINT ignored, as ``nohup make test &`` leaves them."""
    import signal

    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow  # a pytest of two zygote tests: ~10 s
def test_the_signal_tests_pass_in_a_suite_started_under_nohup():
    """Regression: a suite started under ``nohup`` (or ``&`` from a script) passed SIGHUP (or
    SIGINT) ignored to every child; the shim then rightly started real interpreters (which keep
    ignored signals), and three zygote tests that send SIGINT to a run failed. Those tests
    start their children as a terminal would (``helpers.default_signals``); here they run in a
    pytest that inherited both signals ignored."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    # A short folder: the zygote server's socket lives under it (AF_UNIX paths: 108 bytes).
    basetemp = tempfile.mkdtemp(prefix="nohup-")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
             "-m", "not slow", "-k", "shim_runs_ddp_exp_from_the_server or callers_signals",
             "--basetemp", os.path.join(basetemp, "t"), str(TESTS / "test_zygote.py")],
            cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=600,
            stdin=subprocess.DEVNULL, preexec_fn=_as_under_nohup)
    finally:
        shutil.rmtree(basetemp, ignore_errors=True)
    tail = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) == 2 and "skipped" not in proc.stdout, tail
