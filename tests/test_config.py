"""Config groups compose and build; bad input fails fast, once, on one line, before any rank.

Composition runs in-process with Hydra's compose API, and so does every bad value: the steps the
CLI runs before any rank refuse it (``refused_before_ranks``, conftest.py). The command-line
behaviour (C15, C16, issue 2 item 6) runs the real CLI as a subprocess through the ``run_cli``
fixture, for one refusal of each kind.
"""

from __future__ import annotations

import copy
import importlib.resources
import json
import os
import sys
from pathlib import Path

import hydra
import numpy as np
import pytest
import torch
from helpers import TORCHRUN_2, copy_job, refused_before_ranks
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict

from ddp_exp.cli.registry import register
from ddp_exp.config.checks import validate
from ddp_exp.config.compose import register_configs
from ddp_exp.config.errors import ConfigError
from ddp_exp.launch.build import load_data
from ddp_exp.train.models import build_model

# What issue 2 promises; the package may offer more options, never fewer.
PROMISED = {
    "backend": {"auto", "gloo", "nccl"},
    "data": {"digits", "synthetic", "file"},
    "launcher": {"local"},
    "model": {"mlp", "cnn", "linear"},
    "optim": {"sgd", "adamw"},
    "trainer": {"default"},
}


def _options() -> dict[str, list[str]]:
    """The options the installed package ships: ``conf/<group>/<option>.yaml``."""
    root = importlib.resources.files("ddp_exp.conf")
    found = {}
    for group in root.iterdir():
        if group.is_dir() and not group.name.startswith(("_", ".")):
            names = sorted(p.name[:-5] for p in group.iterdir() if p.name.endswith(".yaml"))
            if names:
                found[group.name] = names
    return found


OPTIONS = _options()
GROUP_OPTIONS = [(g, o) for g, opts in sorted(OPTIONS.items()) for o in opts]


FOLDER_IMAGES = 60  # digits written as PNG files for data=image_folder


@pytest.fixture(scope="module")
def small_csv(tmp_path_factory) -> Path:
    """20 samples, 3 features, 2 classes, written as CSV with a header; beside it
    ``images/<digit>/<i>.png``: the first FOLDER_IMAGES digits. Written once for the module
    (the files the options' required keys point at); tests only read them."""
    from lazy_data import write_digits_folder

    rng = np.random.default_rng(0)
    x = rng.standard_normal((20, 3))
    y = np.arange(20) % 2
    path = tmp_path_factory.mktemp("options") / "small.csv"
    rows = ["a,b,c,label"] + [",".join([*map(repr, map(float, r)), str(t)])
                              for r, t in zip(x, y, strict=True)]
    path.write_text("\n".join(rows) + "\n")
    write_digits_folder(path.parent / "images", limit=FOLDER_IMAGES)
    return path


@pytest.fixture(scope="module")
def composed():
    """``composed(*overrides, hydra_node=False)`` -> the composed config, as the ``compose``
    fixture returns it (or with its ``hydra`` node): Hydra composes each list of overrides once
    for the module and every test gets its own copy (the per-option tests below share their
    compositions: each packaged option is composed once, not once per test)."""
    cache = {}

    def get(*overrides: str, hydra_node: bool = False):
        if overrides not in cache:
            register()  # the entry's: hparams_search's presets name the ddp_optuna sweeper
            with hydra.initialize_config_module(config_module="ddp_exp.conf",
                                                version_base="1.3"):
                cache[overrides] = hydra.compose("config", overrides=list(overrides),
                                                 return_hydra_config=True)
        cfg = copy.deepcopy(cache[overrides])
        if not hydra_node:  # as hydra.compose(return_hydra_config=False) leaves it
            with open_dict(cfg):
                del cfg["hydra"]
        return cfg

    return get


def _file_overrides(group: str, option: str, csv: Path) -> list[str]:
    """The required keys of the options that have some (composition only: nothing is read)."""
    return {("data", "file"): [f"data.path={csv}"],
            ("data", "image_folder"): [f"data.path={csv.parent / 'images'}"],
            ("data", "dataset"): ["data._target_=lazy_data.DigitsDataset", "data.val_size=297"],
            ("experiment", "image_folder_recipe"): [f"data.path={csv.parent / 'images'}"],
            }.get((group, option), [])


# ------------------------------------------------------------------------ (a) composition
def test_every_promised_option_ships():
    for group, options in PROMISED.items():
        assert options <= set(OPTIONS.get(group, ())), (group, OPTIONS.get(group))


@pytest.mark.parametrize("value", [0, -4])
def test_a_batch_size_below_one_is_refused_naming_the_key(compose, value):
    with pytest.raises(ConfigError, match=rf"data\.batch_size={value} is invalid"):
        validate(compose(f"data.batch_size={value}"))


@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_option_composes_and_validates(composed, small_csv, group, option):
    cfg = composed(f"{group}={option}", *_file_overrides(group, option, small_csv))
    assert "hydra" not in cfg
    validate(cfg)  # no ConfigError
    assert OmegaConf.missing_keys(cfg) == set()
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    if group == "backend":
        assert cfg.distributed.backend == option


def test_defaults(compose):
    cfg = compose()
    assert cfg.data._target_ == "ddp_exp.data.load_digits"
    assert cfg.model._target_ == "ddp_exp.train.models.MLP"
    assert cfg.optim._target_ == "torch.optim.SGD"
    assert cfg.distributed.backend == "auto"
    assert list(cfg.model.hidden_sizes) == [128]


def test_data_file_without_path_fails_validation(compose):
    cfg = compose("data=file")
    with pytest.raises(ConfigError, match="data.path"):
        validate(cfg)


@pytest.mark.parametrize("option", OPTIONS["data"])
def test_data_option_instantiates(composed, small_csv, option):
    cfg = composed(f"data={option}", *_file_overrides("data", option, small_csv))
    datasets = load_data(cfg)
    if option == "tokens":  # windows of the built-in corpus; about 10 % held out
        from pydoc_data.topics import topics

        size = len("\n\n".join(topics[k] for k in sorted(topics)).encode())
        windows = (size - 1) // cfg.data.block_size
        assert abs(len(datasets.val) - windows / 10) <= 1
        # the training windows sit under a shift of up to one window: one fewer at most
        assert windows - len(datasets.val) - 1 <= len(datasets.train) <= windows - len(
            datasets.val)
        return
    # Every shipped option has its size here: a new option fails until it is added.
    total = {"digits": 1797, "synthetic": 4096, "file": 20,  # small_csv: 20 rows
             "image_folder": FOLDER_IMAGES, "dataset": 1797}[option]
    assert len(datasets.train) + len(datasets.val) == total
    assert len(datasets.val) == cfg.data.val_size
    assert len(datasets.train) >= cfg.world_size


def _shapes(composed, small_csv):
    """(name, data overrides, input_shape, num_outputs) computed from the data's definition."""
    digits = ("digits", ["data=digits"], (1, 8, 8), 10)
    syn = composed("data=synthetic")
    reg = ("synthetic-regression", ["data=synthetic"], (syn.data.num_features,), 1)
    cls = ("synthetic-4-classes", ["data=synthetic", "data.num_classes=4"],
           (syn.data.num_features,), 4)
    file = ("file", ["data=file", f"data.path={small_csv}"], (3,), 2)
    return [digits, reg, cls, file]


@pytest.mark.parametrize("option", OPTIONS["model"])
def test_model_option_builds_for_each_dataset(composed, small_csv, option):
    for name, data_overrides, input_shape, num_outputs in _shapes(composed, small_csv):
        cfg = composed(f"model={option}", *data_overrides)
        validate(cfg)
        datasets = load_data(cfg)
        assert datasets.train.input_shape == input_shape, name
        assert datasets.train.num_outputs == num_outputs, name
        model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
        if option == "cnn" and len(input_shape) != 3:
            with pytest.raises(ConfigError, match="cnn") as info:
                build_model(model_cfg, input_shape, num_outputs)
            assert "\n" not in str(info.value)
            continue
        x = torch.from_numpy(datasets.train.features[:5])
        if option == "gpt":  # token ids only (data=tokens: test_token_data)
            with pytest.raises(ConfigError, match="model=gpt takes") as info:
                build_model(model_cfg, input_shape, num_outputs)(x)
            assert "\n" not in str(info.value)
            continue
        torch.manual_seed(0)
        model = build_model(model_cfg, input_shape, num_outputs)
        assert isinstance(model, torch.nn.Module)
        assert type(model).__qualname__ == cfg.model._target_.rsplit(".", 1)[1]
        assert model(x).shape == (5, num_outputs), name


def _optimizer_args(optim_cfg) -> dict:
    """``cfg.optim`` without ddp_exp's own keys (``optim.lr_scaling``...), as the ranks build it."""
    from ddp_exp.config.checks import OPTIM_OWN_KEYS as own

    return {k: v for k, v in OmegaConf.to_container(optim_cfg, resolve=True).items()
            if k not in own}


@pytest.mark.parametrize("option", OPTIONS["optim"])
def test_optim_option_instantiates(composed, option):
    cfg = composed(f"optim={option}")
    validate(cfg)
    expected = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}.get(option)
    model = torch.nn.Linear(4, 2)
    optimizer = instantiate(_optimizer_args(cfg.optim))(model.parameters())
    assert isinstance(optimizer, torch.optim.Optimizer)
    if expected is not None:
        assert type(optimizer) is expected
    assert optimizer.param_groups[0]["lr"] == cfg.optim.lr
    before = model.weight.detach().clone()
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    assert not torch.equal(before, model.weight)


def test_optim_lr_override(compose):
    cfg = compose("optim=adamw", "optim.lr=0.125")
    optimizer = instantiate(_optimizer_args(cfg.optim))(torch.nn.Linear(2, 2).parameters())
    assert optimizer.param_groups[0]["lr"] == 0.125


def test_prefetch_factor_without_workers_is_refused(compose):
    """Regression (fresh-user pass): ``data.prefetch_factor=4`` with ``data.num_workers=0`` was
    silently ignored; torch's DataLoader refuses the pair."""
    with pytest.raises(ConfigError, match=r"^data\.prefetch_factor=4 .*num_workers=0"):
        validate(compose("data.prefetch_factor=4"))
    validate(compose("data.prefetch_factor=4", "data.num_workers=2"))


@pytest.mark.parametrize("overrides,key", [
    (["scheduler.interval=batch"], "scheduler.interval"),
    (["scheduler.interval=epoch"], "scheduler.interval"),
    (["+scheduler.warmup_steps=5"], "scheduler.warmup_steps"),
    (["scheduler=none", "+scheduler.gamma=0.5"], "scheduler.gamma"),
    (["scheduler=step", "+scheduler.warmup_steps=5"], "scheduler.warmup_steps"),
    (["scheduler=cosine", "+scheduler.gamma=0.5"], "scheduler.gamma"),
])
def test_a_scheduler_key_the_scheduler_does_not_use_is_refused(compose, overrides, key):
    """Regression: ``scheduler.interval=batch`` (any scheduler key) with ``scheduler=none`` was
    accepted and ignored. Now one line names the key and, for ``none``, the schedules that use
    it."""
    with pytest.raises(ConfigError) as info:
        validate(compose(*overrides))
    message = str(info.value)
    assert message.startswith(f"{key}=") and "\n" not in message, message
    if not any(o in overrides for o in ("scheduler=step", "scheduler=cosine")):
        assert "scheduler=cosine|step" in message, message
    else:
        assert "its keys: interval, " in message, message


@pytest.mark.parametrize("overrides", [
    [],
    ["scheduler.interval=step"],  # the default, as none.yaml writes it
    ["scheduler=cosine", "scheduler.warmup_steps=2", "scheduler.min_lr=0.001"],
    ["scheduler=step", "scheduler.interval=step"],
    ["scheduler._target_=torch.optim.lr_scheduler.ExponentialLR", "+scheduler.gamma=0.8",
     "scheduler.interval=epoch"],  # a user's scheduler: its keys are its arguments (docs/recipe.md)
])
def test_scheduler_keys_a_scheduler_uses_are_accepted(compose, overrides):
    validate(compose(*overrides))


@pytest.mark.parametrize("base", [
    ["scheduler=step"],
    ["scheduler._target_=torch.optim.lr_scheduler.ExponentialLR", "+scheduler.gamma=0.8"],
])
def test_scheduler_interval_accepts_exactly_the_schema_choices(compose, base):
    """``scheduler.interval`` is ``step`` or ``epoch`` (the schema's SCHEDULER_INTERVALS and its
    default), nothing else: no other spelling, no other unit."""
    from ddp_exp.config.schema import SCHEDULER_INTERVALS, SchedulerConfig

    assert SCHEDULER_INTERVALS == ("step", "epoch")
    assert SchedulerConfig.interval in SCHEDULER_INTERVALS
    for value in ("step", "epoch", "batch", "Step", "epochs", "''", "1"):
        cfg = compose(*base, f"scheduler.interval={value}")
        if value in SCHEDULER_INTERVALS:
            validate(cfg)
        else:
            with pytest.raises(ConfigError, match=r"^scheduler\.interval=.* one of step, epoch$"):
                validate(cfg)


# --------------------------- (b) bad input: in-process, and one of each kind through the CLI
def _no_rank_started(run) -> None:
    for leftover in ("tensorboard", "metrics.json", "model.pt", "checkpoints"):
        assert not (run.job_dir / leftover).exists(), leftover
    assert list(run.job_dir.parent.rglob("events.out.tfevents*")) == []


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


NCCL_CANNOT_RUN = pytest.mark.skipif(torch.cuda.device_count() >= 2,
                                     reason="2 GPUs here: backend=nccl with 2 ranks is valid")
BAD_INPUT = [  # (overrides, the key the one-line error must name)
    pytest.param(["backend=nccl"], "backend", marks=NCCL_CANNOT_RUN),
    (["world_size=0"], "world_size"),
    (["data.batch_size=0"], "data.batch_size"),  # other values: test_a_batch_size_below_one_...
    (["data.val_size=1797"], "data.val_size"),
    (["data=file"], "data.path"),
    (["data=file", "data.path={tmp}/missing.csv"], "data.path"),
]  # and world_size=two, refused by Hydra's composition: test_a_value_of_the_wrong_type_...
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
BAD_INPUT_MORE = [  # the same rule for keys the list does not name
    pytest.param(["data=synthetic", "model=cnn"], "model", id="cnn on flat data"),
    pytest.param(["data.num_workers=-1"], "data.num_workers", id="num_workers=-1"),
    pytest.param(["trainer.epochs=0"], "trainer.epochs", id="epochs=0"),
    pytest.param(["model._target_=nope.Nope"], "model._target_", id="model target"),
    pytest.param(["optim._target_=torch.optim.Nope"], "optim._target_", id="optim target"),
    pytest.param(["trainer.precision=16-mixed"], "trainer.precision", id="fp16 without GPU",
                 marks=NO_GPU),
    pytest.param(["device=cuda"], "device=cuda", id="cuda without GPU", marks=NO_GPU),
    pytest.param(["device=cpu", "backend=nccl"], "backend=nccl", id="nccl on the CPU"),
    # device=gpu: refused at composition (an Enum), tests/test_schema.py CHOICE_REFUSALS
    pytest.param(["optim=adamw", "optim.betas=[0.9]"], "optim", id="betas too short"),
    pytest.param(["scheduler.interval=batch"], "scheduler.interval",
                 id="scheduler key with scheduler=none"),
    # Fresh-user findings: a wait too long for the agent's clock (an OverflowError in the
    # launcher), a rendezvous that times out at once, a misspelt key added with +.
    pytest.param(["launcher.monitor_interval_s=inf"], "launcher.monitor_interval_s",
                 id="monitor interval inf"),
    pytest.param(["launcher.monitor_interval_s=1e10"], "launcher.monitor_interval_s",
                 id="monitor interval 1e10"),
    pytest.param(["launcher.monitor_interval_s=nan"], "launcher.monitor_interval_s",
                 id="monitor interval nan"),
    pytest.param(["launcher.rdzv_timeout_s=0"], "launcher.rdzv_timeout_s",
                 id="rendezvous timeout 0"),
    pytest.param(["+trainer.epoch=1"], "trainer.epoch", id="+trainer.epoch typo"),
    pytest.param(["+launcher.foo=1"], "launcher.foo", id="+launcher.foo"),
]
# Through the real CLI: one refusal of each kind, where run_job refuses it before any rank
# (validate; Hydra's composition; the data; a _target_ the build cannot import; the device).
# Every value of the tables above is refused in-process, by the same steps, below.
BAD_INPUT_CLI = [
    pytest.param(["world_size=0"], "world_size", id="validate"),
    pytest.param(["world_size=two"], "world_size", id="composition"),
    pytest.param(["data=file", "data.path={tmp}/missing.csv"], "data.path", id="data"),
    pytest.param(["model._target_=nope.Nope"], "model._target_", id="build target"),
    pytest.param(["device=cpu", "backend=nccl"], "backend=nccl", id="device"),
]


def _assert_rejected_before_ranks(run, key: str) -> None:
    assert run.returncode != 0, run.stdout
    line = _one_line(run.stderr)
    assert key in line
    assert "Traceback" not in run.stderr + run.stdout
    _no_rank_started(run)


@pytest.mark.parametrize("overrides,key", BAD_INPUT_CLI)
def test_bad_input_fails_fast_with_one_line(run_cli, tmp_path, overrides, key):
    overrides = [o.format(tmp=tmp_path) for o in overrides]
    if not any(o.startswith("world_size=") for o in overrides):
        overrides = ["world_size=2", *overrides]
    run = run_cli("trainer.epochs=1", *overrides, timeout=60)  # a later override wins
    _assert_rejected_before_ranks(run, key)


@pytest.mark.parametrize("overrides,key", BAD_INPUT + BAD_INPUT_MORE,
                         ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_input_is_refused_before_ranks_naming_the_key(compose, tmp_path, overrides, key):
    cfg = compose("world_size=2", "trainer.epochs=1",
                  *[o.format(tmp=tmp_path) for o in overrides])  # a later override wins
    message = refused_before_ranks(cfg, tmp_path / "run")
    assert message.startswith(key), message  # the CLI prints "error: <message>"


@pytest.mark.parametrize(("override", "line"), [
    ("world_size=two", "world_size='two' is invalid: an integer"),
    ("world_size=null", "world_size=null is invalid: a value, not null"),
    ("optim.lr=abc", "optim.lr='abc' is invalid: a number"),
    ("trainer.save_last=maybe", "trainer.save_last='maybe' is invalid: true or false"),
    ("model.hidden_sizes=abc",
     "model.hidden_sizes='abc' is invalid: a list in brackets, such as [64,32]")])
def test_a_value_of_the_wrong_type_is_refused_at_composition_naming_the_key(compose, override,
                                                                            line):
    """``world_size=two`` never reaches validate: Hydra's composition refuses it, and the entry
    point turns that into one line naming the key and what it takes
    (``ddp_exp.cli.errors._one_line``; a user read OmegaConf's "field 'world_size' is not
    Optional" and "str is not a ListConfig, list or tuple")."""
    from hydra.errors import HydraException

    from ddp_exp.cli.errors import _one_line as entry_line

    with pytest.raises(HydraException) as info:
        compose("world_size=2", "trainer.epochs=1", override)
    assert entry_line(info.value) == line


@pytest.mark.parametrize("group,bad", [("data", "digitz"), ("backend", "glo")])
def test_unknown_group_option_is_refused_listing_the_valid_ones(compose, group, bad):
    """Hydra's composition refuses it; the entry point prints the error and its cause."""
    from hydra.errors import HydraException

    with pytest.raises(HydraException) as info:
        compose("world_size=1", f"{group}={bad}")
    text = f"{info.value}\n{info.value.__cause__ or ''}"
    assert f"{group}/{bad}" in text, text
    for option in PROMISED[group]:
        assert option in text, (option, text)


def test_unknown_group_option_lists_the_valid_ones(run_cli):
    """One line (Hydra's own report is ten: the options one per line, its search path)."""
    group, bad = "data", "digitz"  # other groups: in-process, above
    run = run_cli("world_size=1", f"{group}={bad}", timeout=60)
    assert run.returncode == 2  # bad input, like every config error
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(f"error: {group}={bad}: no such option in config group {group}; "
                               "valid options: "), lines
    for option in PROMISED[group]:
        assert option in lines[0], (option, lines)
    assert "Traceback" not in run.stderr + run.stdout
    _no_rank_started(run)


def test_an_unknown_option_asked_for_by_a_config_names_that_config():
    """The option a preset or another config asks for, not one on the command line, names
    who asked; with an install hint when a missing plugin would have it."""
    from hydra.errors import MissingConfigException

    from ddp_exp.cli.errors import _unknown_option_line

    exc = MissingConfigException("In 'launcher/slurm': Could not find "
                                 "'hydra/launcher/submitit_slurm'\n\nAvailable options ...",
                                 "hydra/launcher/submitit_slurm", ["basic", "joblib"])
    assert _unknown_option_line(exc, ["launcher=slurm"]) == (
        "hydra/launcher=submitit_slurm (asked for by launcher/slurm): no such option in config "
        "group hydra/launcher; valid options: basic, joblib")
    typed = MissingConfigException("In 'hydra/config': Could not find 'hydra/launcher/nope'",
                                   "hydra/launcher/nope", ["basic"])
    assert _unknown_option_line(typed, ["hydra/launcher=nope"]) == (
        "hydra/launcher=nope: no such option in config group hydra/launcher; valid options: "
        "basic")
    preset = MissingConfigException("In 'hydra/config': Could not find 'hydra/sweeper/optuna'",
                                    "hydra/sweeper/optuna", ["basic"])  # Hydra's own words
    assert _unknown_option_line(preset, ["hparams_search=digits_optuna"]) == (
        "hydra/sweeper=optuna: no such option in config group hydra/sweeper; valid options: "
        "basic")
    wrapped = RuntimeError("composing")
    wrapped.__cause__ = typed
    assert _unknown_option_line(wrapped, ["+hydra/launcher=nope"]).startswith("hydra/launcher=")
    assert _unknown_option_line(RuntimeError("other"), []) is None


def test_an_unknown_option_in_a_list_of_options_is_one_line():
    """``logger=[csv,foo]``: Hydra's "Could not load" names no options (its report is six
    lines); the entry's line is the one a single bad option gets, with the options. Read as
    the entry reads it: after composing, Hydra's global state cleared (as @hydra.main does)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    from ddp_exp.cli.errors import error_exit
    from ddp_exp.config.compose import register_configs

    register_configs()
    with hydra.initialize_config_module(config_module="ddp_exp.conf", version_base="1.3"):
        with pytest.raises(HydraException) as info:
            hydra.compose("config", overrides=["logger=[csv,foo]"])
    assert not GlobalHydra.instance().is_initialized()
    out = error_exit(info.value, ["logger=[csv,foo]"])
    assert (out.text, out.code) == (
        "error: logger=foo: no such option in config group logger; valid options: csv, "
        "mlflow, tensorboard, wandb", 2)
    assert not GlobalHydra.instance().is_initialized()  # left as found


def test_a_sweep_refused_before_its_first_job_puts_the_folder_back(tmp_path):
    """discard_refused_sweep: a new folder (and the folders made on the way) goes; a used one
    gets its earlier multirun.yaml back and keeps everything else; once a job of this sweep
    has made its folder, nothing is touched."""
    from ddp_exp.job import sweep

    def start(sweep_dir: Path) -> None:  # what Hydra does: the callback, then the record
        config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}}})
        sweep.SummaryCallback().on_multirun_start(config)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / "multirun.yaml").write_text("refused: true\n")

    try:
        fresh = tmp_path / "new" / "a" / "b"
        start(fresh)
        assert sweep.discard_refused_sweep()
        assert list(tmp_path.iterdir()) == []

        used = tmp_path / "used"
        (used / "0").mkdir(parents=True)
        (used / "multirun.yaml").write_text("earlier: true\n")
        start(used)
        assert sweep.discard_refused_sweep()
        assert (used / "multirun.yaml").read_text() == "earlier: true\n"
        assert sorted(p.name for p in used.iterdir()) == ["0", "multirun.yaml"]

        started = tmp_path / "started"
        start(started)
        (started / "0").mkdir()  # job 0 of this sweep ran
        assert not sweep.discard_refused_sweep()
        assert sorted(p.name for p in started.iterdir()) == ["0", "multirun.yaml"]
    finally:
        sweep.active_sweep_dir = None


@pytest.mark.parametrize("earlier", [False, True])
def test_a_sweep_folder_that_cannot_be_written_is_left_as_it_is(tmp_path, monkeypatch, earlier):
    """A fresh user's find: ``-m hydra.sweep.dir=<a read-only folder>``: Hydra's
    ``multirun.yaml`` could not be written, and putting the folder back then raised the same
    ``OSError`` again (43 lines of traceback, exit 1, instead of the output folder's line).
    Putting it back is best effort: nothing was written there, nothing is changed."""
    import errno

    from ddp_exp.job import sweep

    folder = tmp_path / "ro"
    folder.mkdir()
    if earlier:
        (folder / "multirun.yaml").write_text("earlier: true\n")
    sweep.SummaryCallback().on_multirun_start(
        OmegaConf.create({"hydra": {"sweep": {"dir": str(folder)}}}))

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(folder / "multirun.yaml"))

    monkeypatch.setattr(sweep.os, "remove", read_only)
    monkeypatch.setattr(sweep, "atomic_write", read_only)
    try:
        assert not sweep.discard_refused_sweep()
    finally:
        sweep.active_sweep_dir = None
    assert [p.name for p in folder.iterdir()] == (["multirun.yaml"] if earlier else [])


@pytest.mark.smoke
def test_comma_list_without_multirun_suggests_it(run_cli, tmp_path):
    run = run_cli("world_size=1", "data=digits,synthetic", "trainer.epochs=1", timeout=60)
    assert run.returncode == 2
    assert "--multirun" in run.stderr or "-m" in run.stderr.split()
    assert "Traceback" not in run.stderr + run.stdout
    _no_rank_started(run)
    assert not (tmp_path / "outputs").exists()  # no sweep started either
    assert list(tmp_path.rglob("metrics.json")) == []


def test_a_refused_single_run_leaves_no_folder(run_cli, tmp_path):
    """U04: world_size=0 exits 2 and leaves neither its job folder nor the folders Hydra made
    on the way to it (the default outputs/runs/<date>/<time>/ too)."""
    run = run_cli("world_size=0", job="u04/new", timeout=60)
    assert run.returncode == 2 and "world_size" in _one_line(run.stderr)
    assert not (tmp_path / "u04").exists()
    run = run_cli("world_size=0", run_dir=False, timeout=60)
    assert run.returncode == 2 and "world_size" in _one_line(run.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.skipif(bool({"SLURM_JOB_ID", "SLURM_PROCID"} & set(os.environ)),
                    reason="inside a SLURM job: launcher.cluster=slurm would not be refused")
def test_a_refused_cluster_run_leaves_no_folder_it_created(run_cli, tmp_path):
    """Regression: launcher.cluster=slurm outside SLURM was refused and kept the folder it made
    (outputs/runs/<date>/<time>/). Only what the run created goes: a SLURM job's folder that
    existed before (the job's tasks share it; a requeued job finds it again) stays."""
    run = run_cli("launcher.cluster=slurm", "world_size=1", run_dir=False, timeout=60)
    assert run.returncode == 2 and "not a SLURM task" in _one_line(run.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    shared = tmp_path / "outputs" / "runs" / "slurm-77"
    shared.mkdir(parents=True)
    slurm = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "3",
             "SLURM_JOB_NUM_NODES": "2"}
    run = run_cli("launcher.cluster=slurm", "world_size=1", run_dir=False, env=slurm,
                  timeout=60)
    assert run.returncode == 2 and "3 tasks on 2 nodes" in _one_line(run.stderr)
    assert (shared / ".hydra" / "config.yaml").is_file()
    assert json.loads((shared / "status.json").read_text())["status"] == "failed"


def test_a_refused_sweep_job_keeps_its_folder_with_the_error(run_cli, tmp_path):
    """U04, in a sweep: each refused job's folder stays, the error in its log and status.json."""
    sweep = tmp_path / "sweep"
    run = run_cli("-m", "world_size=0,-1", f"hydra.sweep.dir={sweep}", run_dir=False,
                  timeout=60)
    assert run.returncode == 1, run.stderr
    for job, value in (("0", 0), ("1", -1)):
        expected = f"world_size={value} is invalid"
        status = json.loads((sweep / job / "status.json").read_text())
        assert status["status"] == "failed" and expected in status["error"], status
        assert expected in (sweep / job / "ddp_exp.log").read_text()


def test_a_sweep_refused_in_a_used_sweep_folder_leaves_it_as_it_was(run_cli, tmp_path):
    """A second sweep into a sweep folder whose jobs hold runs is refused before its first job
    and leaves the folder as it was: the earlier sweep's multirun.yaml and job records stay
    (fresh-user finding: multirun.yaml was rewritten to the refused sweep's overrides)."""
    sweep = tmp_path / "sweep"
    first = ("-m", "world_size=1", "trainer.max_steps=2", "trainer.epochs=1",
             "print_config=false", f"hydra.sweep.dir={sweep}")
    run_cli(*first, "data.batch_size=16,32", run_dir=False, timeout=120).ok()
    before = {p.relative_to(sweep): p.read_bytes() for p in sweep.rglob("*") if p.is_file()}
    run = run_cli(*first, "data.batch_size=64,128", run_dir=False, timeout=60)
    assert run.returncode == 2, run.stderr
    assert "already holds a run" in run.stderr and "hydra.sweep.dir" in run.stderr
    after = {p.relative_to(sweep): p.read_bytes() for p in sweep.rglob("*") if p.is_file()}
    assert after == before
    # Refused while Hydra composes the jobs (after it wrote multirun.yaml): the same.
    run = run_cli(*first, "model=mlp,nonexistent", run_dir=False, timeout=60)
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("error: model=nonexistent: no such option"), run.stderr
    after = {p.relative_to(sweep): p.read_bytes() for p in sweep.rglob("*") if p.is_file()}
    assert after == before
    # ... and in a new folder, nothing is left.
    run = run_cli(*first[:-1], f"hydra.sweep.dir={tmp_path / 'new' / 'sweep'}",
                  "model=mlp,nonexistent", run_dir=False, timeout=60)
    assert run.returncode == 2 and "model=nonexistent" in run.stderr, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]


def test_a_sweep_refused_in_a_single_runs_folder_writes_nothing_there(run_cli, tmp_path,
                                                                      default_run_1_epoch):
    """A sweep whose job folder is a finished single run's (hydra.sweep.subdir=.) is refused
    and leaves that folder as it was: no multirun.yaml of the refused sweep (fresh-user
    finding)."""
    job = copy_job(default_run_1_epoch, tmp_path)
    before = {p.relative_to(job): p.read_bytes() for p in job.rglob("*") if p.is_file()}
    run = run_cli("-m", "world_size=1", "data.batch_size=64", "trainer.epochs=1",
                  "print_config=false", f"hydra.sweep.dir={job}", "hydra.sweep.subdir=.",
                  run_dir=False, timeout=60)
    assert run.returncode == 2 and "already holds a run" in run.stderr, run.stderr
    after = {p.relative_to(job): p.read_bytes() for p in job.rglob("*") if p.is_file()}
    assert after == before


# -------------------------------------------------------------------- (c) --cfg and --help
def test_cfg_job_prints_config_without_training(run_cli, tmp_path):
    run = run_cli("--cfg", "job", "model=cnn", "data=digits", "world_size=2", run_dir=False,
                  timeout=60)
    assert run.returncode == 0, run.stderr
    assert "ddp_exp.train.models.CNN" in run.stdout
    assert "world_size: 2" in run.stdout
    composed = OmegaConf.create(run.stdout)
    assert composed.model._target_ == "ddp_exp.train.models.CNN" and composed.world_size == 2
    assert list(tmp_path.rglob("tensorboard")) == []
    assert list(tmp_path.rglob("events.out.tfevents*")) == []
    assert list(tmp_path.rglob("metrics.json")) == []
    assert "rank0" not in run.stdout  # no rank logged anything


def test_help_lists_the_groups(run_cli):
    run = run_cli("--help", run_dir=False, timeout=60)
    assert run.returncode == 0, run.stderr
    groups = run.stdout.split("== Config ==")[0]
    for group, options in PROMISED.items():
        line = next((ln for ln in groups.splitlines() if ln.startswith(f"{group}:")), None)
        assert line is not None, (group, groups)
        assert options <= {o.strip() for o in line.split(":", 1)[1].split(",")}, line


def test_composing_a_run_does_not_list_the_help_groups(monkeypatch):
    """The help template is dereferenced at every composition (twice per job); listing the
    groups scans the config repository (seconds), so it happens only under --help."""

    from ddp_exp.cli import usage

    assert usage.help_requested(["world_size=2", "--help"])
    assert usage.help_requested(["-h"]) and not usage.help_requested(["world_size=2"])
    monkeypatch.setattr(sys, "argv", ["ddp_exp", "world_size=2"])
    register_configs()
    usage.register_resolvers()
    with hydra.initialize_config_module("ddp_exp.conf", version_base="1.3"):
        listed = []
        monkeypatch.setattr(usage, "_user_groups", lambda *a: listed.append(1) or [])
        monkeypatch.setattr(usage, "_LISTED", {})
        cfg = hydra.compose("config", overrides=["world_size=2"], return_hydra_config=True)
        assert cfg.world_size == 2 and listed == []
        assert "--help lists them" in cfg.hydra.help.template
        monkeypatch.setattr(sys, "argv", ["ddp_exp", "--help"])
        assert usage.help_groups() == "" and listed == [1]  # the real listing, asked for
        assert usage.help_groups() == "" and listed == [1]  # once per config loader


def test_help_groups_are_hydras_listing_without_the_hidden_groups(monkeypatch):
    """ddp_exp walks only the groups a user sees; the lines are those of Hydra's own
    formatter filtered afterwards (what ``--help`` printed before), and Hydra's options are
    asked once per question (compat.hydra_help) with the same answers."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.global_hydra import GlobalHydra

    from ddp_exp.cli import usage
    from ddp_exp.compat.hydra_help import answer_group_options_once

    monkeypatch.setattr(sys, "argv", ["ddp_exp", "--help"])
    monkeypatch.setattr(usage, "_LISTED", {})
    register_configs()
    with hydra.initialize_config_module("ddp_exp.conf", version_base="1.3"):
        hydra_ = GlobalHydra.instance().hydra
        stock = hydra_.format_config_groups(
            lambda group: group.split("/")[0] not in usage.HIDDEN_GROUPS).rstrip("\n")
        assert usage.help_groups() == stock and stock.count("\n") > 10
        asked = []
        real = ConfigLoaderImpl.get_group_options
        monkeypatch.setattr(ConfigLoaderImpl, "get_group_options",
                            lambda self, *a, **k: asked.append(a) or real(self, *a, **k))
        answer_group_options_once()
        loader = hydra_.config_loader
        first = loader.get_group_options("model")
        assert loader.get_group_options("model") == first and "mlp" in first
        assert len(asked) == 1


# ------------------------------------------------------------------ (d) torchrun world size
TORCHRUN = TORCHRUN_2


@pytest.mark.parametrize(("override", "words"), [
    pytest.param("world_size=3", ("WORLD_SIZE", "3", "2"), id="disagrees"),  # with torchrun's 2
    pytest.param("world_size=two", ("two",), id="not-a-number"),
])
def test_torchrun_world_size_error_printed_once(run_cli, override, words):
    """A world_size= that torchrun's world refuses is one line, not one per rank."""
    run = run_cli(override, "trainer.epochs=1", launcher=TORCHRUN, timeout=90)
    assert run.returncode != 0
    output = run.stdout + run.stderr
    mentions = [ln for ln in output.splitlines() if "world_size" in ln and words[0] in ln]
    assert len(mentions) == 1, output  # once, not once per rank
    assert all(word in mentions[0] for word in words), mentions
    _no_rank_started(run)


def test_torchrun_unknown_group_option_fails(run_cli):
    # C16 under torchrun: Hydra's own report, once (rank 0's), listing the options.
    run = run_cli("data=digitz", "trainer.epochs=1", launcher=TORCHRUN, timeout=90)
    assert run.returncode != 0
    for option in PROMISED["data"]:
        assert option in run.stderr
    assert run.stderr.count("digitz") == 1, run.stderr
    _no_rank_started(run)


def test_torchrun_multirun_refused_once_and_creates_nothing(run_cli, tmp_path):
    """Under torchrun, -m was refused once per job and per rank's sweep, after Hydra had made
    its multirun folders: now one line, before Hydra creates anything."""
    run = run_cli("-m", "data.batch_size=16,32", launcher=TORCHRUN, run_dir=False, timeout=90)
    assert run.returncode != 0
    output = run.stdout + run.stderr
    refusals = [ln for ln in output.splitlines() if "cannot run under torchrun" in ln]
    assert refusals == ["error: multirun (-m) cannot run under torchrun: start the sweep with "
                        "python -m ddp_exp -m ..., which launches one world per job"], output
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))


@pytest.mark.parametrize(("overrides", "key"), [
    (["+foo=1"], "foo"),
    (["data=file", "data.path={csv}", "world_size=6"], "world_size"),
])
def test_more_config_errors_name_the_key(compose, tmp_path, overrides, key):
    """Regressions: an unknown top-level key was accepted; a world larger than the data was
    reported as a data.val_size problem. (Refused before any rank, in-process; the CLI's line
    for such a refusal: test_bad_input_fails_fast_with_one_line.)"""
    csv = tmp_path / "five.csv"
    csv.write_text("1,2,0\n3,4,1\n5,6,0\n7,8,1\n9,1,0\n")
    cfg = compose(*[o.format(csv=csv) for o in overrides])
    message = refused_before_ranks(cfg, tmp_path / "run")
    assert message.startswith(f"{key}="), message


@pytest.mark.parametrize("mode", ["run-under-a-file", "sweep"])
def test_an_output_folder_that_cannot_be_made_is_one_line(run_cli, tmp_path, mode):
    """A hydra.run.dir / hydra.sweep.dir that is a file (or lies under one) is the user's input:
    one line naming the path and the key, exit 2, the file untouched (fresh-user finding)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me\n")
    target = a_file / "sub" if mode == "run-under-a-file" else a_file
    key = "hydra.sweep.dir" if mode == "sweep" else "hydra.run.dir"
    multirun = ["-m"] if mode == "sweep" else []
    run = run_cli(*multirun, "world_size=1", "trainer.epochs=1", f"{key}={target}",
                  run_dir=False, timeout=60)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [_one_line(run.stderr)]
    assert str(target) in run.stderr and key in run.stderr
    assert "Traceback" not in run.stderr + run.stdout
    assert a_file.read_text() == "keep me\n"


# ------------------------------------------------------------ Hydra's run mode
def test_a_sweep_chosen_by_a_config_still_runs_as_a_sweep(run_cli, tmp_path):
    """``hydra.mode: MULTIRUN`` in a user's ``--config-dir`` config: the job is a sweep."""
    conf = tmp_path / "conf" / "experiment"
    conf.mkdir(parents=True)
    (conf / "as_sweep.yaml").write_text("# @package _global_\nhydra:\n  mode: MULTIRUN\n")
    run = run_cli("--config-dir", str(tmp_path / "conf"), "experiment=as_sweep",
                  "world_size=1", "trainer.epochs=1", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                  run_dir=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == ["0"]


def test_limit_val_batches_takes_the_same_samples_for_any_world_size(compose):
    """With data.global_batch_size the per-rank batch follows from the world's size; the
    validation subset counts the batch the user set, so it is the same at 1 and 4 ranks."""
    from ddp_exp.config.checks import apply_global_batch

    sizes = []
    for world_size in (1, 4):
        cfg = compose(f"world_size={world_size}", "data.global_batch_size=32",
                      "trainer.limit_val_batches=2")
        apply_global_batch(cfg, world_size)
        sizes.append(len(load_data(cfg).val))
    assert sizes == [64, 64]


def test_a_typed_per_rank_batch_beside_a_global_batch_is_refused(compose):
    """data.batch_size typed with data.global_batch_size would be replaced without a word by the
    derived per-rank batch: one line naming both; from a preset's YAML it is not refused."""
    from ddp_exp.config.checks import _check_global_batch

    cfg = compose("world_size=2", "data.global_batch_size=64", "data.batch_size=16")
    with pytest.raises(ConfigError, match=r"^data.batch_size=16 is invalid: not given with "
                       r"data.global_batch_size set .*64 / world_size=2\); drop one of the two$"):
        _check_global_batch(cfg, ["world_size=2", "data.global_batch_size=64",
                                  "data.batch_size=16"])
    _check_global_batch(cfg, ["world_size=2", "data.global_batch_size=64"])


def test_only_the_groups_named_in_compat_set_hydra_mode():
    """compat.hydra_mode answers Hydra's get_mode without composing unless an override names
    a group of MODE_GROUPS: every file of ddp_exp.conf that sets hydra.mode, or selects such a
    group in its defaults, must be an option of one of them (the primary config none)."""
    from ddp_exp.compat.hydra_mode import MODE_GROUPS

    conf = Path(str(importlib.resources.files("ddp_exp.conf")))
    setting = set()
    for path in conf.rglob("*.yaml"):
        cfg = OmegaConf.load(path)
        defaults = OmegaConf.to_container(cfg).get("defaults") or []
        chosen = [(k.split()[-1].strip("/"), v) for d in defaults if isinstance(d, dict)
                  for k, v in d.items()]
        assert path.name != "config.yaml" or ("hparams_search", None) in chosen
        if (OmegaConf.select(cfg, "hydra.mode") is not None
                or any(g in MODE_GROUPS and v is not None for g, v in chosen)):
            setting.add(path.relative_to(conf).parts[0])
    assert "hparams_search" in setting  # the scan finds what it looks for
    assert setting <= MODE_GROUPS, setting - MODE_GROUPS


@pytest.mark.parametrize("overrides", [
    [], ["world_size=2", "hydra.run.dir=out"], ["data.batch_size=16,32"],
    ["hparams_search=digits_optuna"], ["+hparams_search=digits_asha"], ["hydra.mode=RUN"],
    ["hydra.mode=MULTIRUN"], ["experiment=digits_cnn_batch_sweep"], ["world_size=two"],
    ["model=no_such_model"]])
def test_the_mode_shortcut_answers_as_hydra_composes(overrides):
    """Hydra's get_mode with ddp_exp's shortcut equals the stock composition's answer."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path

    from ddp_exp.compat import hydra_mode

    register()
    hydra_mode.decide_mode_without_composing()
    shortcut = Hydra.get_mode
    stock = shortcut.__wrapped__
    from hydra.core.global_hydra import GlobalHydra

    app = Hydra.create_main_hydra2(task_name="ddp_exp",
                                   config_search_path=create_config_search_path(
                                       "pkg://ddp_exp.conf"))
    try:
        assert (shortcut(app, "config", list(overrides))
                == stock(app, "config", list(overrides)))
        entries = [(e.provider, e.path) for e in app.config_loader.get_search_path().get_path()]
    finally:
        GlobalHydra.instance().clear()
    assert hydra_mode.only_the_command_line_decides("config", entries, ["world_size=2"])
    assert not hydra_mode.only_the_command_line_decides(
        "config", [*entries, ("command-line", "file:///my/configs")], ["world_size=2"])
    assert not hydra_mode.only_the_command_line_decides("my_config", entries, [])
