"""Fixtures for the image tests: podman (skipped only where it cannot run at all), the stand-in
base, each image built once per session, and the build times and sizes in the summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import imagetools
import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.stash[imagetools.BUILDS] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.image)


@pytest.fixture(scope="session")
def images(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> imagetools.Images:
    reason = imagetools.unavailable()
    if reason is not None:
        pytest.skip(f"podman cannot run here, so no image is built or run: {reason}")
    return imagetools.Images(
        logs=tmp_path_factory.mktemp("image-logs"), config=pytestconfig, built={}
    )


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    builds = config.stash.get(imagetools.BUILDS, [])
    if not builds:
        return
    terminalreporter.section(
        "container images built (podman; cached layers make a warm build fast)"
    )
    for b in builds:
        size = f"{b.size_bytes / 1e6:8.1f} MB" if b.size_bytes is not None else " " * 11
        terminalreporter.write_line(f"{b.seconds:7.1f} s  {size}  {b.what}")
