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
