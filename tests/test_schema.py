"""One typed source for every key (issue 27 item 2): the schema dataclasses
(:mod:`ddp_exp.config.schema`) hold the defaults, and a YAML option of ``conf/`` holds only what
differs from the schema it extends.
"""

from __future__ import annotations

import dataclasses
import importlib.resources

import pytest
from omegaconf import OmegaConf

from ddp_exp.config import schema

CONF = importlib.resources.files("ddp_exp.conf")
SCHEMA_OF = {(group, name): node for group, name, node in schema.SCHEMAS}


def _defaults(node: type) -> dict:
    """The schema dataclass ``node``'s defaults, as OmegaConf composes them (MISSING: ``???``)."""
    return OmegaConf.to_container(OmegaConf.structured(node), resolve=False)


def _restated(values: dict, defaults: dict, where: str) -> list[str]:
    """``where.key`` for every key of ``values`` whose value is ``defaults``' own."""
    return [f"{where}.{key}" for key, value in values.items()
            if key in defaults and OmegaConf.to_container(OmegaConf.create({"v": value}))["v"]
            == defaults[key]]


def _group_options() -> list[tuple[str, str]]:
    return sorted((group.name, option.name[:-5]) for group in CONF.iterdir() if group.is_dir()
                  for option in group.iterdir() if option.name.endswith(".yaml"))


@pytest.mark.parametrize("group,option", _group_options())
def test_no_option_restates_a_schema_default(group, option):
    """Every value a YAML option sets differs from the default of the schema it extends (its
    defaults list's ``/schema/<group>/<name>``): a default is written once, in schema.py."""
    yaml = OmegaConf.to_container(OmegaConf.load(str(CONF / group / f"{option}.yaml")),
                                  resolve=False)
    restated = []
    for entry in yaml.get("defaults", []):
        if not (isinstance(entry, str) and entry.startswith("/schema/")):
            continue
        path, _, package = entry[len("/schema/"):].partition("@")
        node = SCHEMA_OF[tuple(path.split("/"))]
        values = yaml if package == "_here_" else yaml.get(package, {})
        restated += _restated(values, _defaults(node), group if package == "_here_" else package)
    assert restated == [], f"conf/{group}/{option}.yaml restates the schema's defaults"


def test_the_primary_config_restates_no_top_level_default():
    """conf/config.yaml's top-level keys (``world_size``, ``device``, ...) are Config's."""
    yaml = OmegaConf.to_container(OmegaConf.load(str(CONF / "config.yaml")), resolve=False)
    values = {k: v for k, v in yaml.items() if k not in ("defaults", "hydra")}
    top = {f.name: getattr(schema.Config, f.name) for f in dataclasses.fields(schema.Config)
           if f.default is not dataclasses.MISSING}
    assert _restated(values, top, "config") == []


# A key whose values are names has an Enum type (ddp_exp.config.choices): a bad name is refused
# when Hydra composes the config, and the entry point prints the line validate printed when the
# key was a string (each line below is validate's, as it was). The first two were refused
# in-process after composition (test_config's BAD_INPUT_MORE, test_scale_out's
# WORLD_SHAPE_ERRORS) and moved here.
CHOICE_REFUSALS = [
    (["device=gpu"], "device='gpu' is invalid: one of auto, cpu, cuda"),
    (["launcher.rdzv_backend=etcd"], "launcher.rdzv_backend='etcd' is invalid: c10d (elastic: "
     "nodes join by launcher.rdzv_id) or static (fixed launcher.node_rank)"),
    (["distributed.backend=glo"], "backend='glo' is invalid: one of auto, gloo, nccl"),
    (["launcher.start_method=thread"],
     "launcher.start_method='thread' is invalid: one of fork, forkserver, spawn"),
    (["trainer.progress=verbose"],
     "trainer.progress='verbose' is invalid: one of auto, bar, log, off"),
    (["trainer.monitor_mode=up"],
     "trainer.monitor_mode='up' is invalid: null (from the metric) or one of min, max"),
    (["trainer.test_weights=first"], "trainer.test_weights='first' is invalid: null (best when "
     "a monitor exists), best or last"),
]


@pytest.mark.parametrize("overrides,line", CHOICE_REFUSALS,
                         ids=[overrides[0] for overrides, _ in CHOICE_REFUSALS])
def test_a_bad_name_is_refused_at_composition_in_the_line_validate_gave(compose, overrides,
                                                                        line):
    from hydra.errors import HydraException

    from ddp_exp.cli.errors import _one_line as entry_line

    with pytest.raises(HydraException) as info:
        compose("world_size=2", "trainer.epochs=1", *overrides)
    assert entry_line(info.value) == line


def test_an_unquoted_off_in_a_yaml_file_is_refused_saying_to_quote_it():
    """YAML reads ``progress: off`` as ``false``: the line says so (before the Enum it said
    ``trainer.progress='False' is invalid``)."""
    from omegaconf.errors import ValidationError

    from ddp_exp.config.choices import refused_choice

    with pytest.raises(ValidationError) as info:
        OmegaConf.merge(OmegaConf.structured(schema.Config),
                        OmegaConf.create("trainer:\n  progress: off\n"))
    assert refused_choice(info.value) == (
        "trainer.progress='False' is invalid: one of auto, bar, log, off (YAML reads an "
        "unquoted off as false: write 'off')")


def test_names_reach_the_ranks_as_plain_strings(compose):
    """What ranks receive (OmegaConf.to_container with enum_to_str) holds ``str`` values, and
    a composed Enum compares, formats and serialises as its name."""
    import json

    cfg = compose("device=cpu", "trainer.progress=off", "trainer.monitor_mode=max")
    assert cfg.trainer.progress == "off" and f"{cfg.device}" == "cpu"
    assert json.dumps(OmegaConf.to_container(cfg.trainer)["progress"]) == '"off"'
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    values = (plain["device"], plain["distributed"]["backend"], plain["trainer"]["progress"],
              plain["trainer"]["monitor_mode"], plain["launcher"]["start_method"],
              plain["launcher"]["rdzv_backend"])
    assert values == ("cpu", "auto", "off", "max", "fork", "c10d")
    assert all(type(v) is str for v in values)


def test_a_bad_name_on_the_command_line_is_one_line_exit_2(run_cli):
    run = run_cli("device=gpu", "trainer.epochs=1", timeout=60)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == "error: device='gpu' is invalid: one of auto, cpu, cuda"
    assert not run.job_dir.exists() or not (run.job_dir / "tensorboard").exists()


def test_an_unquoted_off_in_a_users_yaml_is_one_line_exit_2(run_cli, tmp_path):
    """Hydra's error for a value of a YAML file (not the command line) carries OmegaConf's as
    its context: the same one line, not Hydra's report over five lines."""
    presets = tmp_path / "conf" / "experiment"
    presets.mkdir(parents=True)
    (presets / "quiet.yaml").write_text("# @package _global_\ntrainer:\n  progress: off\n")
    run = run_cli("--config-dir", str(tmp_path / "conf"), "experiment=quiet", timeout=60)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == ("error: trainer.progress='False' is invalid: one of auto, bar, "
                                  "log, off (YAML reads an unquoted off as false: write 'off')")


# Each section's dataclass checks its own ranges in __post_init__ (ddp_exp.config.ranges), so
# building the typed config (OmegaConf.to_object, in validate) refuses a value out of range in
# the line validate gave; the relations between keys stay in ddp_exp.config.checks.
SECTION_RANGES = [
    (schema.TrainerConfig, {"epochs": 0}, "trainer.epochs=0 is invalid: a positive integer"),
    (schema.DigitsDataConfig, {"batch_size": 0},
     "data.batch_size=0 is invalid: a positive integer (per rank)"),
    (schema.ImageFolderDataConfig, {"channels": 2},
     "data.channels=2 is invalid: 1 (grey) or 3 (RGB)"),
    (schema.MLPConfig, {"hidden_sizes": [0]},
     "model.hidden_sizes=[0] is invalid: positive layer widths"),
    (schema.SGDConfig, {"lr": -1.0},
     "optim.lr=-1.0 is invalid: a finite, non-negative learning rate"),
    # inf passed, and every weight became nan at the second step, in the ranks (a fresh user)
    (schema.AdamWConfig, {"lr": float("inf")},
     "optim.lr=inf is invalid: a finite, non-negative learning rate"),
    (schema.CosineSchedulerConfig, {"warmup_steps": -1},
     "scheduler.warmup_steps=-1 is invalid: 0 or a positive number of optimizer steps"),
    (schema.DistributedConfig, {"timeout_s": 0.0},
     "distributed.timeout_s=0.0 is invalid: a positive number of seconds"),
    (schema.LauncherConfig, {"rdzv_endpoint": "garbage"}, "launcher.rdzv_endpoint='garbage' is "
     "invalid: HOST:PORT, e.g. 127.0.0.1:0 (port 0: a free port, one node only)"),
    (schema.DDPConfig, {"bucket_cap_mb": 0.0}, "ddp.bucket_cap_mb=0.0 is invalid: > 0 MiB"),
    (schema.Config, {"world_size": 0},
     "world_size=0 is invalid: a positive integer (1, 2, 3, ...)"),
]


@pytest.mark.parametrize("node,values,line", SECTION_RANGES,
                         ids=[f"{n.__name__}-{next(iter(v))}" for n, v, _ in SECTION_RANGES])
def test_each_section_checks_its_ranges_when_built(node, values, line):
    from ddp_exp.config.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        node(**values)
    assert str(info.value) == line


def test_every_schema_builds_with_its_defaults():
    """Defaults are in range; a MISSING (``???``) or interpolated default is left to validate."""
    for _, _, node in schema.SCHEMAS:
        node()
    schema.Config()


def test_building_the_composed_config_runs_the_range_checks(compose):
    """OmegaConf.to_object (what validate runs) builds each section's dataclass."""
    from ddp_exp.config.errors import ConfigError

    typed = OmegaConf.to_object(compose("data=tokens", "model=gpt", "optim=adamw"))
    assert isinstance(typed.trainer, schema.TrainerConfig)
    assert isinstance(typed.data, schema.TokensDataConfig) and typed.data.batch_size == 16
    with pytest.raises(ConfigError, match=r"^trainer\.log_every_n_steps=0 is invalid"):
        OmegaConf.to_object(compose("trainer.log_every_n_steps=0"))
