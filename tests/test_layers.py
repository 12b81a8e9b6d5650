"""The house's layering: each package of ``src/ddp_exp`` imports only packages below it, and no
module is part of an import circle.

Order, top to bottom (``ddp_exp/__init__.py``): cli > hydra_plugins > launch > rank > train >
metrics > data | job > distributed > io > config > compat; ``data`` and ``job`` are independent
of each other. ``hydra_plugins`` (``src/hydra_plugins``: the ``ddp_optuna`` sweeper, which
imports ``train``, ``job`` and ``io``) is a package of the house too: the entry registers it,
nothing below may import it. Every import counts, a function's lazy one and an
``importlib.import_module("ddp_exp....")`` of a constant name included: a lazy import still runs
the arrow backwards. Read from the source with :mod:`ast`, so the test needs no import of the
package.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "ddp_exp"
LAYERS = (("cli",), ("hydra_plugins",), ("launch",), ("rank",), ("train",), ("metrics",),
          ("data", "job"), ("distributed",), ("io",), ("config",), ("compat",))
LEVEL = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
ROOTS = ("ddp_exp", "hydra_plugins")  # the top-level packages of src/


def _import_module_name(node: ast.AST) -> str | None:
    """The constant name of an ``importlib.import_module("...")`` call, else None."""
    if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and ast.unparse(node.func) in ("importlib.import_module", "import_module")):
        return node.args[0].value
    return None


def imported_modules(path: Path) -> set[tuple[str, int]]:
    """Every module of :data:`ROOTS` that ``path`` imports (dotted, as written; for ``from a
    import b`` both ``a`` and ``a.b``, which may be a module), with the line of each import:
    ``import``, ``from ... import``, anywhere in the file (a function's body included), and
    ``importlib.import_module`` of a constant name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif _import_module_name(node):
            names = [_import_module_name(node)]
        found.update((name, node.lineno) for name in names if name.split(".")[0] in ROOTS)
    return found


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """The house's packages (``ddp_exp``'s, and ``hydra_plugins``) a module imports, with the
    line of each import."""
    found = set()
    for name, line in imported_modules(path):
        parts = name.split(".")
        if parts[0] == "hydra_plugins":
            found.add(("hydra_plugins", line))
        elif len(parts) > 1:
            found.add((parts[1], line))
    return found


def _modules(src: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under ``src`` (its packages' ``__init__`` included)."""
    found = {}
    for path in src.rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def violations() -> list[str]:
    """Every import that runs up the layers or sideways between independent packages."""
    bad = []
    files = [(path, path.relative_to(SRC).parts[0]) for path in sorted(SRC.rglob("*.py"))
             if len(path.relative_to(SRC).parts) >= 2]
    plugins = SRC.parent / "hydra_plugins"
    files += [(path, "hydra_plugins") for path in sorted(plugins.rglob("*.py"))]
    for path, own in files:
        if own == "conf":
            continue
        rel = path.relative_to(SRC.parent)
        for pkg, line in sorted(imported_packages(path)):
            if pkg == own or pkg not in LEVEL:
                continue
            if LEVEL[pkg] <= LEVEL[own]:
                bad.append(f"{rel}:{line}: {own} imports {pkg}")
    return bad


def _module_edges(path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports, anywhere in the file: ``from a import
    b`` imports the module ``a.b`` when there is one (its package ``a`` runs first in any case,
    as every parent package does: no edge of its own), else names of ``a``; ``import a.b``
    and ``importlib.import_module("a.b")`` import ``a.b``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{alias.name}" for alias in node.names} & set(modules)
            found |= subs
            if len(subs) < len(node.names):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif _import_module_name(node):
            found.add(_import_module_name(node))
    return found & set(modules)


def circles(src: Path) -> list[list[str]]:
    """The import circles among the modules under ``src`` (each strongly connected set of two
    or more modules, every import counted: Tarjan's algorithm), sorted."""
    modules = _modules(src)
    graph = {name: sorted(_module_edges(path, modules) - {name})
             for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(found)


def test_every_package_is_in_a_layer():
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert packages - {"conf"} | {"hydra_plugins"} == set(LEVEL)


def test_no_import_runs_up_the_layers():
    assert violations() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check can fail: a lazy import of ``train`` in a module of ``io`` is reported."""
    monkeypatch.setitem(globals(), "SRC", tmp_path / "ddp_exp")
    io = tmp_path / "ddp_exp" / "io"
    io.mkdir(parents=True)
    (io / "__init__.py").write_text("")
    (io / "bad.py").write_text("def f():\n    from ddp_exp.train import loop\n")
    assert violations() == ["ddp_exp/io/bad.py:2: io imports train"]


def test_the_check_sees_an_import_of_the_plugin_and_by_name(tmp_path, monkeypatch):
    """The config layer importing the sweeper plugin (to register it: issue 42 item 5) and an
    ``importlib.import_module`` of a package above are reported."""
    monkeypatch.setitem(globals(), "SRC", tmp_path / "ddp_exp")
    (tmp_path / "ddp_exp" / "config").mkdir(parents=True)
    (tmp_path / "ddp_exp" / "config" / "compose.py").write_text(
        "from hydra_plugins import ddp_optuna_sweeper\n"
        "def f():\n    importlib.import_module('ddp_exp.launch.build')\n")
    assert violations() == ["ddp_exp/config/compose.py:1: config imports hydra_plugins",
                            "ddp_exp/config/compose.py:3: config imports launch"]


def test_no_module_is_in_an_import_circle():
    assert circles(SRC.parent) == []


def test_the_check_sees_a_circle_of_three(tmp_path):
    """``folder`` -> ``lock`` -> (a function's import of) ``earlier_run`` -> ``folder``: the
    circle ``job/`` had."""
    job = tmp_path / "ddp_exp" / "job"
    job.mkdir(parents=True)
    (job / "__init__.py").write_text("")
    (job / "folder.py").write_text("from ddp_exp.job.lock import lock\n")
    (job / "lock.py").write_text("def lock():\n    from ddp_exp.job import earlier_run\n")
    (job / "earlier_run.py").write_text("from ddp_exp.job.folder import x\n")
    (job / "other.py").write_text("from ddp_exp.job import folder\n")
    assert circles(tmp_path) == [["ddp_exp.job.earlier_run", "ddp_exp.job.folder",
                                  "ddp_exp.job.lock"]]


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
