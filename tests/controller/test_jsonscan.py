"""The body scanner (controller.http.jsonscan) against a plain byte-by-byte reference, over
adversarial inputs: the same verdict whatever the input and however it is cut into pieces,
in at most two steps per byte, whether the structure below the top-level members is stepped
through or counted in bulk."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.http import jsonscan
from controller.http.jsonscan import JsonScan, scan

WANTED = frozenset({"model", "stream"})
LIMIT = 8


@pytest.fixture(autouse=True, scope="module", params=["steps", "bulk"])
def counting(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test twice: as the scanner runs (bulk counting only after many short steps
    in a piece, which small inputs seldom take) and with the bulk counting everything
    below the top-level members from the first step."""
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "bulk":
            mp.setattr(jsonscan, "BULK_AFTER", 1)
            mp.setattr(jsonscan, "BULK_BYTES", 1 << 30)
            mp.setattr(jsonscan, "BULK_KEEP", 0)  # never back to the steps
        yield request.param


def reference(body: bytes, limit: int) -> tuple[bool, bool, bool]:
    """(too deep, balanced, one object at the top): the obvious scan, one byte at a time."""
    depth = deepest = 0
    in_string = escaped = broken = False
    first: int | None = None
    closed_at: int | None = None
    junk = False
    for i, byte in enumerate(body):
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:
                escaped = True
            elif byte == 0x22:
                in_string = False
            continue
        if first is None and byte not in b" \t\n\r":
            first = byte
        elif closed_at is not None and byte not in b" \t\n\r":
            junk = True
        if byte == 0x22:
            in_string = True
        elif byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                return True, False, False
        elif byte in b"]}":
            depth -= 1
            if depth < 0:
                broken, depth = True, 0
            elif depth == 0 and closed_at is None:
                closed_at = i
    balanced = not broken and not in_string and depth == 0
    is_object = balanced and first == ord("{") and not junk
    return deepest > limit, balanced, is_object


def pieces_of(body: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(body)) for c in cuts})
    out, last = [], 0
    for p in points:
        out.append(body[last:p])
        last = p
    out.append(body[last:])
    return out


def scanned(body: bytes, cuts: list[int], limit: int = LIMIT) -> tuple[JsonScan, Any]:
    scanner = JsonScan(limit, WANTED)
    for piece in pieces_of(body, cuts):
        scanner.feed(piece)
    return scanner, scanner.result()


# Bytes an adversary would pick: the structural ones, escapes, blanks, a few letters.
_ALPHABET = st.sampled_from([*b'[]{}",:\\ \nab1', 0xFF])
adversarial = st.lists(_ALPHABET, max_size=300).map(bytes)
# And real JSON, nested, with keys and strings that hold structure and escapes.
_SCALARS = st.none() | st.booleans() | st.integers() | st.text(alphabet='ab"\\[]{}:,\n')
_JSON = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["model", "stream", "a", 'm"', "[", "\\"]), inner)
    ),
    max_leaves=25,
)
cuts = st.lists(st.integers(min_value=0, max_value=400), max_size=6)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=adversarial, cut=cuts)
def test_any_bytes_cut_anywhere_get_the_reference_verdict_in_linear_steps(
    body: bytes, cut: list[int]
) -> None:
    scanner, shape = scanned(body, cut)
    deep, balanced, is_object = reference(body, LIMIT)
    assert (shape.depth > LIMIT) is deep
    if not deep:
        assert shape.balanced is balanced
        assert shape.is_object is is_object
    assert scanner.steps <= 2 * len(body) + 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=_JSON, cut=cuts, extra=st.dictionaries(st.sampled_from(["model", "stream"]), _JSON))
def test_real_json_yields_the_fields_a_parser_sees(
    value: Any, cut: list[int], extra: dict[str, Any]
) -> None:
    top = {"x": value, **extra} if isinstance(value, dict) else {"v": value, **extra}
    body = json.dumps(top, indent=1 if len(cut) % 2 else None).encode()
    _, shape = scanned(body, cut, limit=64)
    assert shape.balanced
    assert shape.is_object
    assert set(shape.fields) == set(extra)
    for key, (start, end) in shape.fields.items():
        assert json.loads(body[start:end]) == top[key]


@pytest.mark.parametrize(
    "body",
    [
        b"[]" * 100_000,
        b"[1]" * 60_000,
        b'{"p": ' + (b"[[]" * 40 + b"]" * 40 + b",") * 2_000 + b"1}",
    ],
    ids=["top-level empty lists", "top-level one-item lists", "chains in a member"],
)
@pytest.mark.parametrize("slices", [False, True], ids=["whole", "8 KiB slices"])
def test_the_bulk_counts_read_a_constant_times_the_body(
    counting: str, body: bytes, slices: bool
) -> None:
    """Whatever stops the bulk count at once (a closer back to the top level within a few
    bytes) sends the scan back to its steps for a while, and a count reads a window, not
    the rest of the piece: a body of many top-level values once read the rest of its piece
    at every step (200 KB scanned whole: minutes of CPU)."""
    if counting == "bulk":
        pytest.skip("the production constants only (the bulk mode counts from every step)")
    cuts = list(range(8192, len(body), 8192)) if slices else []
    scanner, shape = scanned(body, cuts, limit=64)
    assert shape.balanced
    assert scanner.steps <= 2 * len(body) + 1
    assert scanner.bulk_read <= 16 * len(body)


def test_the_last_of_a_repeated_key_wins_and_escaped_keys_count() -> None:
    body = b'{"model": "a", "x": {"model": "in"}, "mod\\u0065l": "b"}'
    shape = scan(body, 8, WANTED)
    start, end = shape.fields["model"]
    assert json.loads(body[start:end]) == "b"
    assert json.loads(body)["model"] == "b"  # what a parser (and so the engine) sees


def test_an_escape_cut_between_pieces_is_kept() -> None:
    body = b'{"model": "a\\"b"}'
    for cut in range(len(body) + 1):
        _, shape = scanned(body, [cut])
        start, end = shape.fields["model"]
        assert json.loads(body[start:end]) == 'a"b', cut


_KEYS = st.sampled_from(
    [
        '"model"',
        '"mod\\u0065l"',
        '"\\u006Dodel"',
        '"MODEL"',
        '"model "',
        '"stream"',
        '"a"',
        '"m\\n"',
    ]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    members=st.lists(st.tuples(_KEYS, _JSON), max_size=8),
    cut=cuts,
    blank=st.sampled_from(["", " ", "\n  "]),
)
def test_keys_spelled_any_way_match_what_a_parser_reads(
    members: list[tuple[str, Any]], cut: list[int], blank: str
) -> None:
    """Repeated keys, keys with escapes that spell a wanted one, and ones that nearly do."""
    text = "{" + ",".join(f"{blank}{k}{blank}:{blank}{json.dumps(v)}" for k, v in members) + "}"
    body = text.encode()
    parsed = json.loads(body)
    _, shape = scanned(body, cut, limit=64)
    assert shape.is_object
    assert set(shape.fields) == set(parsed) & WANTED
    for key, (start, end) in shape.fields.items():
        assert json.loads(body[start:end]) == parsed[key]
