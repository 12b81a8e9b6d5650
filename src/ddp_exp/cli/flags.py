"""Hydra's flags on the command line: they go before the overrides.

Hydra's parser (argparse) takes its flags (``--config-dir conf``, ``--cfg job``) only before
the first override; one placed among the overrides (``model=tiny --config-dir conf
data=dataset``) got argparse's 8-line usage and "unrecognized arguments" naming the overrides
after it, not the flag. :func:`flag_among_overrides` finds such a flag before Hydra parses and
gives one line naming it and the command with the flags first. ``-m``/``--multirun`` is moved
first without a word (:func:`ddp_exp.launch.torchrun_env.multirun_flag_first`).

May use: nothing of ddp_exp.
"""

from __future__ import annotations

import shlex

# Hydra 1.3's flags (``python -m ddp_exp --help``): each spelling -> how many values follow
# ("?" one optional value from a known set).
HYDRA_FLAGS: dict[str, int | str] = {
    "--help": 0, "-h": 0, "--hydra-help": 0, "--version": 0, "--resolve": 0,
    "--run": 0, "-r": 0, "--multirun": 0, "-m": 0,
    "--cfg": 1, "-c": 1, "--package": 1, "-p": 1, "--shell-completion": 0, "-sc": 0,
    "--config-path": 1, "-cp": 1, "--config-name": 1, "-cn": 1, "--config-dir": 1, "-cd": 1,
    "--experimental-rerun": 1, "--info": "?", "-i": "?",
}
INFO_CHOICES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def _flag(arg: str) -> str | None:
    """The Hydra flag ``arg`` spells (``--config-dir`` for ``--config-dir=conf``), or None."""
    name = arg.partition("=")[0] if arg.startswith("--") else arg
    return name if name in HYDRA_FLAGS else None


def _split(argv: list[str]) -> tuple[list[str], list[str], tuple[str, str] | None]:
    """``argv``'s Hydra flags (with their values) and overrides, each in their order, and the
    first flag that argparse would refuse with the override before it (or None)."""
    flags: list[str] = []
    overrides: list[str] = []
    after: tuple[str, str] | None = None  # the first flag after an override, and that override
    misplaced: tuple[str, str] | None = None  # ... once an override follows it (argparse's error)
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag = _flag(arg)
        if flag is None:
            if after is not None and misplaced is None:
                misplaced = after
            overrides.append(arg)
            i += 1
            continue
        takes = HYDRA_FLAGS[flag]
        group = [arg]
        if "=" not in arg and i + 1 < len(argv) and (
                takes == 1 or (takes == "?" and argv[i + 1] in INFO_CHOICES)):
            group.append(argv[i + 1])
        if overrides and after is None:
            after = (" ".join(group), overrides[-1])
        flags.extend(group)
        i += len(group)
    return flags, overrides, misplaced


def flags_first(argv: list[str]) -> list[str]:
    """``argv`` (arguments without the program) with its Hydra flags before its overrides, the
    same command for Hydra's parser where it takes it (flags after every override), so that
    overrides ddp_exp appends (torchrun's ranks, a primary config's check) stay overrides."""
    flags, overrides, _ = _split(argv)
    return [*flags, *overrides]


def flag_among_overrides(argv: list[str], prog: str = "python -m ddp_exp") -> str | None:
    """One line for a Hydra flag among the overrides in ``argv`` (the arguments, without the
    program): an override before it and one after it, which argparse refuses ("unrecognized
    arguments"; flags after every override it accepts). Names the flag and the override before
    it, and gives the command reordered (flags with their values first, overrides in their
    order). None when Hydra's parser takes the command."""
    flags, overrides, misplaced = _split(argv)
    if misplaced is None:
        return None
    given, after = misplaced
    fixed = shlex.join([*flags, *overrides])
    return (f"{given} comes after the override {after}: Hydra takes its flags only before the "
            f"overrides; put them first: {prog} {fixed}")
