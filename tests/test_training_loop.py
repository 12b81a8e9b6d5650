"""The training state's typed home (issue 42 item 5): the loop's helpers take
:class:`ddp_exp.train.training_loop.TrainingLoop` (or a protocol built on it), not ``Any``, so
what a helper may read and write is in its signature. Read from the source with :mod:`ast`:
every ``loop.<name>`` a helper touches is a member of the protocol its signature names, a
helper hands the loop on only to helpers that ask no more of it, and the loop
(:class:`ddp_exp.train.loop.Trainer`) has every member the protocols declare."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

TRAIN = Path(__file__).resolve().parents[1] / "src" / "ddp_exp" / "train"
# Modules whose `loop` parameters may still be `Any`: none.
PENDING: set[str] = set()
PROTOCOL_MODULES = ("training_loop", "step_checkpoint", "strategy")


def _protocols() -> dict[str, set[str]]:
    """Each protocol a helper may name -> its members (annotated attributes, properties and
    methods, inherited ones included)."""
    found = {}
    for name in PROTOCOL_MODULES:
        module = importlib.import_module(f"ddp_exp.train.{name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and getattr(obj, "_is_protocol", False) \
                    and obj.__module__ == module.__name__:
                members = set()
                for klass in obj.__mro__:
                    if getattr(klass, "_is_protocol", False) and klass.__module__.startswith(
                            "ddp_exp."):
                        members |= set(vars(klass).get("__annotations__", {}))
                        members |= {k for k in vars(klass) if not k.startswith("_")}
                found[obj.__name__] = members
    return found


def _helpers() -> list[tuple[str, str, str, ast.FunctionDef]]:
    """(file, function, annotation of its ``loop``, node) for every function of ``train/``
    with a parameter named ``loop``, the loop's own module aside."""
    found = []
    for path in sorted(TRAIN.glob("*.py")):
        if path.name == "loop.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                for arg in node.args.args:
                    if arg.arg == "loop":
                        note = ast.unparse(arg.annotation) if arg.annotation else ""
                        found.append((path.name, node.name, note.split(".")[-1], node))
    return found


def _touched(node: ast.FunctionDef) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "loop"}


def test_every_helper_names_what_it_takes():
    untyped = [f"{file}:{name}" for file, name, note, _ in _helpers()
               if file not in PENDING and note not in _protocols()]
    assert untyped == [], f"loop parameters not typed by a protocol: {untyped}"


@pytest.mark.parametrize("helper", [h for h in _helpers() if h[0] not in PENDING],
                         ids=lambda h: f"{h[0]}:{h[1]}")
def test_a_helper_touches_only_what_its_signature_declares(helper):
    file, name, note, node = helper
    protocols = _protocols()
    members = protocols[note]
    assert not _touched(node) - members, (
        f"{file}:{name} touches loop.{sorted(_touched(node) - members)}, not in {note}")
    # The loop handed on: the callee asks no more than this helper's protocol holds. A bare
    # name is this module's function; ``module.name`` is that module's (two modules have a
    # ``take``).
    callees = {(h[0][:-3], h[1]): protocols.get(h[2]) for h in _helpers()
               if h[0] not in PENDING}
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and any(
                isinstance(a, ast.Name) and a.id == "loop" for a in call.args[:1]):
            parts = ast.unparse(call.func).split(".")
            module = parts[-2] if len(parts) > 1 else file[:-3]
            wanted = callees.get((module, parts[-1]))
            if wanted is not None:
                assert wanted <= members, f"{file}:{name} hands {note} to {module}.{parts[-1]}"


def test_the_loop_has_every_member_the_protocols_declare():
    tree = ast.parse((TRAIN / "loop.py").read_text())
    [trainer] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer"]
    has = {n.name for n in trainer.body if isinstance(n, ast.FunctionDef)}
    for node in ast.walk(trainer):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign) else [])
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                        and t.value.id == "self":
                    has.add(t.attr)
    for protocol, members in _protocols().items():
        assert not members - has, f"Trainer lacks {sorted(members - has)} of {protocol}"


def test_the_protocols_import_nothing_at_run_time():
    """Typing only: the protocol's module imports no house module when it runs, so any helper
    may import it (tests/test_layers.py holds the circles)."""
    tree = ast.parse((TRAIN / "training_loop.py").read_text())
    runtime = [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [line for line in runtime if "ddp_exp" in line], runtime
