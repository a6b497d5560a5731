"""One pass over a JSON body, fed piece by piece: how deep it nests, whether it is one
well-bracketed object, and where the top-level members the gateway routes on are.

The classic streaming depth scanner (a depth counter that knows when it is inside a string
and when a byte is escaped), resumable between pieces so a body is scanned as it arrives and
a caller can yield between slices. Each step of the loop finds the next byte that matters
with a compiled pattern (C speed over the bytes in between), so the work is linear in the
body: `steps` counts the loop's iterations, never more than twice the bytes fed plus one.

Nothing is parsed: the gateway decodes only the values it needs (`model`, `stream`), from
the spans found here; the engine parses and validates the whole body itself. Regular
expressions only skip runs of bytes (no alternation that could backtrack).
"""

from __future__ import annotations

import json
import re
from array import array
from dataclasses import dataclass, field
from itertools import accumulate

# Inside a string: everything up to its closing quote, escapes included; stops early only
# at a backslash that ends the piece (its escaped byte is in the next one).
_STRING_BODY = re.compile(rb'[^"\\]*+(?:\\.[^"\\]*+)*+', re.DOTALL)
_DEEP = re.compile(rb'"|[\[{]++|[\]}]++')  # below the top-level members: runs of one kind
_TOP = re.compile(rb'["\[\]{},:]')  # at the top level: the members' separators too
_NOT_BLANK = re.compile(rb"[^ \t\n\r]")


_STRING = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'  # a whole string, escapes included
_FILLER = rb'[^"\[\]{}]*+(?:' + _STRING + rb'[^"\[\]{}]*+)*+'  # bytes and whole strings
_BLANKS = rb"[ \t\n\r]*+"


def _items(levels: int) -> bytes:
    """Whole items: bytes that are not structure, closed strings, groups that close within
    `levels` levels. Possessive throughout: a group deeper than `levels`, or that does not
    close in the piece, is given up after at most `levels` levels of it were read, so a
    byte is read at most `levels + 1` times."""
    pattern = _FILLER
    for _ in range(levels):
        pattern = _FILLER + rb"(?:[\[{]" + pattern + rb"[\]}]" + _FILLER + rb")*+"
    return pattern


def _key_of(name: str) -> bytes:
    """A string that decodes to `name`, written plainly or with `\\u` escapes (exactly the
    ways JSON can spell an ASCII key)."""
    chars = []
    for c in name:
        code = "".join(f"[{d.lower()}{d.upper()}]" if d.isalpha() else d for d in f"{ord(c):04x}")
        chars.append(rb"(?:" + re.escape(c.encode()) + rb"|\\u" + code.encode() + rb")")
    return rb'"' + b"".join(chars) + rb'"'


def _members(wanted: tuple[str, ...], levels: int) -> re.Pattern[bytes]:
    """A run of whole top-level members, each with its comma, whose value is a scalar, a
    string or a group that closes within `levels` levels. A wanted key's value is captured
    (group `f<i>`: the last one in the run, as a parser keeps the last)."""
    value = rb'(?:[^"\[\]{},:\s]++|' + _STRING + rb"|[\[{]" + _items(levels) + rb"[\]}])"
    colon = _BLANKS + rb":" + _BLANKS
    keys = [_key_of(name) for name in wanted]
    other = b"".join(rb"(?!" + key + rb")" for key in keys) + _STRING + colon + value
    named = [key + colon + b"(?P<f%d>" % i + value + rb")" for i, key in enumerate(keys)]
    member = _BLANKS + rb"(?:" + rb"|".join([*named, other]) + rb")" + _BLANKS + rb","
    return re.compile(rb"(?:" + member + rb")*+", re.DOTALL)


SHALLOW = 4  # the nesting skipped in one step below the top-level members
_SHALLOW = [re.compile(_items(k), re.DOTALL) for k in range(SHALLOW + 1)]
MEMBER_LEVELS = 62  # at most this nesting of a member's value is skipped with it
_MEMBER_RUNS: dict[tuple[tuple[str, ...], int], re.Pattern[bytes]] = {}


def member_run(wanted: frozenset[str], limit: int) -> re.Pattern[bytes]:
    """The compiled member run for a scan (compiled once per process and kept: a caller
    builds it at start-up, so no request pays for it)."""
    key = (tuple(sorted(wanted)), min(MEMBER_LEVELS, max(limit - 2, 0)))
    if key not in _MEMBER_RUNS:
        _MEMBER_RUNS[key] = _members(*key)
    return _MEMBER_RUNS[key]


_KEY_MAX = 64  # a longer key is none of the wanted ones: its bytes are not kept

# Below the top-level members, when BULK_AFTER steps in a row within one piece went less
# than BULK_BYTES bytes each on average, the rest of the piece is counted in bulk (`_bulk`):
# a step costs a microsecond or two of Python, and a body made of short changes of direction
# (`[[]`, `[1,`, `["",` chains, side-by-side groups) takes one per level or per change. The
# bulk counts the piece's structure at C speed but costs about 20 ns a byte, so steps that
# go far (long runs, shallow items skipped whole) stay steps.
BULK_AFTER = 32
BULK_BYTES = 48
# One bulk count reads at most BULK_WINDOW bytes, and one that went less than BULK_KEEP
# (a closer back to the top level within a few bytes: `[][]...`, `[1][1]...` at the top)
# sends the scan back to the steps until another BULK_AFTER of them went short: the bulk's
# reads stay within a constant of the bytes fed, whatever the shape (an unbounded count
# that stops at once, tried at every step, read the rest of the piece each time).
BULK_WINDOW = 512
BULK_KEEP = 48
_WHOLE_STRINGS = re.compile(b"(" + _STRING + b")", re.DOTALL)  # split around each whole string
_LEVEL = bytes(1 if b in b"[{" else 255 if b in b"]}" else 0 for b in range(256))  # as int8

_QUOTE, _BACKSLASH = 0x22, 0x5C
_OPEN = frozenset(b"[{")
_CLOSE = frozenset(b"]}")


@dataclass
class Shape:
    """What a scan found. `fields`: the wanted top-level keys' value spans in the body
    (start, end), blanks included at the end; the last of a repeated key wins, as in a
    parser."""

    depth: int  # the deepest nesting seen (stops growing one past the limit)
    balanced: bool  # every string and bracket closed, none closed that was not open
    is_object: bool  # one object at the top level, nothing but blanks after it
    fields: dict[str, tuple[int, int]] = field(default_factory=dict)


class JsonScan:
    """Feed a body's bytes in order (`feed`), then `result()`. Past `limit` levels it stops
    scanning: the verdict is known. `wanted`: the top-level keys whose value spans to keep."""

    def __init__(self, limit: int, wanted: frozenset[str] = frozenset()) -> None:
        self.limit = limit
        self.wanted = wanted
        self.steps = 0
        self.bulk_read = 0  # bytes the bulk counts read (a constant times the bytes fed at most)
        self.offset = 0  # bytes fed so far
        self.depth = 0
        self.max_depth = 0
        self.balanced = True
        self.in_string = False
        self.escaped = False  # the previous piece ended on a backslash inside a string
        self.started = False  # the first non-blank byte was seen
        self.is_object = True
        self.closed_top = False  # the top-level value ended: only blanks may follow
        self.fields: dict[str, tuple[int, int]] = {}
        self._expect_key = False  # inside the top object, before a member's key
        self._key: bytearray | None = None  # a top-level key being read (None: not one)
        self._member: str | None = None  # the wanted key whose value comes next
        self._value_at: int | None = None  # where that value started
        self._await_value = False  # after a top-level colon: the value's first byte is next
        self._member_run = member_run(wanted, limit)
        self._wanted = sorted(wanted)

    @property
    def over(self) -> bool:
        return self.max_depth > self.limit

    def feed(self, data: bytes | memoryview) -> None:
        pos, end = 0, len(data)
        deep_steps, deep_from, bulk = 0, 0, False  # within this piece
        while pos < end and not self.over:
            self.steps += 1
            if self.in_string:
                pos = self._string(data, pos)
            elif not self.started or self._await_value or self.closed_top:
                pos = self._first_byte(data, pos)
            elif self.depth > 1 or (self.depth == 1 and not self.is_object):
                if deep_steps % BULK_AFTER == 0:  # every BULK_AFTER steps: how far they went
                    short = deep_steps > 0 and pos - deep_from < BULK_AFTER * BULK_BYTES
                    bulk, deep_from = bulk or short, pos
                deep_steps += 1
                went = self._bulk(data, pos) if bulk else pos
                if bulk and went - pos < BULK_KEEP:
                    bulk, deep_steps = False, 0
                pos = went if went > pos else self._deep(data, pos)
            else:
                if self._expect_key and self.depth == 1:
                    skipped = self._skip_members(data, pos)
                    if skipped > pos:
                        pos = skipped
                        continue
                found = _TOP.search(data, pos)
                if found is None:
                    break
                pos = found.end()
                self._structural(data[pos - 1], self.offset + pos - 1)
        self.offset += end

    def _deep(self, data: bytes | memoryview, pos: int) -> int:
        """Below the top-level members: whole shallow items in one step (C speed), then the
        run of openers or of closers where they stop, as one step."""
        levels = min(SHALLOW, self.limit - self.depth)
        pos = _SHALLOW[levels].match(data, pos).end()  # type: ignore[union-attr]  # matches ""
        found = _DEEP.match(data, pos)
        if found is None:
            return len(data)
        run = found.end() - found.start()
        byte = data[found.start()]
        if byte == _QUOTE:
            self.in_string = True
        elif byte in _OPEN:
            self.depth += run
            self.max_depth = max(self.max_depth, self.depth)
        elif run < self.depth:
            self.depth -= run
        elif self.depth > 1:  # back at the top level: the closers past it one by one
            consumed, self.depth = self.depth - 1, 1
            return found.start() + consumed
        else:
            self._structural(byte, self.offset + found.start())
            return found.start() + 1
        return found.end()

    def _bulk(self, data: bytes | memoryview, pos: int) -> int:
        """Below the top-level members: the piece (BULK_WINDOW bytes of it at most) at C
        speed, up to the first
        closer that would take the depth back to the top level's (which the steps then
        take), a string that does not close in the piece (its quote: the steps read it) or
        past the limit. Whole strings are blanked out (a split around each), every byte
        becomes its change of depth (+1, -1, 0), and the running depth is one accumulate:
        a few C-level passes over the piece, whatever its shape."""
        piece = bytes(data[pos : pos + BULK_WINDOW])
        self.bulk_read += len(piece)
        if b'"' in piece:
            parts = _WHOLE_STRINGS.split(piece)
            parts[1::2] = map(bytes, map(len, parts[1::2]))  # a string: as many zero bytes
            piece = b"".join(parts)
            unclosed = piece.find(b'"')  # only a string that does not close is left
            if unclosed >= 0:
                piece = piece[:unclosed]
        if not piece:
            return pos
        base = 1 if self.is_object else 0  # the depth of the top level's members
        running = list(accumulate(array("b", piece.translate(_LEVEL)), initial=self.depth))
        try:
            stop = running.index(base, 1) - 1  # the closer back to the top level
        except ValueError:
            stop = len(piece)
        if stop == 0:
            return pos
        deepest = max(running[1 : stop + 1])
        self.depth = running[stop]
        if deepest > self.max_depth:
            self.max_depth = deepest
        return pos + stop

    def result(self) -> Shape:
        balanced = self.balanced and not self.in_string and self.depth == 0
        return Shape(
            depth=self.max_depth,
            balanced=balanced,
            is_object=balanced and self.is_object and self.started,
            fields=dict(self.fields),
        )

    # ---- the steps ---------------------------------------------------------------------------

    def _string(self, data: bytes | memoryview, pos: int) -> int:
        start = pos
        if self.escaped:
            self.escaped = False
            pos += 1  # the escaped byte, whatever it is
        stop = _STRING_BODY.match(data, pos).end()  # type: ignore[union-attr]  # always matches
        if stop == len(data):
            self._keep(data, start, stop)
            return stop
        if data[stop] == _BACKSLASH:  # the piece ends on an escape: finish it next time
            self._keep(data, start, stop + 1)
            self.escaped = True
            return stop + 1
        self._keep(data, start, stop)
        self.in_string = False
        if self._key is not None:
            self._end_key(bytes(self._key))
        return stop + 1

    def _first_byte(self, data: bytes | memoryview, pos: int) -> int:
        """Skip blanks to the next byte; it opens the top value, a member's value, or (after
        the top value) is junk."""
        found = _NOT_BLANK.search(data, pos)
        if found is None:
            return len(data)
        pos = found.start()
        if self.closed_top:
            self.is_object = False  # something after the top-level value
            self.closed_top = False  # scan it on for its depth
        elif not self.started:
            self.started = True
            self.is_object = data[pos] == ord("{")
        else:
            self._await_value = False
            if self._member is not None:
                self._value_at = self.offset + pos
        return pos  # not consumed: the next step reads it

    def _structural(self, byte: int, at: int) -> None:
        if byte == _QUOTE:
            self.in_string = True
            if self._expect_key and self.depth == 1:
                self._key = bytearray()
                self._expect_key = False
        elif byte in _OPEN:
            self.depth += 1
            self.max_depth = max(self.max_depth, self.depth)
            self._expect_key = self.depth == 1 and self.is_object
        elif byte in _CLOSE:
            if self.depth == 1:
                self._end_value(at)
            self.depth -= 1
            if self.depth < 0:
                self.balanced = False
                self.depth = 0
            elif self.depth == 0:
                self.closed_top = True
        elif self.depth == 1:  # a top-level `,` or `:`
            if byte == ord(":"):
                self._await_value = True
            else:
                self._end_value(at)
                self._expect_key = self.is_object

    # ---- the top-level members ---------------------------------------------------------------

    def _skip_members(self, data: bytes | memoryview, pos: int) -> int:
        """Whole members in one step (C speed), keeping the wanted keys' value spans."""
        run = self._member_run.match(data, pos)
        assert run is not None  # it matches the empty run
        for i, name in enumerate(self._wanted):
            start, end = run.span(f"f{i}")
            if start >= 0:
                self.fields[name] = (self.offset + start, self.offset + end)
        return run.end()

    def _keep(self, data: bytes | memoryview, start: int, stop: int) -> None:
        if self._key is None:
            return
        if len(self._key) + stop - start > _KEY_MAX:
            self._key = None  # too long to be a wanted key: stop keeping its bytes
            self._member = None
            return
        self._key += data[start:stop]

    def _end_key(self, raw: bytes) -> None:
        self._key = None
        key: object = raw.decode("latin-1")
        if b"\\" in raw:  # an escaped key: decode it as a parser would
            try:
                key = json.loads(b'"' + raw + b'"')
            except ValueError:
                key = None
        self._member = key if isinstance(key, str) and key in self.wanted else None
        self._value_at = None

    def _end_value(self, at: int) -> None:
        if self._member is not None and self._value_at is not None:
            self.fields[self._member] = (self._value_at, at)
        self._member = None
        self._value_at = None


def scan(body: bytes, limit: int, wanted: frozenset[str] = frozenset()) -> Shape:
    """The whole body at once (tests, and bodies small enough not to slice)."""
    scanner = JsonScan(limit, wanted)
    scanner.feed(body)
    return scanner.result()


def json_too_deep(body: bytes, limit: int) -> bool:
    """True when `body` nests deeper than `limit`, or its strings or brackets do not close
    (then it is not JSON, and a parser would go down every open level)."""
    shape = scan(body, limit)
    return shape.depth > limit or not shape.balanced
