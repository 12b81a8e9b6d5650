"""A sweep's jobs as MLflow runs of one experiment, ``ddp-exp runs`` over the sweep, and
``ddp-exp rerun`` of one of its jobs (issue 38): the session's tracked sweep, ``optim.lr``
swept over 3 jobs."""

from __future__ import annotations

import csv
import io
import json
import sys
import uuid
from pathlib import Path

import pytest
from helpers import TRACKED_LRS, TRACKED_SWEEP, run_tagged, scalars, shared_sweep


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """The session's tracked sweep (helpers.TRACKED_SWEEP): optim.lr swept over 3 jobs."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    return shared_sweep(tmp_path_factory, *TRACKED_SWEEP)


def ddp_exp(cwd: Path, *args: str, env: dict | None = None):
    proc, _ = run_tagged([sys.executable, "-m", "ddp_exp", *args], cwd, uuid.uuid4().hex, 240,
                         env)
    return proc


@pytest.mark.slow
def test_a_sweep_is_one_experiment_of_one_mlflow_run_per_job(sweep):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{sweep / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("ddp_exp")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 3 and len(client.search_runs(
        [e.experiment_id for e in client.search_experiments()])) == 3
    by_job = {r.data.tags["job_num"]: r for r in runs}
    assert sorted(by_job) == ["0", "1", "2"]
    for job, run in by_job.items():
        assert run.data.tags["sweep"] == str(sweep)
        assert run.data.params["optim.lr"] == TRACKED_LRS[int(job)]
        assert run.data.metrics["final/val/loss"] == json.loads(
            (sweep / job / "metrics.json").read_text())["val/loss"]


@pytest.mark.slow
def test_runs_shows_the_swept_key_and_the_final_metrics(sweep, capsys):
    from ddp_exp.cli.runs import main

    proc = ddp_exp(sweep.parent, "runs", str(sweep))  # through the console's dispatch
    assert proc.returncode == 0, proc.stderr
    header = proc.stdout.splitlines()[0].split()
    assert header[:3] == ["run", "status", "optim.lr"] and header[-1] == "wall_s"
    assert "optim.lr" in header and not any(k.startswith(("trainer.", "data.", "model"))
                                            for k in header)
    assert main([str(sweep), "--csv", "--sort", "val/loss"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    differing = [c for c in rows[0] if c not in ("run", "status", "wall_s")
                 and not c.startswith(("val/", "train/", "best/", "test/"))]
    assert differing == ["optim.lr"]  # exactly the swept key
    losses = {Path(r["run"]).name: float(r["val/loss"]) for r in rows}
    assert losses == {j: json.loads((sweep / j / "metrics.json").read_text())["val/loss"]
                      for j in ("0", "1", "2")}
    assert [float(r["val/loss"]) for r in rows] == sorted(losses.values())
    assert {r["status"] for r in rows} == {"completed"}
    assert main(["--diff", str(sweep / "0"), str(sweep / "2")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "optim.lr: 0.01 -> 0.05"


@pytest.mark.slow
def test_rerun_is_bit_identical_and_an_unreachable_tracker_changes_nothing(sweep, tmp_path):
    """The rerun of job 2, its MLflow server unreachable: one warning line, exit 0, the same
    weights in every bit and TensorBoard's curves complete."""
    from helpers import free_port

    out = tmp_path / "again"
    port = free_port()  # closed: nothing listens there
    proc = ddp_exp(tmp_path, "rerun", str(sweep / "2"), "logger=[tensorboard,mlflow]",
                   f"logger.mlflow.tracking_uri=http://127.0.0.1:{port}", "--out", str(out))
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    assert "bit-identical:" in proc.stdout
    warnings = [line for line in text.splitlines() if "logger.mlflow failed" in line]
    assert len(warnings) == 1, warnings
    assert "Retrying" not in text
    assert json.loads((out / "metrics.json").read_text())["val/loss"] == json.loads(
        (sweep / "2" / "metrics.json").read_text())["val/loss"]
    for tag in ("train/loss", "val/loss"):
        assert scalars(out, tag) == scalars(sweep / "2", tag)


@pytest.mark.slow
def test_rerun_names_what_differs_in_the_record(sweep, tmp_path):
    """Another world size (the same global batch) and one more thread per rank: the line
    names both, the world size first."""
    record = json.loads((sweep / "0" / "run.json").read_text())
    threads = record["threads_per_rank"] + 1
    proc = ddp_exp(tmp_path, "rerun", str(sweep / "0"), "world_size=1", "data.batch_size=64",
                   "logger=[tensorboard]", "--out", str(tmp_path / "other"),
                   env={"OMP_NUM_THREADS": str(threads)})
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    differ = [line for line in proc.stdout.splitlines()
              if line.startswith("the records differ: ")]
    assert len(differ) == 1, proc.stdout[-2000:]
    assert differ[0].startswith("the records differ: world_size: 2 -> 1; threads_per_rank: "
                                f"{threads - 1} -> {threads}")
    verdict = "bit-identical:" if proc.returncode == 0 else "not bit-identical:"
    assert any(line.startswith(verdict) for line in proc.stdout.splitlines())


def test_rerun_of_a_folder_without_a_record_is_one_line(tmp_path, capsys):
    from ddp_exp.cli.rerun import main

    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path}: not a finished job folder") and err.count(
        "\n") == 1


def fake_job(folder: Path, cwd: Path, world_size: int, attempts: list, status: str,
             weights: list[float] | None) -> dict:
    """A job folder as ddp_exp leaves it: run.json (``attempts``: earlier starts), status.json
    and, unless None, model.pt holding ``{"w": weights}``."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    record = {"cwd": str(cwd), "config_dir": None, "config_name": "config",
              "overrides": ["trainer.epochs=2", f"world_size={world_size}"],
              "world_size": world_size, "threads_per_rank": 1, "seed": 0,
              "attempts": attempts, "status": status}
    (folder / "run.json").write_text(json.dumps(record))
    (folder / "status.json").write_text(json.dumps({"status": status}))
    if weights is not None:
        torch.save({"w": torch.tensor(weights)}, folder / "model.pt")
    return record


@pytest.fixture
def fake_rerun(monkeypatch):
    """``subprocess.run`` of ddp_exp.cli.rerun replaced by a job that trains start to end (no
    attempts) into its hydra.run.dir, its w one float step (2**-22) off at 2.0; records each
    call's command and cwd."""
    import subprocess

    from ddp_exp.cli import rerun

    calls = []

    def run(cmd, cwd, env, stdin):
        calls.append((cmd, cwd))
        out = Path(cmd[-1].removeprefix("hydra.run.dir="))
        world_size = [int(a.split("=")[1]) for a in cmd if a.startswith("world_size=")][-1]
        fake_job(out, Path(cwd), world_size, [], "completed", [1.0, 2.0 + 2 ** -22])
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(rerun.subprocess, "run", run)
    return calls


def test_rerun_of_a_run_resumed_at_another_world_size_says_it_differs_by_the_resume(
        tmp_path, monkeypatch, capsys, fake_rerun):
    """Started at 2 ranks, resumed at 1 (run.json's attempts): the rerun (all at 1 rank)
    differs at float level; the verdict names the resume and both world sizes, not a
    nondeterministic operation. The rerun starts in the recorded command folder and writes
    under the current folder (outputs/reruns/<time>), which it names."""
    from ddp_exp.cli.rerun import main

    project, here = tmp_path / "project", tmp_path / "here"
    project.mkdir(), here.mkdir()
    fake_job(tmp_path / "resumed", project, 1, [{"world_size": 2, "status": "interrupted"}],
             "completed", [1.0, 2.0])
    monkeypatch.chdir(here)
    assert main([str(tmp_path / "resumed")]) == 1
    lines = capsys.readouterr().out.splitlines()
    (cmd, cwd), = fake_rerun
    out = Path(cmd[-1].removeprefix("hydra.run.dir="))
    assert cwd == str(project) and out.parent == here / "outputs" / "reruns"
    assert lines == [
        f"rerun: trainer.epochs=2 world_size=1 hydra.run.dir={out}",
        f"rerun: into {out}",
        f"not bit-identical: {out}/model.pt differs from {tmp_path}/resumed/model.pt (w: "
        "largest difference 2.38e-07)",
        "expected: the run was resumed at another world size (world_size 2 then 1, run.json's "
        "attempts) and the rerun trained start to end at world_size=1: sums over another "
        "number of ranks round otherwise (float-level differences), not a nondeterministic "
        "operation"]
    # resumed at the same world size: the same difference is the nondeterminism verdict
    fake_job(tmp_path / "same", project, 1, [{"world_size": 1, "status": "interrupted"}],
             "completed", [1.0, 2.0])
    assert main([str(tmp_path / "same"), "--out", "again"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"rerun: into {here / 'again'}"
    assert lines[3:] == ["the records do not differ (versions, commit, world size, threads, "
                         "CPU kernels, data): a nondeterministic operation, or a change the "
                         "record does not see"]


def test_rerun_of_a_run_resumed_with_other_overrides_names_them(tmp_path, monkeypatch, capsys,
                                                                fake_rerun):
    """Started with optim.lr=0.5, resumed with data.batch_size=16 and then with the last's
    overrides (run.json's attempts; trainer.resume is a resume's own key): the verdict names
    each start's overrides that the last did not run, not "the records do not differ ... a
    nondeterministic operation" (a fresh user's find)."""
    from ddp_exp.cli.rerun import main

    base = ["trainer.epochs=2", "world_size=1"]
    fake_job(tmp_path / "changed", tmp_path, 1, [
        {"world_size": 1, "status": "killed", "overrides": [*base, "optim.lr=0.5"]},
        {"world_size": 1, "status": "killed",
         "overrides": [*base, "data.batch_size=16", "trainer.resume=auto"]},
        {"world_size": 1, "status": "killed", "overrides": [*base, "trainer.resume=auto"]}],
        "completed", [1.0, 2.0])
    monkeypatch.chdir(tmp_path)
    assert main([str(tmp_path / "changed"), "--out", "again"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[3:] == [
        "expected: the run was resumed with other overrides (run.json's attempts: start 1: "
        "optim.lr=0.5 (last: (none)); start 2: data.batch_size=16 (last: (none))) and the "
        "rerun trained start to end with the last's"], lines

def test_rerun_of_a_failed_run_names_its_state_and_reruns_nothing(tmp_path, capsys,
                                                                  fake_rerun):
    """A failed run (no model.pt) is refused in one line naming status.json's state, exit
    2, no rerun started; a run.json still saying running (killed; no status.json) likewise."""
    from ddp_exp.cli.rerun import main

    fake_job(tmp_path / "failed", tmp_path, 2, [], "failed", None)
    assert main([str(tmp_path / "failed")]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path}/failed: the run failed (status.json says 'failed'); ddp-exp rerun "
        "compares a completed run's final weights, which it has none of: resume it "
        f"(hydra.run.dir={tmp_path}/failed trainer.resume=auto) or start it again\n")
    fake_job(tmp_path / "killed", tmp_path, 2, [], "running", None)
    (tmp_path / "killed" / "status.json").unlink()
    assert main([str(tmp_path / "killed")]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: {tmp_path}/killed: the run has not ended (running, or killed) (run.json says "
        "'running'); ")
    assert fake_rerun == []


def test_rerun_into_a_folder_that_holds_something_is_one_line(tmp_path, capsys, fake_rerun):
    """``--out`` naming a folder that is not empty (another run's) is refused before the job
    starts: one line naming it, exit 2 (it launched, failed on the folder's lock, and said
    "the rerun failed; see <that run>", exit 1); an empty folder is taken."""
    from ddp_exp.cli.rerun import main

    fake_job(tmp_path / "done", tmp_path, 2, [], "completed", [1.0, 2.0])
    fake_job(tmp_path / "other", tmp_path, 2, [], "completed", [1.0, 2.0])
    assert main([str(tmp_path / "done"), "--out", str(tmp_path / "other")]) == 2
    assert capsys.readouterr().err == (
        f"error: --out={tmp_path}/other is not empty: a rerun needs a new folder (or leave "
        "--out out: outputs/reruns/<time>)\n")
    assert fake_rerun == []
    (tmp_path / "empty").mkdir()
    main([str(tmp_path / "done"), "--out", str(tmp_path / "empty")])
    assert len(fake_rerun) == 1


def test_runs_says_when_a_completed_runs_metrics_cannot_be_read(tmp_path):
    """A completed run whose metrics.json was truncated since was listed as "completed" with
    blank metrics and no word (a fresh user's find); its status cell now says so."""
    from ddp_exp.cli.runs import table

    for name, text in (("whole", '{"val/loss": 0.5}'), ("cut", '{"val/lo')):
        job = tmp_path / name
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "config.yaml").write_text("seed: 0\n")
        (job / "status.json").write_text(json.dumps({"status": "completed", "wall_s": 1.0}))
        (job / "metrics.json").write_text(text)
    _, rows = table([str(tmp_path / "whole"), str(tmp_path / "cut")])
    assert [r["status"] for r in rows] == ["completed", "completed, metrics.json unreadable"]
    assert rows[0]["val/loss"] == 0.5 and "val/loss" not in rows[1]


def composed_job(folder: Path, *overrides: str) -> Path:
    """A job folder's ``.hydra/config.yaml`` and ``hydra.yaml`` as Hydra composes them for
    ``overrides`` (in this process: Hydra's own ``hydra.runtime.choices`` and
    ``hydra.overrides.task``), with a completed ``status.json`` and a ``metrics.json``."""
    import hydra
    from omegaconf import OmegaConf, open_dict

    from ddp_exp.cli.registry import register

    register()
    with hydra.initialize_config_module(config_module="ddp_exp.conf", version_base="1.3"):
        cfg = hydra.compose("config", overrides=list(overrides), return_hydra_config=True)
    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"hydra": cfg.hydra}), folder / ".hydra" / "hydra.yaml")
    with open_dict(cfg):
        del cfg["hydra"]
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
    (folder / "status.json").write_text(json.dumps({"status": "completed", "wall_s": 1.0}))
    (folder / "metrics.json").write_text(json.dumps({"val/loss": 0.5}))
    return folder


def test_runs_shows_a_list_as_the_command_line_writes_it(tmp_path, capsys):
    """A run started with logger=[tensorboard,csv,mlflow] (several options of a group: Hydra
    records no choice for it) had an empty logger cell and --diff said "logger: None ->
    'tensorboard'" (a fresh user's find); a list-valued config key (model.channels) showed as
    Python writes a list. Both now show as the command line writes them, in the table, the CSV
    and --diff."""
    from ddp_exp.cli.runs import main

    several = composed_job(tmp_path / "several", "logger=[tensorboard,csv,mlflow]",
                           "model=cnn", "model.channels=[8,16]")
    one = composed_job(tmp_path / "one", "model=cnn", "model.channels=[8,16,32]")
    assert main([str(several), str(one)]) == 0
    header, *rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    cells = [dict(zip(header, row, strict=False)) for row in rows]
    assert [(c["run"], c["logger"], c["model.channels"]) for c in cells] == [
        (str(one), "tensorboard", "[8,16,32]"),
        (str(several), "[tensorboard,csv,mlflow]", "[8,16]")]
    assert main([str(several), str(one), "--csv"]) == 0
    rows = {r["run"]: r for r in csv.DictReader(io.StringIO(capsys.readouterr().out))}
    assert (rows[str(several)]["logger"], rows[str(several)]["model.channels"]) == (
        "[tensorboard,csv,mlflow]", "[8,16]")
    assert main(["--diff", str(several), str(one)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "logger: [tensorboard,csv,mlflow] -> 'tensorboard'" in lines
    assert "model.channels: [8,16] -> [8,16,32]" in lines
    assert not any(line.startswith("logger.") for line in lines)  # the group's line says it


def test_rerun_with_a_misspelled_override_is_the_jobs_one_line(tmp_path, monkeypatch, capfd):
    """``rerun RUN trainer.epocs=3``: the job refuses the key before it makes its folder. Its
    one error line is the only one and its exit status (2) is the rerun's; it was followed by
    "error: the rerun failed (exit status 2); see <a folder that does not exist>", exit 1 (a
    fresh user's find)."""
    from ddp_exp.cli.rerun import main

    fake_job(tmp_path / "done", tmp_path, 1, [], "completed", [1.0, 2.0])
    monkeypatch.chdir(tmp_path)
    assert main([str(tmp_path / "done"), "trainer.epocs=3", "--out", "new"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("error: trainer.epocs: Key 'epocs' not in 'TrainerConfig'; valid "
                          "keys: epochs, ") and err.count("\n") == 1, err
    assert not (tmp_path / "new").exists() and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("writes, code, rc, line", [
    (False, 2, 2, None),  # refused (an --out it cannot write): its line alone, its status
    (True, 1, 1, "error: the rerun failed (exit status 1); see {out}"),  # failed training
    (True, 0, 1, "error: the rerun failed (exit status 0); see {out}"),  # no model.pt
    (False, -9, 1, "error: the rerun ended (killed by signal 9) before it wrote anything "
                   "into its folder")])
def test_rerun_that_failed_names_its_folder_only_when_it_wrote_there(
        tmp_path, monkeypatch, capsys, writes, code, rc, line):
    """A job that wrote nothing into ``--out`` (here an empty folder, as a read-only one it
    cannot write into) gets no line pointing there, and a refusal's status is passed on; a job
    that started there and failed gets one line naming the folder, exit 1."""
    import subprocess

    from ddp_exp.cli import rerun

    def run(cmd, cwd, env, stdin):
        out = Path(cmd[-1].removeprefix("hydra.run.dir="))
        if writes:
            (out / "status.json").write_text(json.dumps({"status": "failed"}))
        print("error: the job's own line", file=sys.stderr)
        return subprocess.CompletedProcess(cmd, code)

    monkeypatch.setattr(rerun.subprocess, "run", run)
    fake_job(tmp_path / "done", tmp_path, 1, [], "completed", [1.0, 2.0])
    (tmp_path / "out").mkdir()
    assert rerun.main([str(tmp_path / "done"), "--out", str(tmp_path / "out")]) == rc
    expected = ["error: the job's own line"] + ([line.format(out=tmp_path / "out")] if line
                                                else [])
    assert capsys.readouterr().err.splitlines() == expected


@pytest.mark.parametrize(("argv", "said"), [
    (["runs", "--bogus"], "error: ddp-exp runs: unrecognized arguments: --bogus (ddp-exp runs "
                          "--help lists the options)"),
    (["runs", "--diff", "A"], "error: ddp-exp runs: argument --diff: expected 2 arguments "
                              "(ddp-exp runs --help lists the options)"),
    (["rerun"], "error: ddp-exp rerun: the following arguments are required: run, overrides "
                "(ddp-exp rerun --help lists the options)")])
def test_a_bad_command_line_of_runs_or_rerun_is_one_line(capsys, argv, said):
    """A fresh user's find: ``runs`` and ``rerun`` printed argparse's usage block, where
    ``prepare`` and ``sample`` say one line; exit 2."""
    from ddp_exp.cli.commands import dispatch

    assert dispatch(argv) == 2
    assert capsys.readouterr().err.splitlines() == [said]
