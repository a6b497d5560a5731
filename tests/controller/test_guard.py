"""The guard's pure parts: the nesting bound and the bearer comparison."""

from __future__ import annotations

import json

import pytest

from controller.http.guard import bearer_ok, json_too_deep


@pytest.mark.parametrize(
    ("body", "limit", "deep"),
    [
        (b'{"a": [1, 2, {"b": []}]}', 4, False),
        (b'{"a": [1, 2, {"b": []}]}', 3, True),
        (b"[" * 5 + b"]" * 5, 5, False),
        (b"[" * 6 + b"]" * 6, 5, True),
        (b"[]" * 100_000, 1, False),  # wide is fine, only deep counts
        (b'{"p": "' + b"[" * 1000 + b'"}', 2, False),  # brackets in a string are text
        (b'{"p": "\\"[[[[[[\\""}', 2, False),  # escaped quotes do not end the string
        (b"[" * 200_000, 64, True),  # unbalanced: the parser would recurse through all of it
        (b"}" * 100, 64, True),  # closes what was never open: not JSON (the contract's 400)
        (b'{"a": "[[[', 64, True),  # a string that never ends
        (b"no json at all", 1, False),
    ],
)
def test_json_too_deep(body: bytes, limit: int, deep: bool) -> None:
    assert json_too_deep(body, limit) is deep


def test_what_passes_the_bound_parses_without_recursing_too_deep() -> None:
    body = b"[" * 64 + b"]" * 64
    assert not json_too_deep(body, 64)
    assert json.loads(body) is not None


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        ("Bearer tok", True),
        ("bearer tok", True),
        ("  Bearer   tok  ", True),
        ("Bearer to", False),
        ("Basic tok", False),
        ("tok", False),
        (None, False),
        ("Bearer tøk", False),  # non-ASCII: no TypeError, just a mismatch
    ],
)
def test_bearer_ok(header: str | None, ok: bool) -> None:
    assert bearer_ok(header, b"tok") is ok
