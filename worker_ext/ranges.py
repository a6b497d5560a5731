"""Byte-range arithmetic over a pool's allocation records (pure: no torch, no vLLM).

A range is a half-open `(start, end)` pair of addresses. The pools hand over their records
(one per allocation, never overlapping each other); the object walk hands over the ranges
the level's own mechanism brings back (the KV cache, whose bytes need not come back; at
level 2 the parameters the reload refills) and the ranges of every named tensor. From
those:

- `protect`: every byte of a record outside the restored ranges, cut per record (a copy
  never spans two records, which the driver may map apart) and merged where ranges touch;
- `subtract`: the same for any list (the named tensors taken out of what is protected
  leaves the unnamed ranges, fingerprinted as ranges);
- `nearest`: the named range closest to an address, for reports.

Inputs may overlap, touch, come unsorted or be empty; outputs are sorted, disjoint and
never empty ranges. `align` cuts each output range's start up and end down to a multiple
(bytes outside that cut stay with the neighbour that owns them): used only where a caller
needs word-aligned bodies; the protection itself is exact to the byte.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Range = tuple[int, int]


def _valid(ranges: Iterable[Range]) -> list[Range]:
    out = []
    for start, end in ranges:
        if start < 0 or end < start:
            raise ValueError(f"not a range: ({start:#x}, {end:#x})")
        if end > start:
            out.append((int(start), int(end)))
    return out


def merge(ranges: Iterable[Range]) -> list[Range]:
    """The union, sorted, with overlapping and touching ranges joined."""
    out: list[Range] = []
    for start, end in sorted(_valid(ranges)):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def subtract(ranges: Iterable[Range], holes: Iterable[Range]) -> list[Range]:
    """Every byte of `ranges` (merged) that no range of `holes` covers."""
    cut = merge(holes)
    starts = [s for s, _ in cut]
    out: list[Range] = []
    for start, end in merge(ranges):
        pos = start
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        while pos < end and i < len(cut):
            hs, he = cut[i]
            if he <= pos:
                i += 1
                continue
            if hs >= end:
                break
            if hs > pos:
                out.append((pos, hs))
            pos = max(pos, he)
            i += 1
        if pos < end:
            out.append((pos, end))
    return out


def protect(records: Iterable[Range], restored: Iterable[Range]) -> list[Range]:
    """Per record, its bytes outside `restored`; a result never spans two records."""
    holes = merge(restored)
    out: list[Range] = []
    for rec in sorted(_valid(records)):
        out.extend(subtract([rec], holes))
    return out


def left_over(ranges: Iterable[Range], holes: Iterable[Range], word: int) -> list[Range]:
    """`subtract`, each result's start moved down to a multiple of `word` (a power of two)
    and the results merged: for a kernel that reads from word boundaries. A start inside
    a word takes that word's first bytes too; when `ranges` start on words, they stay
    inside them."""
    if word <= 0 or word & (word - 1):
        raise ValueError(f"word must be a power of two, got {word}")
    return merge((start - start % word, end) for start, end in subtract(ranges, holes))


def total(ranges: Iterable[Range]) -> int:
    return sum(end - start for start, end in ranges)


def align(ranges: Iterable[Range], to: int) -> list[Range]:
    """Each range shrunk to multiples of `to` (a power of two); ranges left empty drop."""
    if to <= 0 or to & (to - 1):
        raise ValueError(f"alignment must be a power of two, not {to}")
    out = []
    for start, end in _valid(ranges):
        s = (start + to - 1) & ~(to - 1)
        e = end & ~(to - 1)
        if e > s:
            out.append((s, e))
    return out


@dataclass(frozen=True)
class Named:
    """Named ranges, sorted by start, for `nearest`."""

    starts: tuple[int, ...]
    ends: tuple[int, ...]
    names: tuple[str, ...]

    @classmethod
    def of(cls, items: Iterable[tuple[int, int, str]]) -> Named:
        rows = sorted((s, e, n) for s, e, n in items if e > s)
        return cls(tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows))

    def nearest(self, rng: Range) -> tuple[str, int] | None:
        """(name, distance in bytes) of the named range closest to `rng` (0: touching or
        overlapping it); None when there is none."""
        if not self.names:
            return None
        start, end = rng
        i = bisect.bisect_right(self.starts, start) - 1
        best: tuple[int, str] | None = None
        for j in (i - 1, i, i + 1, i + 2):
            if 0 <= j < len(self.names):
                s, e = self.starts[j], self.ends[j]
                gap = max(s - end, start - e, 0)
                if best is None or gap < best[0]:
                    best = (gap, self.names[j])
        assert best is not None
        return best[1], best[0]


def owner(records: Sequence[tuple[int, int, str]], addr: int) -> str | None:
    """The tag of the record (start, end, tag), sorted by start, holding `addr`."""
    i = bisect.bisect_right([r[0] for r in records], addr) - 1
    if i >= 0 and records[i][0] <= addr < records[i][1]:
        return records[i][2]
    return None
