"""The launch session (:mod:`ddp_exp.launch.session`): the steps from a composed config to the
ranks' start are written once, in one order, and both launch paths take them. Before, the
elastic path and the torchrun/srun path each listed the same dozen steps in their own order,
and a step added to one (the refusal of a copied Optuna trial link) was missing from the other
(its end-to-end regression: tests/test_trial_link.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ddp_exp.config.errors import ConfigError
from ddp_exp.launch import session

LAUNCH = Path(__file__).resolve().parents[1] / "src" / "ddp_exp" / "launch"
ENTRIES = ("elastic.py", "torchrun.py")
# What the session does for both paths; an entry that called one itself would be a second
# copy of the setup.
SESSION_STEPS = {"settle", "validate", "refuse_trial_link_in_a_plain_run", "resolve_placement",
                 "check_precision", "oversubscription_warning", "check_targets", "log_config",
                 "config_as_run", "prepare", "preempted_in"}


def _called(path: Path) -> set[str]:
    """Names of the functions ``path`` calls (``f(...)`` and ``module.f(...)``: the last part)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                names.add(func.id)
            elif isinstance(func, ast.Attribute):
                names.add(func.attr)
    return names


@pytest.mark.parametrize("entry", ENTRIES)
def test_both_entries_take_the_sessions_steps_and_repeat_none(entry):
    called = _called(LAUNCH / entry)
    assert not called & SESSION_STEPS, f"{entry} calls {sorted(called & SESSION_STEPS)} itself"
    assert {"check", "build", "raise_if_preempted"} <= called, entry


def test_the_session_checks_before_it_builds(compose, tmp_path, monkeypatch):
    """Phase 1 refuses a bad config before phase 2 imports a ``_target_`` or reads data: a run
    with both faults names the config's, as it did on both paths."""
    cfg = compose("trainer.epochs=0", "model._target_=no_such_module.Net")
    with pytest.raises(ConfigError, match="^trainer.epochs"):
        session.check(cfg)
    built = []
    monkeypatch.setattr(session, "prepare", lambda *args: built.append(args))
    placement = session.check(compose("model._target_=no_such_module.Net", "device=cpu"))
    assert placement == session.Placement(nproc=2, device="cpu", backend="gloo")
    with pytest.raises(ConfigError, match="no_such_module"):
        session.build(compose("model._target_=no_such_module.Net"), str(tmp_path), placement)
    assert built == []  # refused before the data and the model
