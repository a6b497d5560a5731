"""Fixtures for the image tests: podman (skipped only where it cannot run at all), the stand-in
base, each image built once per session, and the build times and sizes in the summary."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import imagetools
import pytest


@dataclass(frozen=True)
class BuildRecord:
    what: str
    seconds: float
    size_bytes: int | None


_BUILDS = pytest.StashKey[list[BuildRecord]]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_BUILDS] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.image)


@dataclass
class Images:
    """Builds the project's images (once each per session) and records what they cost."""

    logs: Path
    config: pytest.Config
    built: dict[str, imagetools.Build]

    def base(self) -> None:
        seconds = imagetools.ensure_standin_base(self.logs / "standin.log")
        if seconds:
            self.record(f"stand-in {imagetools.BASE} (debootstrap + import)", seconds, None)

    def build(self, dockerfile: str, tag: str, **kw: Any) -> imagetools.Build:
        if tag not in self.built:
            self.base()
            log = self.logs / f"{Path(dockerfile).stem}.build.log"
            try:
                done = imagetools.build(imagetools.DOCKER / dockerfile, tag, log, **kw)
            except imagetools.ImageError as exc:
                pytest.fail(f"building {dockerfile} failed (full log: {log}):\n{exc}")
            self.built[tag] = done
            self.record(f"{tag} (docker/{dockerfile})", done.seconds, done.size_bytes)
        return self.built[tag]

    def record(self, what: str, seconds: float, size: int | None) -> None:
        self.config.stash[_BUILDS].append(BuildRecord(what, seconds, size))


@pytest.fixture(scope="session")
def images(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Images:
    reason = imagetools.unavailable()
    if reason is not None:
        pytest.skip(f"podman cannot run here, so no image is built or run: {reason}")
    return Images(logs=tmp_path_factory.mktemp("image-logs"), config=pytestconfig, built={})


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    builds = config.stash.get(_BUILDS, [])
    if not builds:
        return
    terminalreporter.section(
        "container images built (podman; cached layers make a warm build fast)"
    )
    for b in builds:
        size = f"{b.size_bytes / 1e6:8.1f} MB" if b.size_bytes is not None else " " * 11
        terminalreporter.write_line(f"{b.seconds:7.1f} s  {size}  {b.what}")
