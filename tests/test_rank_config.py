"""Ranks read a typed view of the config (:mod:`ddp_exp.config.view`), not string-keyed dicts:
the view's values have the schema's types, a bad value is refused when the view is built, an
Enum is written out as its plain value, and an AST scan of the rank-side packages fails on a
string-constant subscript of a config section, so that string indexing cannot creep back."""

from __future__ import annotations

import ast
import copy
import io
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

import ddp_exp
from ddp_exp.config.choices import Backend, MonitorMode, Progress, StartMethod
from ddp_exp.config.errors import ConfigError
from ddp_exp.config.schema import (
    AdamWConfig,
    CosineSchedulerConfig,
    DataConfig,
    GPTConfig,
    OptimConfig,
    SchedulerConfig,
    TokensDataConfig,
    TrainerConfig,
)
from ddp_exp.config.view import RankConfig, rank_config
from ddp_exp.train.monitor import Monitor

SRC = Path(ddp_exp.__file__).resolve().parent
# The rank side: these read the typed view only.
SCANNED = [SRC / "rank", SRC / "train", SRC / "metrics", SRC / "data" / "loaders.py"]
# Launch-side functions inside the scanned packages that edit the resolved dict before it is
# stored and sent to the ranks: (file relative to the package, function).
LAUNCH_SIDE = {("train/monitor.py", "resolve")}  # fills trainer.monitor_mode/test_weights


def _plain(compose, *overrides: str) -> dict:
    """The dict the launching process sends to its ranks (launch.build.prepare's form)."""
    return OmegaConf.to_container(compose(*overrides), resolve=True, enum_to_str=True)


def test_the_view_has_the_schemas_types(compose):
    plain = _plain(compose, "data=tokens", "model=gpt", "optim=adamw", "scheduler=cosine",
                   "scheduler.warmup_steps=3", "backend=gloo", "trainer.max_steps=7",
                   "trainer.monitor_mode=max", "launcher.start_method=spawn")
    assert type(plain["distributed"]["backend"]) is str  # the dict: plain values
    cfg = rank_config(plain)
    assert isinstance(cfg, RankConfig)
    # Enum members where the schema has an Enum (the dict held plain strings)
    assert cfg.distributed.backend is Backend.gloo
    assert cfg.trainer.progress is Progress.auto
    assert cfg.trainer.monitor_mode is MonitorMode.max
    assert cfg.launcher.start_method is StartMethod.spawn
    # ints and a nested scheduler dataclass, each section the schema of its target
    assert type(cfg.trainer.max_steps) is int and cfg.trainer.max_steps == 7
    assert isinstance(cfg.trainer, TrainerConfig)
    assert type(cfg.scheduler) is CosineSchedulerConfig and cfg.scheduler.warmup_steps == 3
    assert type(cfg.data) is TokensDataConfig and type(cfg.data.block_size) is int
    assert type(cfg.optim) is AdamWConfig and cfg.optim.betas == [0.9, 0.999]
    assert type(cfg.model) is GPTConfig
    # the dict stays the stored form, and the target nodes are its sections
    assert cfg.stored == plain and cfg.targets.optim is plain["optim"]
    assert cfg.targets.scheduler is plain["scheduler"]
    # the global batch, computed here from the dict's own values
    assert cfg.global_batch_size == (plain["data"]["batch_size"] * plain["world_size"]
                                     * plain["trainer"]["accumulate_grad_batches"])


def test_a_run_without_a_scheduler_and_a_users_targets(compose):
    plain = _plain(compose, "scheduler=none")
    plain["data"] = {**plain["data"], "_target_": "my_project.load", "my_arg": 3}
    plain["model"] = {"_target_": "my_project.Net", "width": 8}
    plain["optim"] = {**plain["optim"], "_target_": "torch.optim.Adam", "amsgrad": True}
    cfg = rank_config(plain)
    assert type(cfg.scheduler) is SchedulerConfig and cfg.scheduler._target_ is None
    # the keys every dataset / optimizer has, typed; the target's own only in its node
    assert type(cfg.data) is DataConfig and not hasattr(cfg.data, "my_arg")
    assert cfg.targets.data["my_arg"] == 3 and cfg.targets.optim["amsgrad"] is True
    assert type(cfg.optim) is OptimConfig and cfg.optim.lr == plain["optim"]["lr"]
    assert cfg.model is None and cfg.targets.model["width"] == 8


@pytest.mark.parametrize(("section", "key", "value", "error", "named"), [
    ("trainer", "log_every_n_steps", 0, ConfigError, "trainer.log_every_n_steps"),
    ("data", "batch_size", 0, ConfigError, "data.batch_size"),
    ("distributed", "timeout_s", -1.0, ConfigError, "distributed.timeout_s"),
    ("trainer", "progress", "sometimes", ValidationError, "progress"),
    ("trainer", "max_steps", "many", ValidationError, "max_steps"),
])
def test_a_bad_value_is_refused_when_the_view_is_built(compose, section, key, value, error,
                                                       named):
    plain = _plain(compose)
    rank_config(plain)  # the good one is accepted
    bad = copy.deepcopy(plain)
    bad[section][key] = value
    with pytest.raises(error, match=re.escape(named)):
        rank_config(bad)


def test_a_bad_top_level_value_is_refused(compose):
    plain = _plain(compose)
    with pytest.raises(ConfigError, match="world_size"):
        rank_config({**plain, "world_size": 0})


def test_an_enum_is_written_out_as_its_plain_value():
    """The monitor's state goes into checkpoints, loaded with weights_only=True (which refuses
    an Enum member): the view's MonitorMode is stored as the plain string."""
    state = Monitor("val/accuracy", MonitorMode.max, None).state_dict()
    assert type(state["mode"]) is str and state["mode"] == "max"
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["mode"] == "max"


# --------------------------------------------------------------------------- the AST scan
CONFIG_NAME = re.compile(r"(^|_)(cfg|config|stored)$")  # cfg, loop.cfg, data_cfg, cfg.stored


def _string_key(node: ast.AST) -> tuple[ast.AST, str] | None:
    """``(base, key)`` of ``base["key"]`` (read) or ``base.get("key", ...)``; else None."""
    if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
            and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
        return node.value, node.slice.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return node.func.value, node.args[0].value
    return None


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _nodes(scope: ast.AST) -> list[ast.AST]:
    """The nodes of ``scope`` that are not inside a function nested in it (its own scope)."""
    out, todo = [], list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        out.append(node)
        if not isinstance(node, FUNCTIONS):
            todo.extend(ast.iter_child_nodes(node))
    return out


def _config_accesses(scope: ast.AST) -> list[ast.AST]:
    """The string-keyed reads of a config section in ``scope`` (a function, or a module's
    code outside functions): of an expression named like a config (``cfg``, ``loop.cfg``,
    ``data_cfg``), of a name bound to such a read (``trainer = cfg["trainer"]``, then
    ``trainer["max_steps"]``), or of such a read itself (``cfg["trainer"]["max_steps"]``)."""
    bound: set[str] = set()
    nodes = _nodes(scope)

    def is_config(expr: ast.AST) -> bool:
        if isinstance(expr, ast.Name):
            return expr.id in bound or bool(CONFIG_NAME.search(expr.id))
        if isinstance(expr, ast.Attribute):
            return bool(CONFIG_NAME.search(expr.attr))
        return is_access(expr)

    def is_access(node: ast.AST) -> bool:
        found = _string_key(node)
        return found is not None and is_config(found[0])

    changed = True
    while changed:  # names bound to a config read, through chains of assignments
        changed = False
        for node in nodes:
            if isinstance(node, ast.Assign) and any(is_access(n) for n in ast.walk(node.value)):
                for target in node.targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name) and name.id not in bound:
                            bound.add(name.id)
                            changed = True
    return [node for node in nodes if is_access(node)]


def config_subscripts(source: str, path: str = "<planted>") -> list[str]:
    """``path:line: expression`` for each string-keyed read of a config section in
    ``source``, in the order of the source, outside the functions of :data:`LAUNCH_SIDE`."""
    tree = ast.parse(source)
    skipped = {name for file, name in LAUNCH_SIDE if path.endswith(file)}
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, FUNCTIONS)
                       and getattr(n, "name", None) not in skipped]
    hits = [n for scope in scopes for n in _config_accesses(scope)]
    hits.sort(key=lambda n: (n.lineno, n.col_offset, len(ast.unparse(n))))
    return [f"{path}:{n.lineno}: {ast.unparse(n)}" for n in hits]


def _scanned_files() -> list[Path]:
    files = []
    for place in SCANNED:
        files += sorted(place.rglob("*.py")) if place.is_dir() else [place]
    return files


def test_no_rank_side_code_indexes_a_config_section_by_string():
    files = _scanned_files()
    assert len(files) > 20 and SRC / "train" / "loop.py" in files
    hits = [hit for path in files
            for hit in config_subscripts(path.read_text(), str(path.relative_to(SRC)))]
    assert not hits, ("rank-side code reads the config by string key; read the typed view "
                      "(ddp_exp.config.view.RankConfig) instead:\n" + "\n".join(hits))


PLANTED = '''
def step(loop, cfg, state, optimizer):
    trainer = loop.cfg["trainer"]
    steps = trainer["max_steps"]
    data_cfg = cfg.get("data")
    workers = data_cfg.get("num_workers", 0)
    every = cfg["trainer"]["log_every_n_steps"]
    lr = optimizer.param_groups[0]["lr"]  # not a config: no hit
    epoch = state["epoch"]  # a checkpoint's state: no hit
    return cfg.trainer.max_steps, loop.cfg.data.batch_size  # the typed view: no hit


def resolve(cfg):
    return cfg["trainer"]["monitor"]  # a launch-side function only in train/monitor.py
'''


def test_the_scan_fails_on_string_indexing():
    hits = config_subscripts(PLANTED)
    assert [h.split(": ", 1)[1] for h in hits] == [
        "loop.cfg['trainer']", "trainer['max_steps']", "cfg.get('data')",
        "data_cfg.get('num_workers', 0)", "cfg['trainer']", "cfg['trainer']['log_every_n_steps']",
        "cfg['trainer']", "cfg['trainer']['monitor']"]
    # the launch-side exemption holds in its own file only
    exempt = config_subscripts(PLANTED, "train/monitor.py")
    assert [h.split(": ", 1)[1] for h in exempt] == [h.split(": ", 1)[1] for h in hits][:6]
