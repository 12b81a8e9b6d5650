"""The entry point's table from exception to one line (:mod:`ddp_exp.cli.errors`)."""

from __future__ import annotations

import os

import pytest


def _raise_from(filename: str, name: str, source: str) -> dict:
    """Functions compiled as if they lived in ``filename``: a traceback names that file."""
    namespace: dict = {}
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


def test_an_oserror_of_ddp_exps_code_that_hydra_called_is_not_an_output_folder_line():
    """Regression (the package move): "ours" was the folder of the module that held the check,
    ddp_exp/cli/ once it moved, so an ``OSError`` raised in ddp_exp.job's code that Hydra called
    (a callback) read as Hydra failing to create the output folder. Ours is the whole package;
    Hydra's own failure still gets the line."""
    import hydra

    import ddp_exp
    from ddp_exp.cli.errors import _output_folder_error

    package = os.path.dirname(os.path.abspath(ddp_exp.__file__))
    hydra_file = os.path.join(os.path.dirname(hydra.__file__), "core", "fake_caller.py")
    ours = _raise_from(os.path.join(package, "job", "fake_callback.py"), "callback",
                       "def callback():\n    raise OSError(13, 'Permission denied', '/x/y.json')\n")
    calls = _raise_from(hydra_file, "calls", "def calls(f):\n    f()\n")
    makes = _raise_from(hydra_file, "makedirs",
                        "def makedirs():\n    raise OSError(13, 'Permission denied', '/out/run')\n")
    with pytest.raises(OSError) as ours_failed:
        calls(ours)
    assert _output_folder_error(ours_failed.value) is None
    with pytest.raises(OSError) as hydra_failed:
        makes()
    line = _output_folder_error(hydra_failed.value)
    assert line is not None and line.startswith("cannot create the output folder /out/run: ")


def test_an_output_folder_that_exists_but_cannot_be_written_gets_the_line(tmp_path):
    """A fresh user's find: ``hydra.run.dir`` an existing read-only folder ended in a 59-line
    traceback and exit 1: Hydra's logging setup opens the job log there, and the logging
    module raises the ``OSError`` again as ``ValueError: Unable to configure handler 'file'``;
    with ``-m``, Hydra's ``multirun.yaml`` failed (43 lines). Each is the output folder's line
    (exit 2), naming the folder and the file that could not be written. (A file in place of
    the folder gives the same kind of ``OSError`` a read-only mount does.)"""
    import logging.config

    import hydra

    from ddp_exp.cli.errors import EXIT_CONFIG_ERROR, error_exit

    blocked = tmp_path / "run"
    blocked.write_text("a file where the folder's log would go")
    hydra_file = os.path.join(os.path.dirname(hydra.__file__), "_internal", "fake_logging.py")
    configure = _raise_from(hydra_file, "configure", "def configure(d):\n    f(d)\n")
    configure.__globals__["f"] = logging.config.dictConfig
    log = str(blocked / "ddp_exp.log")
    with pytest.raises(ValueError, match="Unable to configure handler 'file'") as failed:
        configure({"version": 1, "handlers": {"file": {
            "class": "logging.FileHandler", "filename": log, "delay": False}}})
    out = error_exit(failed.value, [])
    assert out is not None and out.code == EXIT_CONFIG_ERROR
    assert out.text == (f"error: cannot write in the output folder {blocked}: Not a directory "
                        "(ddp_exp.log); set hydra.run.dir (hydra.sweep.dir with -m) to a folder "
                        "that can be created and written")


def test_each_kind_of_error_gets_its_row():
    """A ConfigError raised where Hydra resolves: one line, exit 2, printed where it is met; a
    lost submitit job: exit 1; Hydra's composition error that no row knows: Hydra's words, exit
    2, rank 0 alone; anything else is a bug (None: the traceback shows)."""
    from hydra.errors import ConfigCompositionException

    from ddp_exp.cli.errors import EXIT_CONFIG_ERROR, EXIT_RANK_FAILED, error_exit
    from ddp_exp.config.errors import ConfigError

    try:
        try:
            raise ConfigError("data.path: no such file")
        except ConfigError as inner:
            raise RuntimeError("while resolving") from inner
    except RuntimeError as exc:
        wrapped = exc
    refused = error_exit(wrapped, [])
    assert refused is not None
    assert (refused.text, refused.code, refused.every_rank) == (
        "error: data.path: no such file", EXIT_CONFIG_ERROR, True)

    class UncompletedJobError(RuntimeError):  # submitit's, by name
        pass

    lost = error_exit(UncompletedJobError("Job 1_0 has not produced any output"), [])
    assert lost is not None and lost.code == EXIT_RANK_FAILED
    assert lost.text.startswith("error: a sweep job ended without returning a result")

    hydra_words = error_exit(ConfigCompositionException("A report no row knows\nline 2"), [])
    assert hydra_words is not None
    assert (hydra_words.text, hydra_words.code, hydra_words.every_rank) == (
        "A report no row knows\nline 2", EXIT_CONFIG_ERROR, False)

    # Hydra's several-line reports of a comma list without -m and of an unknown primary config
    comma = error_exit(ConfigCompositionException(
        "Ambiguous value for argument 'data=digits,synthetic'\n1. To use it as a list, use "
        "key=[value1,value2]\n2. ...\n3. To sweep over it, add --multirun"), [])
    assert comma is not None and comma.code == EXIT_CONFIG_ERROR
    assert comma.text == (
        "error: data=digits,synthetic: a comma list is a sweep or a list: python -m ddp_exp -m "
        "data=digits,synthetic runs one job each, data=[digits,synthetic] is one list value, "
        "data='digits,synthetic' one string")
    from hydra.errors import MissingConfigException

    primary = error_exit(MissingConfigException(
        "Cannot find primary config 'nope'. Check that it's in your config search path.\n\n"
        "Config search path:\n\tprovider=hydra", missing_cfg_file="nope"), [])
    assert primary is not None and primary.text == (
        "error: --config-name=nope: no such config (ddp_exp's own is config; a NAME.yaml in a "
        "--config-dir folder is found too)")

    assert error_exit(ValueError("a bug"), []) is None


def test_an_error_whose_message_is_empty_still_gets_its_one_line(compose):
    """Every line that quotes an error (``config.errors.first_line``/``described``) survives a
    message that is empty (``RuntimeError()``, ``KeyboardInterrupt()``) or blank by naming the
    type: ``str(exc).splitlines()[0]`` raised IndexError inside the error path itself, e.g. on
    resuming onto an optimizer whose ``load_state_dict`` raised ``RuntimeError()``."""
    import torch
    from omegaconf import OmegaConf

    from ddp_exp.config.errors import ConfigError, described, first_line
    from ddp_exp.config.view import rank_config
    from ddp_exp.train.state import resume_optimizer

    assert first_line(RuntimeError(" \n ")) == "" and described(RuntimeError()) == "RuntimeError"
    assert first_line(ValueError("\n  first  \nsecond")) == "first"
    assert described(OSError("x" * 400)) == "OSError: " + "x" * 300
    assert first_line("ab", limit=1) == "a" and first_line("", default="none") == "none"

    class Refusing(torch.optim.SGD):
        def load_state_dict(self, state_dict):
            raise RuntimeError()

    plain = OmegaConf.to_container(compose("world_size=1"), resolve=True, enum_to_str=True)
    optimizer = Refusing([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ConfigError, match=r"^trainer.resume='last.pt': the checkpoint's "
                       r"optimizer state does not fit optim \(torch.optim.SGD; RuntimeError\)$"):
        resume_optimizer(rank_config(plain), {"optimizer": {}}, optimizer, 10, "last.pt")


@pytest.mark.parametrize(("overrides", "note"), [
    (["experiment=gpt_tokens", "trainer.max_steps=10"],
     "; experiment=gpt_tokens sets scheduler.warmup_steps: give scheduler.warmup_steps=... to "
     "override it"),
    (["experiment=gpt_tokens", "trainer.max_steps=10", "scheduler.warmup_steps=20"], ""),
    (["--config-dir", "{conf}", "experiment=mine"],
     "; experiment=mine sets trainer.epochs: give trainer.epochs=... to override it")])
def test_a_presets_value_refused_for_this_run_says_which_preset_set_it(run_cli, tmp_path,
                                                                        overrides, note):
    """A value the user did not type, refused for this run (the gpt_tokens preset's 30 warmup
    steps in a 10-step run; a ``--config-dir`` preset's ``trainer.epochs: 0``), names the
    preset that set it and how to override it (the line read as if the user had typed the
    value; a fresh user's finding); a value typed on the command line gets no note."""
    conf = tmp_path / "conf" / "experiment"
    conf.mkdir(parents=True)
    (conf / "mine.yaml").write_text("# @package _global_\ntrainer:\n  epochs: 0\n")
    run = run_cli(*[o.format(conf=conf.parent) for o in overrides], "print_config=false",
                  timeout=120)
    said = [ln for ln in run.stderr.splitlines() if ln.startswith("error: ")]
    assert run.returncode == 2 and len(said) == 1, run.stderr
    assert said[0].endswith("is invalid: a positive integer" + note if "mine" in note
                            else "cosine decay's last step)" + note), said


@pytest.mark.parametrize(("choice", "keys"), [("scheduler=none", "interval"),
                                              ("scheduler=step", "interval, step_size_epochs, "
                                                                  "gamma")])
def test_a_preset_with_an_option_that_lacks_its_keys_is_one_line(run_cli, choice, keys):
    """``experiment=gpt_tokens scheduler=none``: the preset sets ``scheduler.warmup_steps``
    for its own scheduler, which ``none`` lacks. Hydra's four lines (``In
    'experiment/gpt_tokens': ConfigKeyError raised while composing config: ...``, a fresh
    user's find) are one line naming the preset, the key, the option and its keys; exit 2."""
    run = run_cli("experiment=gpt_tokens", choice, timeout=120)
    option = choice
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"error: experiment=gpt_tokens sets scheduler.warmup_steps, which {option} does not "
        f"have (its keys: {keys}): the preset's values are for the option it chooses; leave "
        f"{option} out, or give your own copy of the preset (--config-dir) without that key"]


@pytest.mark.parametrize(("override", "reason"), [
    ("hydra.run.dir={tmp}/rüns", "a character it does not take in an unquoted value"),
    ("data.batch_size=[1,2", "no viable alternative at input '[1,2'")])
def test_an_override_hydra_cannot_parse_is_one_line_that_says_how_to_quote(run_cli, tmp_path,
                                                                           override, reason):
    """A fresh user's find: an override Hydra's grammar refuses (a letter outside ASCII in an
    unquoted path, an unclosed list) printed Hydra's parser words and a caret, without
    ``error:``. One line now names the override, the reason and the quoting that works (which
    the run below then takes); exit 2, nothing made."""
    given = override.format(tmp=tmp_path)
    run = run_cli(given, "trainer.epochs=1", timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"error: {given}: Hydra cannot parse this override ({reason}); quote a value with "
        "spaces, letters outside ASCII or Hydra's special characters for Hydra, inside the "
        "shell's quotes: \"hydra.run.dir='/tmp/rüns x'\"; a list is [a,b]"]
    assert not (tmp_path / "rüns").exists()
