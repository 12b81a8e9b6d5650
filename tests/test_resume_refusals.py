"""What a resume refuses, before any rank starts, in one line: a resume file that is not a
checkpoint, ``trainer.resume=auto`` with nothing to resume, another optimizer or data split
(unless forced), a value that is no file; and a resumed run that finds nothing left to do
changes nothing.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from helpers import (
    QUIET,
    copy_job,
    folder_files,
    output,
    refused_before_ranks,
)


# ------------------------------------------------------------- 7. bad trainer.resume files
def _garbage(path: Path) -> None:
    path.write_bytes(b"\x00not a checkpoint\xff" * 64)


def _text(path: Path) -> None:  # /etc/passwd's kind: the unpickler raised IndexError
    path.write_text("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:"
                    "/usr/sbin/nologin\n")


def _foreign(path: Path) -> None:
    torch.save({"a": 1}, path)


def _truncated(path: Path) -> None:
    torch.save({"a": torch.zeros(1000)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _objects(path: Path) -> None:
    import argparse

    torch.save({"format": 1, "args": argparse.Namespace(lr=0.1)}, path)


TRUNCATED = "cannot load it as a checkpoint: not a complete torch.save file: truncated or corrupt"


@pytest.mark.parametrize(("make", "why"), [
    (_garbage, TRUNCATED), (_text, TRUNCATED), (_foreign, "not a ddp_exp checkpoint"),
    (_truncated, TRUNCATED),
    (_objects, "cannot load it as a checkpoint: it holds a Python object (argparse.Namespace) "
               "that is not a tensor or a plain container; files are loaded with "
               "weights_only=True, so that loading one runs no code"),
    (None, "no such checkpoint file")],
    ids=["garbage", "text", "foreign", "truncated", "objects", "missing"])
def test_bad_resume_file_is_refused_before_any_rank_naming_it(compose, tmp_path, make, why):
    """A corrupt, foreign, truncated or missing ``trainer.resume=PATH`` is refused by the
    steps the CLI runs before any rank (in-process): one line naming trainer.resume, the path
    and what is wrong with it, nothing written. (The CLI's exit and line: the test below.)"""
    path = tmp_path / "bad.pt"
    if make is not None:
        make(path)
    message = refused_before_ranks(compose("world_size=2", f"trainer.resume={path}", QUIET),
                                   tmp_path / "run")
    assert message.startswith(f"trainer.resume={str(path)!r}: {why}"), message
    assert "\n" not in message and "\x1b" not in message, message  # torch's text: 8 lines


def test_bad_resume_file_is_one_line_error_before_any_rank(run_cli, tmp_path):
    """A corrupt ``trainer.resume=PATH`` through the CLI: non-zero exit before any rank starts,
    a one-line error naming trainer.resume and the path, no traceback, no rank started (no
    tensorboard/). (Every kind of bad file in-process, above.)"""
    path = tmp_path / "bad.pt"
    _garbage(path)
    run = run_cli("world_size=2", f"trainer.resume={path}", QUIET, timeout=60)
    assert run.returncode != 0, output(run)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, run.stderr  # one line, no traceback or warning
    assert "trainer.resume" in lines[0] and str(path) in lines[0], lines
    assert "Traceback" not in output(run)
    for produced in ("tensorboard", "checkpoints", "metrics.json", "model.pt"):
        assert not (run.job_dir / produced).exists(), produced


def test_resuming_a_finished_run_changes_nothing(run_cli, tmp_path, default_run_1_epoch):
    """Regression: resume=auto on a run that trained all its epochs rewrote its metrics.json
    (train/loss null) and status.json, and added a duplicate TensorBoard point. Its last.pt
    resumed into a new folder says the same and leaves no folder (it left one holding .hydra/
    and an empty log, which `ddp_exp runs` listed as incomplete)."""
    job = copy_job(default_run_1_epoch, tmp_path)  # trainer.epochs=1, finished
    before = {p.name: p.read_bytes() for p in job.iterdir() if p.is_file()}
    record = {p.name: p.read_bytes() for p in (job / ".hydra").iterdir()}
    events = sorted((job / "tensorboard").iterdir())
    again = run_cli("trainer.epochs=1", "trainer.resume=auto", "optim.lr=0.5",
                    "print_config=false")
    assert again.returncode == 0 and "nothing left to train" in again.stderr  # says so
    assert "error" not in again.stderr
    after = {p.name: p.read_bytes() for p in job.iterdir() if p.is_file()}
    for name in ("metrics.json", "status.json", "model.pt"):
        assert after[name] == before[name], name
    # Hydra rewrote .hydra/ before the refusal; the record of what trained here is back.
    assert {p.name: p.read_bytes() for p in (job / ".hydra").iterdir()} == record
    assert sorted((job / "tensorboard").iterdir()) == events
    elsewhere = run_cli("trainer.epochs=1", f"trainer.resume={job / 'checkpoints' / 'last.pt'}",
                        "print_config=false", job="elsewhere/new")
    assert elsewhere.returncode == 0 and "nothing left to train" in elsewhere.stderr
    assert not (tmp_path / "elsewhere").exists()


def test_resume_auto_without_a_checkpoint_in_a_used_folder_is_refused(run_cli):
    """Regression: resume=auto found no last.pt and silently trained from step 0 beside the
    earlier run's event stream."""
    run_cli("trainer.epochs=1", "trainer.save_last=false", "print_config=false").ok()
    again = run_cli("trainer.epochs=2", "trainer.resume=auto", "print_config=false")
    assert again.returncode == 2
    assert "finds no checkpoints/last.pt" in again.stderr, again.stderr
    assert len(list((again.job_dir / "tensorboard").iterdir())) == 1


def test_a_resumed_run_that_completes_clears_earlier_errors(run_cli, tmp_path,
                                                            default_run_1_epoch):
    """Regression: errors/rankN.json of a failed attempt stayed beside a completed resume."""
    job = copy_job(default_run_1_epoch, tmp_path)  # trainer.epochs=1, finished
    (job / "errors").mkdir()
    (job / "errors" / "rank1.json").write_text("{}")
    run_cli("trainer.epochs=2", "trainer.resume=auto", "print_config=false").ok()
    assert not (job / "errors").exists()


def test_resume_with_another_optimizer_fails_before_the_ranks(run_cli, tmp_path,
                                                              default_run_1_epoch):
    """Regression: optim=adamw on an SGD checkpoint started the ranks, which failed with the
    whole failure table; it is one line from the launcher now, the folder untouched."""
    job = copy_job(default_run_1_epoch, tmp_path)  # trainer.epochs=1 of optim=sgd, finished
    status = (job / "status.json").read_bytes()
    run = run_cli("trainer.epochs=2", "trainer.resume=auto", "optim=adamw")
    assert run.returncode == 2
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "optimizer state does not fit optim" in lines[0], run.stderr
    assert "torch.optim.AdamW" in lines[0] and "Root Cause" not in run.stdout + run.stderr
    assert (job / "status.json").read_bytes() == status


def _split_refusal(key: str, value: str, before: object) -> str:
    return (f"{key}={value} differs from the checkpoint's {key}={before} "
            "(trainer.resume=auto): another split would move samples between training, "
            f"validation and test; resume with {key}={before}, or add "
            "trainer.resume_allow_changes=true to accept it")


def test_resume_with_another_split_is_refused_unless_forced(run_cli, tmp_path,
                                                            default_run_1_epoch):
    """U05: resuming with another seed would move training samples into validation: one line
    naming the key, exit 2, the folder unchanged; trainer.resume_allow_changes=true forces it
    and the run continues at epoch 2. (Every split key, in-process: the test below.)"""
    job = copy_job(default_run_1_epoch, tmp_path)  # trainer.epochs=1 of seed=0, finished
    kept = folder_files(job)
    run = run_cli("trainer.epochs=2", "trainer.resume=auto", "seed=1", QUIET)
    assert run.returncode == 2, run.stderr
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert lines == [f"error: {_split_refusal('seed', '1', 0)}"], run.stderr
    assert folder_files(job) == kept
    forced = run_cli("trainer.epochs=2", "trainer.resume=auto", "seed=1",
                     "trainer.resume_allow_changes=true", QUIET).ok()
    assert "epoch 2/2" in forced.stdout and "epoch 1/2" not in forced.stdout
    assert "seed=1 differs from the checkpoint's seed=0 " \
           "(trainer.resume_allow_changes=true)" in forced.stdout


@pytest.mark.parametrize("change", ["seed=1", "data.val_size=300"])
def test_a_changed_split_is_refused_before_the_ranks_unless_forced(compose, tmp_path,
                                                                   default_run_1_epoch, caplog,
                                                                   change):
    """U05 for each split key, by the steps the CLI runs before any rank (in-process): resuming
    with another seed or data.val_size is refused with one line naming the key, the used folder
    unchanged; with trainer.resume_allow_changes=true the same steps accept it and warn."""
    from ddp_exp.launch import elastic as launch

    job = copy_job(default_run_1_epoch, tmp_path)  # trainer.epochs=1 of seed=0, val_size=297
    key, value = change.split("=")
    before = {"seed": 0, "data.val_size": 297}[key]
    overrides = ("trainer.epochs=2", "trainer.resume=auto", change, QUIET)
    kept = folder_files(job)
    assert refused_before_ranks(compose(*overrides), job) == _split_refusal(key, value, before)
    assert folder_files(job) == kept  # refused: the folder as it was
    with caplog.at_level("WARNING", logger="ddp_exp"):
        launch.prepare_world(compose(*overrides, "trainer.resume_allow_changes=true"), str(job))
    assert f"{key}={value} differs from the checkpoint's {key}={before} " \
           "(trainer.resume_allow_changes=true)" in caplog.text
    # accepted: the launcher records the attempt it starts in run.json (and the working tree's
    # uncommitted changes in run.diff, when there are any), and touches nothing else
    now = folder_files(job)
    now.pop(Path("run.diff"), None)
    attempts = json.loads(now.pop(Path("run.json")))["attempts"]
    assert len(attempts) == len(json.loads(kept.pop(Path("run.json")))["attempts"]) + 1
    assert now == kept


def test_a_resume_value_that_is_no_file_names_the_valid_values(compose, tmp_path):
    """``trainer.resume=yes`` said only "'.../yes': no such checkpoint file" (a fresh user):
    the line now also says what the key takes."""
    message = refused_before_ranks(compose("world_size=2", "trainer.resume=yes", QUIET),
                                   tmp_path / "run")
    assert "no such checkpoint file; trainer.resume takes auto" in message, message
    assert "null, or a checkpoint file's path" in message and "\n" not in message


# ------------------------------------------- item 8: trainer.resume=auto, nothing there
def test_resume_auto_with_nothing_to_resume_says_so(tmp_path, caplog):
    """Regression (V05): ``trainer.resume=auto`` without ``hydra.run.dir`` trained from
    scratch in a new timestamped folder without a word. One warning names the folder and how
    to resume a run; none when there is a last.pt to continue from or resume is not asked."""
    from ddp_exp.io.checkpoint import LAST, checkpoint_dir
    from ddp_exp.job.earlier_run import refuse_earlier_run
    from ddp_exp.job.folder import note_new_folders

    job = tmp_path / "outputs" / "runs" / "new"
    job.mkdir(parents=True)
    caplog.set_level(logging.INFO, logger="ddp_exp")
    refuse_earlier_run(str(job), "auto")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"trainer.resume=auto: nothing to resume in {job}: starting fresh; to "
                        "resume a run, pass its folder as hydra.run.dir"]
    caplog.clear()
    given = tmp_path / "given"  # a hydra.run.dir given again, with no checkpoint in it yet
    given.mkdir()
    note_new_folders(str(given))
    refuse_earlier_run(str(given), "auto")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"trainer.resume=auto: no checkpoints/last.pt in {given} yet (a run "
                        "there stopped before its first checkpoint, or none ran): starting "
                        "fresh there"]
    caplog.clear()
    refuse_earlier_run(str(job), None)
    os.makedirs(checkpoint_dir(str(job)))
    Path(checkpoint_dir(str(job)), LAST).write_bytes(b"")
    refuse_earlier_run(str(job), "auto")
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
