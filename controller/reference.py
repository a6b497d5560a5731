"""The sidecar's part of docs/settings.md, generated from the settings objects themselves.

`python -m controller.reference` prints it: one table per section of `Settings` (the key in
the models file, its `HOTSWAP_` variable, default, range and description, all read from the
pydantic fields), one for a models-file entry (`ModelSettings`), and the `hotswap serve`
flags with the variable each stands for (read from the CLI's parser). scripts/docgen.py
puts it between the page's markers; a test fails when the page and this disagree, so a
setting cannot be added, renamed or re-described without the page following.
"""

from __future__ import annotations

import argparse
import enum
import inspect
import re
import sys
import types
import typing
from collections.abc import Iterable, Iterator
from typing import Any

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from controller.cli import build_parser
from controller.config.modelsettings import ModelSettings
from controller.config.settings import Settings

PREFIX = "HOTSWAP_"
# A flag's help names its variable: "... (env: HOTSWAP_X; default ...)".
_ENV_IN_HELP = re.compile(r"\s*\(env: (HOTSWAP_[A-Z0-9_]+)([^)]*)\)")


def _cell(text: str) -> str:
    """One Markdown table cell: no newline, no unescaped pipe."""
    return " ".join(text.split()).replace("|", "\\|")


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "(required)"
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return "(section)"
        return "empty" if not value else f"`{value!r}`"
    value = field.default
    if value is None:
        return "none"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, int) and value >= 1 << 16 and value % 1024 == 0:
        return (
            f"`{value}` ({value >> 10} KiB)"
            if value < 1 << 20
            else f"`{value}` ({value >> 20} MiB)"
        )
    return f"`{value}`"


def _choices(annotation: Any) -> list[str]:
    """The values a Literal or an enum (also inside `X | None`) allows."""
    if typing.get_origin(annotation) is typing.Literal:
        return [str(a) for a in typing.get_args(annotation)]
    if inspect.isclass(annotation) and issubclass(annotation, enum.Enum):
        return [str(m.value) for m in annotation]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        for arg in typing.get_args(annotation):
            found = _choices(arg)
            if found:
                return found
    return []


def _range(field: FieldInfo) -> str:
    parts = []
    for meta in field.metadata:
        if isinstance(meta, annotated_types.Ge):
            parts.append(f">= {meta.ge}")
        elif isinstance(meta, annotated_types.Gt):
            parts.append(f"> {meta.gt}")
        elif isinstance(meta, annotated_types.Le):
            parts.append(f"<= {meta.le}")
        elif isinstance(meta, annotated_types.Lt):
            parts.append(f"< {meta.lt}")
        elif isinstance(meta, annotated_types.MinLen):
            parts.append(f"at least {meta.min_length}")
    choices = _choices(field.annotation)
    if choices:
        parts.append(" or ".join(f"`{c}`" for c in choices))
    return ", ".join(parts)


def _section(annotation: Any) -> type[BaseModel] | None:
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _rows(fields: Iterable[tuple[str, FieldInfo]], key: str, env: str | None) -> Iterator[str]:
    for name, field in fields:
        variable = f"`{env}{name.upper()}`" if env is not None else ""
        yield (
            f"| `{key}{name}` | {variable} | {_default(field)} | {_cell(_range(field))} "
            f"| {_cell(field.description or '')} |"
        )


def _table(fields: Iterable[tuple[str, FieldInfo]], key: str, env: str | None) -> list[str]:
    """One row per field: `key` prefixes its name, `env` its variable (None: no variable)."""
    head = "| setting | variable | default | range | what it does |"
    return [head, "| --- | --- | --- | --- | --- |", *_rows(fields, key, env)]


def _doc(model: type[BaseModel]) -> str:
    """The class's own docstring (never pydantic's, which a class without one inherits)."""
    return " ".join((model.__dict__.get("__doc__") or "").split())


def _flags(parser: argparse.ArgumentParser, command: str) -> list[str]:
    """A subcommand's flags and the variable each stands for (from its help text)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    lines = ["| flag | variable | what it does |", "| --- | --- | --- |"]
    for action in sub.choices[command]._actions:
        if not action.option_strings or not action.help or "-h" in action.option_strings:
            continue
        found = _ENV_IN_HELP.search(action.help)
        variable = f"`{found.group(1)}`{found.group(2)}" if found else ""
        text = _ENV_IN_HELP.sub("", action.help)
        lines.append(
            f"| `{', '.join(action.option_strings)}` | {_cell(variable)} | {_cell(text)} |"
        )
    return lines


def markdown() -> str:
    """The sidecar's settings section of docs/settings.md."""
    out: list[str] = []
    scalars = [
        (name, field)
        for name, field in Settings.model_fields.items()
        if _section(field.annotation) is None and name != "models"
    ]
    out += ["### Top level", ""]
    out += _table(scalars, "", PREFIX)
    for name, field in Settings.model_fields.items():
        section = _section(field.annotation)
        if section is None:
            continue
        out += ["", f"### `{name}`", ""]
        if _doc(section):
            out += [_doc(section), ""]
        out += _table(section.model_fields.items(), f"{name}.", f"{PREFIX}{name.upper()}__")
    out += ["", "### A model (`models:` in the models file)", ""]
    out += [_doc(ModelSettings), "Set in the models file only, one entry per model.", ""]
    out += _table(ModelSettings.model_fields.items(), "", None)
    parser = build_parser()
    out += ["", "### `hotswap serve` flags", ""]
    out += ["A flag wins over its variable and the models file.", ""]
    out += _flags(parser, "serve")
    out += ["", "### `hotswap status`, `sleep` and `wake`: reaching the sidecar", ""]
    out += _flags(parser, "status")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    del argv
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
