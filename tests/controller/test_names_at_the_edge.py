"""Names are resolved once, at the HTTP edge: below controller/http, parts hand each other
the model's object (its `ModelManager`, its record), and the policies' plans hand back the
views they chose, each with its object. Read from the source (ast), so a lookup by name
added anywhere below the edge fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import controller

ROOT = Path(controller.__file__).parent
EDGE = "http/"  # the two apps: a request's name becomes the model here


def _lookups(source: str, rel: str) -> list[str]:
    """`<...manager>.get(...)` (Manager.get: a model by name) and `<...fleet>[...]` (the
    fleet's records by name)."""
    found = []
    for node in ast.walk(ast.parse(source, rel)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and ast.unparse(node.func.value).endswith("manager")
        ):
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("fleet"):
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_model_is_looked_up_by_name_below_the_http_edge() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(EDGE):
            found += _lookups(path.read_text(), rel)
    assert found == []


def test_the_edge_does_look_names_up() -> None:
    """The check is not vacuous: the edge's own lookups, and one written below it, are seen."""
    edge = [
        hit for path in sorted((ROOT / EDGE).glob("*.py")) for hit in _lookups(path.read_text(), "")
    ]
    assert edge  # api.py and gateway.py resolve a request's name
    below = "def f(self, plan):\n    self.manager.get(plan.evict[0])\n    self.fleet[name]\n"
    assert len(_lookups(below, "x.py")) == 2
