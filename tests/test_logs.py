"""What a run prints (issue 7): written to a file, plain log lines each tagged with its rank or
the launcher (no colours, no carriage returns); with ``trainer.progress=bar``, a bar on stderr.
"""

from __future__ import annotations

import re

ANSI_OR_CR = re.compile(r"\x1b\[|\r")


TAGGED = re.compile(r"^\[[^\]]+\]\[(rank\d+|launcher)\]")


def test_output_to_a_file_is_plain_log_lines_each_tagged(default_run_2_epochs):
    """Not a terminal: no bar escape codes; every line of the job log carries its rank or the
    launcher tag; non-zero ranks log nothing at INFO (the session's world_size=2, 2-epoch run,
    its output captured)."""
    run = default_run_2_epochs
    log_text = (run.job_dir / "ddp_exp.log").read_text()
    for text in (run.stdout, log_text):
        assert not ANSI_OR_CR.search(text)
    lines = [ln for ln in log_text.splitlines() if ln.strip()]
    assert lines and all(TAGGED.match(ln) for ln in lines), lines
    assert not [ln for ln in lines if "[rank1]" in ln and "[INFO]" in ln]
    # the two epochs' result lines (a busy machine may add "epoch N: rank R is a straggler")
    assert sum(bool(re.match(r"epoch \d+/2 \| step ", ln.split(" - ", 1)[1]))
               for ln in lines) == 2


def test_progress_bar_mode_draws_a_bar_on_stderr(run_cli):
    """trainer.progress=bar draws tqdm's bar (rank 0 only); log lines stay clean."""
    run = run_cli("world_size=2", "trainer.epochs=1", "print_config=false",
                  "trainer.progress=bar").ok()
    assert "epoch 1/1" in run.stderr and "step" in run.stderr
    assert not ANSI_OR_CR.search((run.job_dir / "ddp_exp.log").read_text())
