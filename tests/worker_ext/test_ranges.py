"""Range arithmetic (worker_ext.ranges): records minus restored ranges, pure, no engine."""

from __future__ import annotations

import itertools
import random

import pytest

from worker_ext import ranges as R


def _bytes(rs: list[R.Range]) -> set[int]:
    return {b for s, e in rs for b in range(s, e)}


def test_merge_joins_overlapping_and_touching_and_drops_empty() -> None:
    assert R.merge([]) == []
    assert R.merge([(5, 5)]) == []
    assert R.merge([(10, 20), (0, 5), (5, 8), (15, 30), (40, 41)]) == [(0, 8), (10, 30), (40, 41)]
    assert R.merge([(0, 100), (10, 20)]) == [(0, 100)]


def test_bad_ranges_are_refused() -> None:
    with pytest.raises(ValueError, match="not a range"):
        R.merge([(10, 5)])
    with pytest.raises(ValueError, match="not a range"):
        R.protect([(-1, 4)], [])


def test_whole_and_empty_pools() -> None:
    recs = [(0x1000, 0x3000), (0x5000, 0x6000)]
    assert R.protect(recs, []) == recs  # nothing restored: every byte protected
    assert R.protect(recs, recs) == []  # everything restored: nothing to copy
    assert R.protect(recs, [(0, 1 << 40)]) == []
    assert R.protect([], [(0, 10)]) == []  # an empty pool
    assert R.protect([(0x1000, 0x1000)], []) == []  # an empty record


def test_restored_ranges_cut_records_exactly() -> None:
    rec = [(0x1000, 0x2000)]
    # a KV tensor in the middle, a parameter at the start, one touching the end
    restored = [(0x1400, 0x1800), (0x1000, 0x1100), (0x1F00, 0x2000)]
    assert R.protect(rec, restored) == [(0x1100, 0x1400), (0x1800, 0x1F00)]
    # overlapping restored ranges, and one reaching past the record
    assert R.protect(rec, [(0x1200, 0x1600), (0x1500, 0x1900), (0x1E00, 0x9000)]) == [
        (0x1000, 0x1200),
        (0x1900, 0x1E00),
    ]


def test_protected_ranges_never_span_two_records() -> None:
    recs = [(0, 100), (100, 200)]  # adjacent in the address space, two allocations
    assert R.protect(recs, [(50, 60)]) == [(0, 50), (60, 100), (100, 200)]
    assert R.subtract(recs, [(50, 60)]) == [(0, 50), (60, 200)]  # subtract merges


def test_unaligned_edges_stay_exact_and_align_cuts_inward() -> None:
    # a bf16 parameter of odd length leaves a gap that starts on 2 bytes
    got = R.protect([(0x1000, 0x1200)], [(0x1000, 0x1006)])
    assert got == [(0x1006, 0x1200)]
    assert R.align(got, 8) == [(0x1008, 0x1200)]
    assert R.align([(3, 7)], 8) == []
    assert R.align([(0, 16), (17, 40)], 8) == [(0, 16), (24, 40)]
    with pytest.raises(ValueError, match="power of two"):
        R.align([(0, 8)], 6)


def test_random_against_a_byte_set() -> None:
    rnd = random.Random(7)
    for _ in range(300):
        recs, pos = [], 0
        for _ in range(rnd.randint(0, 5)):
            pos += rnd.randint(0, 20)
            size = rnd.randint(0, 40)
            recs.append((pos, pos + size))
            pos += size
        holes = []
        for _ in range(rnd.randint(0, 8)):
            s = rnd.randint(0, pos + 10)
            holes.append((s, s + rnd.randint(0, 30)))
        got = R.protect(recs, holes)
        assert _bytes(got) == _bytes(recs) - _bytes(holes)
        assert got == sorted(got)
        assert all(e > s for s, e in got)
        for s, e in got:  # inside one record each
            assert any(rs <= s and e <= re for rs, re in recs)
        assert R.total(got) == len(_bytes(got))
        sub = R.subtract(recs, holes)
        assert _bytes(sub) == _bytes(got)
        assert all(a[1] < b[0] for a, b in itertools.pairwise(sub))  # disjoint, merged


def test_left_over_starts_on_words_and_covers_every_byte_left() -> None:
    """What a disk tier's key digests: the records less the holes, from word boundaries."""
    recs = [(0x1000, 0x1100), (0x2000, 0x2040)]
    holes = [(0x1000, 0x1013), (0x1080, 0x1085), (0x2000, 0x2040)]
    # left (0x1013, 0x1080) and (0x1085, 0x1100): from words, they touch and join
    assert R.left_over(recs, holes, 8) == [(0x1010, 0x1100)]
    assert R.left_over(recs, [], 8) == recs
    with pytest.raises(ValueError, match="power of two"):
        R.left_over(recs, holes, 12)
    rnd = random.Random(11)
    for _ in range(300):
        recs = sorted({(8 * a, 8 * a + rnd.randint(1, 60)) for a in range(0, 40, 5)})
        holes = []
        for _ in range(rnd.randint(0, 6)):
            start = rnd.randint(0, 330)
            holes.append((start, start + rnd.randint(0, 25)))
        got = R.left_over(recs, holes, 8)
        assert all(s % 8 == 0 for s, _ in got)
        assert _bytes(R.subtract(recs, holes)) <= _bytes(got) <= _bytes(recs)
        assert all(a[1] < b[0] for a, b in itertools.pairwise(got))


def test_nearest_named_range_and_owner() -> None:
    named = R.Named.of([(100, 200, "a"), (300, 400, "b"), (1000, 1100, "c"), (5, 5, "empty")])
    assert named.nearest((200, 250)) == ("a", 0)  # touching a
    assert named.nearest((260, 290)) == ("b", 10)
    assert named.nearest((0, 50)) == ("a", 50)
    assert named.nearest((2000, 2100)) == ("c", 900)
    assert named.nearest((350, 360)) == ("b", 0)
    assert R.Named.of([]).nearest((0, 1)) is None
    recs = [(0, 100, "weights"), (200, 300, "kv_cache")]
    assert R.owner(recs, 50) == "weights"
    assert R.owner(recs, 100) is None
    assert R.owner(recs, 299) == "kv_cache"
    assert R.owner(recs, 300) is None
