"""benchmarks/ is a package a reader can hold (issue 42 item 4): every module imports, the
import graph between its modules has no cycle (read from the source with :mod:`ast`, lazy
imports inside functions included: a lazy import still runs the arrow backwards), the
subpackages keep their order, every registered group is well formed, and the results are named
by what they measure."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
# A subpackage imports only those after it (``benchmarks/__init__.py`` draws the same layout).
ORDER = ("__main__", "registry", "groups", "probes", "harness", "baselines", "common",
         "workloads")
OPTIONAL = {"benchmarks.baselines.lightning_digits": "lightning"}  # the bench extra


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(BENCH.rglob("*.py"))}


def imports_of(name: str, path: Path) -> set[str]:
    """The modules of ``benchmarks`` that ``path`` (module ``name``) imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            # ``from benchmarks import common``: a module; ``from benchmarks.x import f``: x
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                       for alias in node.names]
        found.update(t for t in targets if t in MODULES and t != name)
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module of ``benchmarks`` -> the modules of ``benchmarks`` it imports. Importing a
    module runs its package's ``__init__``: ``benchmarks.groups.lm`` imports
    ``benchmarks.groups`` too."""
    graph = {}
    for name, path in MODULES.items():
        edges = imports_of(name, path)
        edges |= {m.rpartition(".")[0] for m in edges if m.rpartition(".")[0] in MODULES}
        graph[name] = edges - {name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as a list of its nodes (the first repeated at the end), or []."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_cycle_finds_a_cycle_and_only_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_imports_of_reads_lazy_relative_and_from_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from benchmarks import common\n"
                   "def f():\n    from benchmarks.harness.stats import Target\n"
                   "    from . import group\n    import benchmarks.workloads\n")
    assert imports_of("benchmarks.harness.x", src) == {
        "benchmarks.common", "benchmarks.harness.stats", "benchmarks.harness.group",
        "benchmarks.workloads"}


def test_the_import_graph_of_benchmarks_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 20 and graph["benchmarks.__main__"], "the graph was not read"
    assert cycle(graph) == []


def _level(name: str) -> int:
    part = name.split(".")[1] if "." in name else "__init__"
    return ORDER.index(part) if part in ORDER else -1


def test_each_subpackage_imports_only_those_below_it():
    up = [f"{a} -> {b}" for a, edges in import_graph().items() for b in sorted(edges)
          if _level(a) >= 0 and _level(b) >= 0 and _level(b) < _level(a)]
    assert up == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name, monkeypatch):
    needs = OPTIONAL.get(name)
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"needs {needs} (the bench extra)")
    monkeypatch.syspath_prepend(str(ROOT))
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} says what it is for"


def test_every_group_is_registered_well_formed_and_has_a_quick_mode(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    registry = importlib.import_module("benchmarks.registry")
    group_modules = {n for n in MODULES if n.startswith("benchmarks.groups.")}
    defining = {sys.modules[g.variants.__module__].__name__ for g in registry.GROUPS.values()}
    assert group_modules <= defining | {"benchmarks.groups.scaling"}, "a group module unlisted"
    for name, g in registry.GROUPS.items():
        assert name == g.name and g.title
        quick, full = g.variants(True), g.variants(False)
        # --quick runs every variant, briefly (scaling and memory at smaller data)
        assert [(v.impl, v.world_size) for v in quick] == [(v.impl, v.world_size) for v in full]
        assert len({v.key for v in full}) == len(full), f"{name}: two variants share a key"
        assert all(v.group == name for v in full), name
        assert full or g.extra or g.probe, f"{name} measures nothing"
        keys = {v.key for v in full}
        for t in g.targets():
            if g.probe:  # rows the probe writes: keyed by the group too
                assert all(k.startswith(f"{name}/") for k in t.keys), t.name
            else:
                assert t.keys <= keys, f"{t.name}: its variants are not the group's"


def test_results_are_named_by_group(monkeypatch):
    """Every CSV in benchmarks/results/ is a registered group's (``<group>.csv``), holds only
    that group's rows, each stamped with when and at which commit it was measured."""
    import csv

    monkeypatch.syspath_prepend(str(ROOT))
    registered = set(importlib.import_module("benchmarks.registry").GROUPS)
    names = {p.stem for p in (BENCH / "results").glob("*.csv")}
    assert names, "no results"
    assert names <= registered, sorted(names - registered)
    for name in names:
        with open(BENCH / "results" / f"{name}.csv", newline="") as fh:
            rows = list(csv.DictReader(fh))
        assert rows and {r["group"] for r in rows} == {name}, name
        assert all(r["measured"] and r["commit"] for r in rows), name


def test_the_command_line_takes_groups_by_name_and_refuses_others(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT))
    main = importlib.import_module("benchmarks.__main__")
    registry = importlib.import_module("benchmarks.registry")
    default = main.parse([]).groups
    assert default and all(not registry.GROUPS[n].opt_in for n in default)
    assert {"scaling", "memory", "step_overhead", "fsdp", "prepare_text", "first_line",
            "trackers", "warmup"} <= set(registry.GROUPS) - set(default)
    assert main.parse(["--only", "c17,lm"]).groups == ["threads", "lm"]  # the old name too
    assert main.parse(["--quick"]).repeats == 1 and main.parse(["--quick", "--repeats", "2"]
                                                                ).repeats == 2
    with pytest.raises(SystemExit) as stop:
        main.parse(["--only", "digits,nope"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "unknown group(s) ['nope']" in err and "digits" in err


def test_no_benchmark_script_sits_outside_the_registry():
    """Every benchmark is a group (issue 42 item 4): the top of benchmarks/ holds the package's
    own modules only, no stand-alone measurement script beside them."""
    top = {p.name for p in BENCH.glob("*.py")}
    assert top == {"__init__.py", "__main__.py", "registry.py", "common.py", "workloads.py"}
