"""The code's shape (issue 27): no function over 80 lines and no class over 400 in the
controller or the worker extension, so that each reads as one concern."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 400


def too_long(paths: Iterable[Path]) -> list[str]:
    """Every function or class over its limit, as `file:line name (n lines > limit)`. A
    definition runs from its `def`/`class` line (decorators excluded) to its last line."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                limit = MAX_CLASS_LINES
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                limit = MAX_FUNCTION_LINES
            else:
                continue
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            if n > limit:
                found.append(f"{path.name}:{node.lineno} {node.name} ({n} lines > {limit})")
    return found


def test_no_function_over_80_lines_and_no_class_over_400() -> None:
    paths = sorted(p for root in ("controller", "worker_ext") for p in (ROOT / root).rglob("*.py"))
    assert len(paths) > 50  # the walk sees the code
    assert too_long(paths) == []


def test_the_walk_names_a_function_one_line_over(tmp_path: Path) -> None:
    """The check itself can fail: a function of 81 lines is named, one of 80 is not."""
    over = tmp_path / "over.py"
    lines = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    over.write_text(
        f"def long_one():\n{lines}\n\n\ndef short_one():\n{lines[: -len('    x79 = 79') - 1]}\n"
    )
    assert too_long([over]) == [f"over.py:1 long_one ({MAX_FUNCTION_LINES + 1} lines > 80)"]
