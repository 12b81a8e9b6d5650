"""The suite's fixtures and hooks. The helpers tests share live in ``helpers.py`` (tests import
them from there: ``from helpers import QUIET, run_tagged``)."""

from __future__ import annotations

import os
import signal
import sys
import uuid

import pytest
from helpers import HANG_S, Run, run_tagged, shared_run


def pytest_configure(config) -> None:
    """Every child a test starts may be sent SIGINT as a terminal's Ctrl-C would. A shell
    starts background jobs with SIGINT ignored (``make test &``, a CI runner's script), an
    ignored signal stays ignored in children, and ddp_exp keeps a signal ignored at start
    ignored on purpose (nohup, issue 32): a test's SIGINT then did nothing and the test timed
    out (test_signal_during_checkpoint_write_leaves_no_partial_file in a background CI run).
    A handler installed here is reset to the default in every child that execs, so the suite
    behaves as from a terminal wherever it is started. Runs in each xdist worker too."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# Fixtures that start the CLI: run_cli, and the session's shared runs (below).
CLI_FIXTURES = {"run_cli", "start_cli", "default_run_1_epoch", "default_run_2_epochs"}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """``make test-fast`` (``-m "not slow"``) runs what runs in this process and a smoke set of
    CLI runs: a test that starts the CLI (the ``run_cli`` fixture, ~2-5 s each, or a shared run
    of :data:`CLI_FIXTURES`) is ``slow`` unless it is marked ``smoke``."""
    del config
    for item in items:
        starts_cli = CLI_FIXTURES & set(getattr(item, "fixturenames", ()))
        if starts_cli and item.get_closest_marker("smoke") is None:
            item.add_marker(pytest.mark.slow)
        _group_by_shared_fixture(item)


def _group_by_shared_fixture(item) -> None:
    """A test that uses a module- or session-scoped fixture of its own module (the module's
    shared runs: ``runs``, ``sweep``, ``gpt_runs``, ...) joins the xdist group of that fixture,
    so that ``--dist loadgroup`` builds it on one worker: spread over both, each worker built it
    (two ~30 s builds of test_closed_output's runs in one suite). Tests that already name a
    group keep theirs."""
    if item.get_closest_marker("xdist_group") is not None:
        return
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        defs = info.name2fixturedefs.get(name) if info is not None else None
        if defs and defs[-1].scope in ("module", "session") and defs[-1].baseid.endswith(".py"):
            item.add_marker(pytest.mark.xdist_group(f"{defs[-1].baseid}::{name}"))
            return


@pytest.fixture
def run_cli(tmp_path):
    """``run_cli(*overrides, job="run", timeout=180, env=None)`` runs ``python -m ddp_exp`` with
    ``hydra.run.dir=<tmp>/<job>`` in a temp cwd and checks that no process outlives it. The
    limit is a hang detector: at least :data:`helpers.HANG_S` whatever ``timeout`` says."""

    def run(*overrides: str, job: str = "run", timeout: float = 180, env: dict | None = None,
            launcher: list[str] | None = None, run_dir: bool = True) -> Run:
        job_dir = tmp_path / job
        args = list(overrides) + ([f"hydra.run.dir={job_dir}"] if run_dir else [])
        cmd = (launcher or [sys.executable, "-m", "ddp_exp"]) + args
        proc, seconds = run_tagged(cmd, tmp_path, uuid.uuid4().hex, max(timeout, HANG_S), env)
        return Run(proc.returncode, proc.stdout, proc.stderr, job_dir, seconds)

    return run


@pytest.fixture(scope="session")
def default_run_1_epoch(tmp_path_factory) -> Run:
    """The default job (world_size=2) for one epoch, ``trainer.epochs=1 print_config=false``,
    run once for the whole session, all xdist workers together (:func:`helpers.shared_run`),
    in a folder of its own (its cwd holds only its job folder ``run/``): the reference that
    tests compare with, or copy (:func:`helpers.copy_job`) to start in a finished run's folder.
    Tests only read it."""
    return shared_run(tmp_path_factory, "world_size=2", "trainer.epochs=1", "print_config=false")


@pytest.fixture(scope="session")
def default_run_2_epochs(tmp_path_factory) -> Run:
    """The default job (world_size=2) for two epochs, ``trainer.epochs=2 print_config=false``,
    run once for the whole session (as :func:`default_run_1_epoch`): the single-node world
    that other launches must reproduce. Tests only read it."""
    return shared_run(tmp_path_factory, "world_size=2", "trainer.epochs=2", "print_config=false")


@pytest.fixture(autouse=True)
def _no_hydra_config_left():
    """A test that sets Hydra's process-wide HydraConfig (an in-process ``compose(...,
    return_hydra_config=True)``, a job run in this process) leaves it behind for the next test
    on the same xdist worker, whose ``command_folder()`` then named the first test's folder
    (test_an_unimportable_user_module_says_where_python_looked failed in CI, passed alone).
    Cleared after every test."""
    yield
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().cfg = None


@pytest.fixture(autouse=True)
def _start_up_variables_kept():
    """A test leaves the variables an interpreter reads at start-up (``PYTHON*``, ``OMP_*``,
    ...: :func:`zygote._startup_environment`) as it found them: a change left behind makes
    every later CLI run of its worker differ from the pre-imported server's and start a real
    process (the suite ran 60% longer in CI), or run where a real one would not."""
    import zygote

    before = zygote._startup_environment(dict(os.environ))
    yield
    after = zygote._startup_environment(dict(os.environ))
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"the test left start-up variables changed: {changed}"


@pytest.fixture
def compose():
    """``compose(*overrides)`` -> the composed config (no ``hydra`` node), in this process."""
    import hydra

    from ddp_exp.config.compose import register_configs

    register_configs()
    with hydra.initialize_config_module(config_module="ddp_exp.conf", version_base="1.3"):
        yield lambda *overrides: hydra.compose("config", overrides=list(overrides))
