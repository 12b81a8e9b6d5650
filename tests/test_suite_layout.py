"""The suite as a reader finds it: test modules are named by what they test, and make test keeps
the guide's blocks together (issue 42 item 3)."""

from __future__ import annotations

import re
from pathlib import Path

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
