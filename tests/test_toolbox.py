"""The tests' one toolbox (issue 27): a test imports its helpers from tests/support (or a
helper module beside it), never a conftest or another test module, and never a benchmark's
pieces; a test of a benchmark's harness runs it as a process, but for the density
harness's planning, whose unit tests import it. Read from the source (ast)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# The one module that imports a benchmark: the density harness's own unit tests.
BENCHMARK_UNIT_TESTS = {"controller/test_density_plan.py"}


def _imported(source: str) -> set[str]:
    """The top-level names of every module `source` imports (absolute imports)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def _offences(rel: str, source: str) -> list[str]:
    found = []
    for name in sorted(_imported(source)):
        if name == "conftest" or name.startswith("test_"):
            found.append(f"{rel}: imports {name}")
        if name == "benchmarks" and rel not in BENCHMARK_UNIT_TESTS:
            found.append(f"{rel}: imports benchmarks")
    return found


def test_no_test_imports_a_conftest_a_test_module_or_a_benchmark() -> None:
    sources = {p.relative_to(TESTS).as_posix(): p.read_text() for p in TESTS.rglob("*.py")}
    assert "support/asgi.py" in sources  # the walk sees the tests
    assert [hit for rel in sorted(sources) for hit in _offences(rel, sources[rel])] == []


def test_the_check_sees_each_kind() -> None:
    source = "import conftest\nfrom test_api import x\nfrom benchmarks.coverage import ROWS\n"
    assert len(_offences("controller/test_x.py", source)) == 3
    assert _offences("controller/test_x.py", "from support.asgi import served\n") == []


def test_forked_core_runs_the_same_server_with_the_same_arguments() -> None:
    from support.engines import API_SERVER, FORKED_CORE_MAIN, forked_core

    argv = ["python", "-m", API_SERVER, "--model", "m", "--enforce-eager"]
    assert forked_core(argv) == [
        "python",
        "-c",
        FORKED_CORE_MAIN,
        "--model",
        "m",
        "--enforce-eager",
    ]
    assert f'runpy.run_module("{API_SERVER}"' in FORKED_CORE_MAIN
    compile(FORKED_CORE_MAIN, "<forked_core>", "exec")
    with pytest.raises(ValueError, match="not vLLM's API server"):
        forked_core(["vllm", "serve", API_SERVER])
    with pytest.raises(ValueError, match="is not in list"):
        forked_core(["python", "-m", "some.other.server"])
