"""One owner per piece of state: a model record's parts (controller.models.record) are
written only inside the module that defines them, and every method there that writes a
field notifies the record's waiters. Read from the source (ast), so a new plain assignment
anywhere in the controller fails here."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import controller

ROOT = Path(controller.__file__).parent
# The record and its parts, by the module that owns (defines and writes) them.
PARTS = {
    "models/record.py": ("ModelRecord",),
    "models/enginefacts.py": ("EngineFacts",),
    "models/holdings.py": ("Holdings",),
    "models/fleetparts.py": ("Lane", "Swapping", "Process"),
    "models/ckptfacts.py": ("CheckpointFacts",),
}
# What a write may call to notify: the parts' own signal, or the record's.
NOTIFY = {"_changed", "changed", "set_snapshot"}
# What a part keeps for itself and never changes after its constructor.
CONSTANT = {"name", "settings", "clock", "changes", "_changes", "_clock"}


def _tree(rel: str) -> ast.Module:
    return ast.parse((ROOT / rel).read_text(), rel)


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    if isinstance(node, ast.Assign):
        todo = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        todo = [node.target]
    else:
        return
    while todo:
        t = todo.pop()
        if isinstance(t, ast.Tuple | ast.List):
            todo.extend(t.elts)
        else:
            yield t


def _self_writes(fn: ast.AST) -> set[str]:
    return {
        t.attr
        for node in ast.walk(fn)
        for t in _targets(node)
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


def _classes() -> dict[str, ast.ClassDef]:
    found = {}
    for rel, names in PARTS.items():
        for node in _tree(rel).body:
            if isinstance(node, ast.ClassDef) and node.name in names:
                found[node.name] = node
    assert set(found) == {n for names in PARTS.values() for n in names}
    return found


def _fields(cls: ast.ClassDef) -> set[str]:
    fields = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            fields.add(node.target.id)
        elif isinstance(node, ast.FunctionDef):
            fields |= _self_writes(node)
    return fields - CONSTANT


def _part_fields() -> set[str]:
    return set().union(*(_fields(c) for c in _classes().values()))


def _assignments_outside_owners() -> list[str]:
    """Every `x.field = ...` (or +=, or unpacked) of a part's field in a module that owns no
    part; `self.field` in a class of its own is that class's field, not the record's."""
    fields = _part_fields()
    owners = set(PARTS)
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in owners:
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            for t in _targets(node):
                if not isinstance(t, ast.Attribute) or t.attr not in fields:
                    continue
                if isinstance(t.value, ast.Name) and t.value.id == "self":
                    continue
                found.append(f"{rel}:{t.lineno}: {ast.unparse(t)}")
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) == "setattr"
                and len(node.args) > 1
                and isinstance(name := node.args[1], ast.Constant)
                and name.value in fields
            ):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_part_field_is_assigned_outside_its_owner_module() -> None:
    assert _assignments_outside_owners() == []


def test_every_write_in_a_part_notifies() -> None:
    """A method (not the constructor) that writes a field calls a notifying method, or one
    of its own methods that does."""
    silent = []
    for name, cls in _classes().items():
        methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
        notifying = set(NOTIFY)
        for _ in methods:  # a method that calls a notifying one notifies too
            for fname, fn in methods.items():
                calls = {
                    c.func.attr
                    for c in ast.walk(fn)
                    if isinstance(c, ast.Call)
                    and isinstance(c.func, ast.Attribute)
                    and isinstance(c.func.value, ast.Name)
                    and c.func.value.id == "self"
                }
                if calls & notifying:
                    notifying.add(fname)
        for fname, fn in methods.items():
            if fname != "__init__" and _self_writes(fn) - CONSTANT and fname not in notifying:
                silent.append(f"{name}.{fname}")
    assert silent == []


def test_the_rule_sees_a_plain_assignment() -> None:
    """The check is not vacuous: a record's field assigned from elsewhere is found."""
    fields = _part_fields()
    assert {"in_flight", "host_bytes", "desynced", "engine", "_snapshot"} <= fields
    source = "def f(rec):\n    rec.holdings.host_bytes = 0\n    rec.lane.held += 1\n"
    hits = [
        t
        for node in ast.walk(ast.parse(source))
        for t in _targets(node)
        if isinstance(t, ast.Attribute) and t.attr in fields
    ]
    assert len(hits) == 2
