"""A sweep job refused by its config says so once (issue 41 item 4): its line was printed on
stderr and again by the launcher's logger on the console. Once on the console, once in the
job's ``ddp_exp.log``; ``status.json`` failed; the sweep's own line after it."""

from __future__ import annotations

import json

import pytest
from helpers import QUIET, run_sweep

LINE = ("error: data.val_size=5000 is invalid: the dataset has 1797 samples, so it must be at "
        "most 1795 (every one of the 2 ranks needs a training sample)")


@pytest.mark.slow
def test_a_refused_sweep_job_says_its_line_once(tmp_path):
    sweep = tmp_path / "sweep"
    out = run_sweep(tmp_path, "-m", "world_size=2", "data.val_size=5000,4000", "trainer.epochs=1",
                    QUIET, f"hydra.sweep.dir={sweep}")
    console = out.stdout + out.stderr
    assert console.count("data.val_size=5000 is invalid") == 1, console
    assert LINE in out.stderr.splitlines()
    assert console.count("data.val_size=4000 is invalid") == 1, console
    assert (sweep / "0" / "ddp_exp.log").read_text().count(LINE) == 1
    assert json.loads((sweep / "0" / "status.json").read_text())["status"] == "failed"
    assert out.stderr.strip().splitlines()[-1].startswith("error: 2 of 2 jobs did not complete")
