"""The house's layering: each package of ``src/ddp_exp`` imports only packages below it.

Order, top to bottom (``ddp_exp/__init__.py``): cli > launch > rank > train > metrics >
data | job > distributed > io > config > compat; ``data`` and ``job`` are independent of each
other. Every import counts, a function's lazy one included: a lazy import still runs the arrow
backwards. Read from the source with :mod:`ast`, so the test needs no import of the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "ddp_exp"
LAYERS = (("cli",), ("launch",), ("rank",), ("train",), ("metrics",), ("data", "job"),
          ("distributed",), ("io",), ("config",), ("compat",))
LEVEL = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """The ``ddp_exp`` packages a module imports, with the line of each import."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "ddp_exp":
                continue
            if len(parts) > 1:
                found.add((parts[1], node.lineno))
            else:  # from ddp_exp import train
                found.update((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "ddp_exp" and len(parts) > 1:
                    found.add((parts[1], node.lineno))
    return found


def violations() -> list[str]:
    """Every import that runs up the layers or sideways between independent packages."""
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if len(rel.parts) < 2 or rel.parts[0] == "conf":
            continue
        own = rel.parts[0]
        for pkg, line in sorted(imported_packages(path)):
            if pkg == own or pkg not in LEVEL:
                continue
            if LEVEL[pkg] <= LEVEL[own]:
                bad.append(f"{rel}:{line}: {own} imports {pkg}")
    return bad


def test_every_package_is_in_a_layer():
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert packages - {"conf"} == set(LEVEL)


def test_no_import_runs_up_the_layers():
    assert violations() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check can fail: a lazy import of ``train`` in a module of ``io`` is reported."""
    (tmp_path / "io").mkdir()
    (tmp_path / "io" / "__init__.py").write_text("")
    (tmp_path / "io" / "bad.py").write_text("def f():\n    from ddp_exp.train import loop\n")
    monkeypatch.setitem(globals(), "SRC", tmp_path)
    assert violations() == ["io/bad.py:2: io imports train"]


def test_old_module_paths_import_as_the_modules_that_replaced_them():
    """Configs in users' hands name the flat layout's paths (``model._target_=ddp_exp.models.MLP``,
    Hydra callbacks ``ddp_exp.jobdir.NewFoldersCallback``): each imports as the same module
    object, so a class located through the old path is the class itself."""
    import importlib

    from hydra.utils import get_class, get_method

    import ddp_exp

    for old, new in ddp_exp.OLD_PATHS.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from ddp_exp.job.folder import NewFoldersCallback
    from ddp_exp.train.models import MLP

    assert get_class("ddp_exp.models.MLP") is MLP
    assert get_class("ddp_exp.jobdir.NewFoldersCallback") is NewFoldersCallback
    assert get_method("ddp_exp.objective.cross_entropy").__module__ == "ddp_exp.train.objective"
