"""The docs as reference: the generated tables match the code, the examples load."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from controller.config.settings import load_settings

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
