#!/usr/bin/env python3
"""Rewrite the generated sections of the docs from the code; `--check` only compares.

Each section sits between `<!-- NAME: generated, do not edit -->` and `<!-- end NAME -->`
in its page and is the output of `python -m MODULE` run on this checkout. The text around
the markers is written by hand. `scripts/dev.sh docs` rewrites; tests/test_docs.py checks.
"""

from __future__ import annotations

import difflib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (page, section name, module whose `python -m` prints the section)
SECTIONS = [
    ("docs/settings.md", "sidecar settings", "controller.reference"),
    ("docs/settings.md", "worker settings", "worker_ext.settings"),
]


def generate(module: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", module], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SystemExit(f"docgen: python -m {module} failed:\n{out.stderr}")
    return out.stdout


def splice(text: str, name: str, body: str, page: str) -> str:
    begin, end = f"<!-- {name}: generated, do not edit -->\n", f"<!-- end {name} -->"
    if text.count(begin) != 1 or text.count(end) != 1:
        raise SystemExit(f"docgen: {page} needs exactly one {begin.strip()} and one {end}")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}{body}{end}{tail}"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for page, name, module in SECTIONS:
        path = ROOT / page
        old = path.read_text()
        new = splice(old, name, generate(module), page)
        if new == old:
            continue
        stale.append(page)
        if check:
            diff = difflib.unified_diff(
                old.splitlines(), new.splitlines(), page, "generated", lineterm=""
            )
            print("\n".join(diff))
        else:
            path.write_text(new)
    if check and stale:
        print(
            f"docgen: {', '.join(stale)} differ from the code; run scripts/dev.sh docs",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
