"""Hydra's flags among the overrides (issue 41 item 5; :mod:`ddp_exp.cli.flags`).

Before: ``model=tiny --config-dir conf data=dataset`` and ``trainer.epochs=2 --cfg job seed=1``
printed argparse's usage and "unrecognized arguments" naming the overrides, not the flag.
"""

from __future__ import annotations

import pytest
from helpers import run_sweep

from ddp_exp.cli.flags import flag_among_overrides


@pytest.mark.parametrize(("argv", "line"), [
    (["model=mlp", "--config-dir", "conf", "data=dataset"],
     "--config-dir conf comes after the override model=mlp: Hydra takes its flags only before "
     "the overrides; put them first: python -m ddp_exp --config-dir conf model=mlp data=dataset"),
    (["trainer.epochs=2", "--cfg", "job", "seed=1"],
     "--cfg job comes after the override trainer.epochs=2: Hydra takes its flags only before "
     "the overrides; put them first: python -m ddp_exp --cfg job trainer.epochs=2 seed=1"),
    (["-cd", "c", "seed=1", "--info=searchpath", "x=1"],
     "--info=searchpath comes after the override seed=1: Hydra takes its flags only before "
     "the overrides; put them first: python -m ddp_exp -cd c --info=searchpath seed=1 x=1"),
    (["seed=1", "--resolve", "x=a b"],
     "--resolve comes after the override seed=1: Hydra takes its flags only before the "
     "overrides; put them first: python -m ddp_exp --resolve seed=1 'x=a b'"),
])
def test_a_flag_after_an_override_is_named_with_the_command_reordered(argv, line):
    assert flag_among_overrides(argv) == line


@pytest.mark.parametrize("argv", [
    [], ["seed=1"], ["--config-dir", "conf", "model=mlp"], ["--cfg", "job", "--resolve", "a=1"],
    ["--info", "searchpath", "seed=1"], ["--config-dir=conf", "-cn", "mine", "seed=1"],
    ["seed=1", "--cfg", "job"], ["a=1", "b=2", "--config-dir", "conf", "--resolve"],
])
def test_what_hydras_parser_takes_passes(argv):
    """Flags first, or after every override: argparse takes both."""
    assert flag_among_overrides(argv) is None


@pytest.mark.slow
def test_the_cli_refuses_it_in_one_line_before_any_folder(tmp_path):
    out = run_sweep(tmp_path, "trainer.epochs=2", "--cfg", "job", "seed=1", timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: --cfg job comes after the override trainer.epochs=2: Hydra takes its flags only "
        "before the overrides; put them first: python -m ddp_exp --cfg job trainer.epochs=2 "
        "seed=1"]
    assert out.stdout == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [
    ["model=mlp", "--config-dir", "conf", "data=dataset"], ["seed=1", "--cfg", "job"],
    ["a=1", "b=2", "--config-dir", "conf", "--resolve"], ["--cfg", "job", "seed=1", "x=2"],
    ["-cd", "c", "seed=1", "--info=searchpath", "x=1"], ["seed=1", "-p", "pkg", "x=1"],
])
def test_contract_refused_exactly_where_hydras_parser_refuses(argv, capsys):
    from hydra._internal.utils import get_args_parser

    try:
        get_args_parser().parse_args(argv)
        accepted = True
    except SystemExit:
        accepted = False
    capsys.readouterr()
    assert (flag_among_overrides(argv) is None) == accepted


def test_flags_after_every_override_are_moved_first_for_the_overrides_ddp_exp_appends():
    from ddp_exp.cli.flags import flags_first

    assert flags_first(["seed=1", "x=2", "--cfg", "job", "--resolve"]) == [
        "--cfg", "job", "--resolve", "seed=1", "x=2"]
    assert flags_first(["--config-dir=c", "seed=1"]) == ["--config-dir=c", "seed=1"]
