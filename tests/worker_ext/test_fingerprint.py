"""worker_ext.fingerprint on CPU tensors (pure torch, no vLLM): what it must and need not see."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

import pytest
import torch

from worker_ext import fingerprint as fpmod
from worker_ext import fpkernel
from worker_ext.fingerprint import (
    PIECE_WORDS,
    Plan,
    fingerprint,
    fingerprints,
    storage_bytes,
)
from worker_ext.settings import WorkerSettings

ROW_WORDS = 512  # the tests' size unit: 4 KiB of words

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
]
# byte sizes below, at and above one row, with 1-7 byte tails
SHAPES = [(1,), (3,), (7, 5), (2, 3, 4), (131,), (ROW_WORDS * 2 + 3,), (3, ROW_WORDS + 1)]


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def _flip(t: torch.Tensor, byte: int, bit: int) -> None:
    raw = storage_bytes(t)
    raw[byte : byte + 1].bitwise_xor_(1 << bit)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_one_flipped_bit_anywhere_is_seen(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _rand(shape, dtype, 0)
    fp = fingerprint(t)
    assert fp == fingerprint(t.clone())  # equal bytes, equal fingerprint
    n = storage_bytes(t).numel()
    assert fp[0] == n
    # every byte up to 2 KiB; beyond, first, last, a row boundary, the tail and a spread
    probes = sorted({0, n - 1, min(n - 1, ROW_WORDS * 8), min(n - 1, ROW_WORDS * 8 - 1)})
    probes += list(range(0, n, 1 if n <= 2048 else n // 97))
    for byte in probes:
        for bit in (0, 3, 7):
            _flip(t, byte, bit)
            assert fingerprint(t) != fp, (byte, bit)
            _flip(t, byte, bit)
    assert fingerprint(t) == fp


def test_every_bit_of_a_small_tensor_is_seen() -> None:
    t = _rand((13,), torch.bfloat16, 3)  # 26 bytes: three int64 words and a 2-byte tail
    fp = fingerprint(t)
    for byte in range(26):
        for bit in range(8):
            _flip(t, byte, bit)
            assert fingerprint(t) != fp, (byte, bit)
            _flip(t, byte, bit)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swapped_elements_of_a_small_tensor_are_seen(dtype: torch.dtype) -> None:
    t = _rand((6, 7), dtype, 1)
    fp = fingerprint(t)
    flat = t.view(-1)
    n = flat.numel()
    for i, j in [(0, 1), (0, n - 1), (3, 17), (n - 2, n - 1)]:
        if flat[i] == flat[j]:
            continue
        s = t.clone()
        s.view(-1)[i], s.view(-1)[j] = flat[j].clone(), flat[i].clone()
        assert fingerprint(s) != fp, (i, j)


def test_swapped_rows_of_a_large_tensor_are_seen() -> None:
    t = _rand((5, ROW_WORDS * 2), torch.float32, 2)  # each tensor row = one 4 KiB row
    fp = fingerprint(t)
    s = t.clone()
    s[1], s[3] = t[3].clone(), t[1].clone()
    assert fingerprint(s) != fp
    words = t.clone().view(-1).view(torch.int64)
    words[0], words[5] = words[5].clone(), words[0].clone()  # a swap inside one 4 KiB row
    assert fingerprint(words) != fp  # the row sums that replaced NH were order-blind here


def _nh(values: list[int]) -> int:
    """NH of one piece with the process key, in Python integers (fpkernel's docstring)."""
    lo, mask = (1 << 32) - 1, (1 << 64) - 1
    key = [k & mask for k in fpkernel.process_key("cpu")[: len(values)].tolist()]
    out = 0
    for v, k in zip(values, key, strict=True):
        out += (((v & lo) + (k & lo)) & lo) * (((v >> 32) + (k >> 32)) & lo)
    return out & mask


def _reference(t: torch.Tensor) -> tuple[int, int, int]:
    """The module docstring's definition, in plain Python integers."""
    data = bytes(storage_bytes(t).tolist())
    n = len(data)
    nwords = n // 8 if t.untyped_storage().data_ptr() % 8 == 0 else 0
    words = [int.from_bytes(data[8 * i : 8 * i + 8], "little") for i in range(nwords)]
    rest = list(data[nwords * 8 :])
    pieces = [words[i : i + PIECE_WORDS] for i in range(0, nwords, PIECE_WORDS)]
    pieces += [rest[i : i + PIECE_WORDS] for i in range(0, len(rest), PIECE_WORDS)]
    blob = b"".join(_nh(p).to_bytes(8, "little") for p in pieces)
    s2 = int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little") if blob else 0
    return n, sum(words + rest) & ((1 << 64) - 1), s2


# float32 element counts: under a piece, whole pieces, pieces plus leftover words and a tail
@pytest.mark.parametrize(
    "numel", [1, 7, ROW_WORDS * 2 + 1, PIECE_WORDS * 2, PIECE_WORDS * 4 + 3, PIECE_WORDS * 2 + 1]
)
def test_values_follow_the_documented_pieces(numel: int) -> None:
    t = _rand((numel,), torch.float32, numel)
    assert fingerprint(t) == _reference(t)


def test_the_kernel_switch_is_a_worker_setting() -> None:
    for raw, mode in [("0", "off"), ("off", "off"), ("1", "on"), ("on", "on"), ("auto", "auto")]:
        assert WorkerSettings.from_env({"HOTSWAP_VERIFY_KERNEL": raw}).verify_kernel == mode
    assert WorkerSettings.from_env({}).verify_kernel == "auto"
    assert fpmod.DEFAULT_KERNEL == "auto"
    _, ts = _packed(SPECS)
    ref = Plan(ts).baseline()  # auto on CPU: the eager check, no kernel tried
    assert ref.check is None
    assert ref.spans


def test_a_swap_across_pieces_changes_the_value_as_documented() -> None:
    t = _rand((PIECE_WORDS * 4 + 3,), torch.float32, 2)  # 2 pieces, a leftover, a tail
    s = t.clone()
    s[100], s[PIECE_WORDS * 3] = t[PIECE_WORDS * 3].clone(), t[100].clone()  # pieces 0, 1
    assert fingerprint(s) == _reference(s)
    assert fingerprint(s)[1] == fingerprint(t)[1]  # s1 is order-blind
    assert fingerprint(s) != fingerprint(t)


def _keep_linear_sums(words: torch.Tensor, at: list[int], d: int = 1 << 40) -> None:
    """+d, -2d, +d at three words: their sum and every position-weighted sum with equal
    steps between them stay the same (a second difference), what the old sums missed."""
    for i, step in zip(at, (d, -2 * d, d), strict=True):
        words[i] += step


@pytest.mark.parametrize("at", [[5, 6, 7], [5, ROW_WORDS + 5, 2 * ROW_WORDS + 5]])
def test_a_change_that_keeps_linear_sums_is_seen(at: list[int]) -> None:
    """A crafted change of three values (in one 4 KiB row, or one word in each of three
    rows) kept both linear sums, and the row sums, of the fingerprint this replaced; the
    keyed NH sees it (docs/contracts.md §1.4)."""
    t = _rand((ROW_WORDS * 8,), torch.float32, 3)
    fp = fingerprint(t)
    s = t.clone()
    _keep_linear_sums(s.view(torch.int64), at)
    assert fingerprint(s)[1] == fp[1]  # the plain sum cannot see it
    assert fingerprint(s) != fp
    plan = Plan([t], kernel="off")
    base = plan.baseline()
    _keep_linear_sums(t.view(torch.int64), at)
    assert plan.changed(base) == [0]


def test_values_are_keyed_by_the_process_key(monkeypatch: pytest.MonkeyPatch) -> None:
    t = _rand((ROW_WORDS * 3 + 1,), torch.float32, 4)
    fp = fingerprint(t)
    other = {"cpu": torch.randint(-(2**62), 2**62, (fpkernel.KEY_WORDS,), dtype=torch.int64)}
    monkeypatch.setattr(fpkernel, "_KEY", other)
    keyed = fingerprint(t)
    assert keyed[:2] == fp[:2]
    assert keyed[2] != fp[2]


def test_views_and_non_contiguous_tensors_cover_the_whole_storage() -> None:
    base = _rand((64, 33), torch.bfloat16, 4)
    view = base[3:9, ::2]  # offset and strided
    assert not view.is_contiguous()
    assert fingerprint(view) == fingerprint(base)
    before = fingerprint(view)
    base[60, 32] += 1  # outside the view, inside its storage
    assert fingerprint(view) != before
    assert fingerprint(view) == fingerprint(base)


def test_batch_equals_one_by_one_and_keeps_order() -> None:
    ts = [_rand(s, d, i) for i, (s, d) in enumerate(zip(SHAPES, DTYPES * 2, strict=False))]
    ts.append(torch.empty(0))
    batch = fingerprints(ts)
    assert batch == [fingerprint(t) for t in ts]
    assert batch[-1] == (0, 0, 0)
    shared = ts[2].view(-1)[1:]  # same storage as ts[2]: computed once, answered twice
    assert fingerprints([ts[2], shared, ts[0]]) == [batch[2], batch[2], batch[0]]


def test_identical_bytes_in_different_tensors_give_identical_fingerprints() -> None:
    a = _rand((ROW_WORDS + 7,), torch.float32, 5)
    b = a.clone().view(torch.int32)  # same bytes, another dtype
    assert fingerprint(a) == fingerprint(b)
    c = a.clone()
    c[0] = -c[0]
    assert fingerprint(a) != fingerprint(c)


def test_a_plan_sees_changes_to_its_storages_and_rebuilt_layouts_agree() -> None:
    ts = [_rand((ROW_WORDS * 3 + 5,), torch.bfloat16, 6), _rand((9,), torch.int8, 7)]
    plan = Plan(ts)
    first = plan.run()
    assert len(plan) == 2
    fpmod._LAYOUTS.clear()  # a fresh layout gives the same values
    assert plan.run() == first
    ts[0][100] += 1
    now = plan.run()
    assert now[0] != first[0]
    assert now[1] == first[1]


def test_unaligned_storage_is_fingerprinted_byte_by_byte() -> None:
    data = bytearray(range(41))
    t = torch.frombuffer(data, dtype=torch.uint8, offset=1)
    if t.untyped_storage().data_ptr() % 8 == 0:
        pytest.skip("frombuffer gave an aligned storage here")
    fp = fingerprint(t)
    assert fp == fingerprint(t)
    for byte in (0, 17, 39):
        _flip(t, byte, 2)
        assert fingerprint(t) != fp, byte
        _flip(t, byte, 2)
    assert fingerprint(t) == fp


# -- spans: byte-adjacent storages checked as one, mismatches named per tensor ----------
# Each span test runs with the eager check and, in a child pytest with Triton's CPU
# interpreter on from the start (test_kernel_cases_under_the_triton_interpreter; Triton
# decides at import), with the Triton kernel the GPU runs, in small pieces so one span has
# several.

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_interp = pytest.mark.skipif(not INTERP, reason="run in a child with TRITON_INTERPRET=1")


@pytest.fixture(params=["eager", "kernel"] if INTERP else ["eager"])
def check(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    mode = str(request.param)
    if mode == "kernel":
        monkeypatch.setattr(fpmod, "DEFAULT_KERNEL", "on")
        monkeypatch.setattr(fpkernel, "PIECE_WORDS", 64)  # 512 B pieces
        monkeypatch.setattr(fpkernel, "BLOCK", 16)
    else:
        monkeypatch.setattr(fpmod, "DEFAULT_KERNEL", "off")
    return mode


@pytest.fixture(autouse=True)
def _no_kept_checks() -> object:
    """Each test builds its own kernel checks: the CPU allocator hands an earlier test's
    addresses to the next one, and a kept check would skip the cross-check some tests watch."""
    fpmod.forget_checks()
    yield
    fpmod.forget_checks()


def _baseline(plan: Plan, mode: str) -> fpmod.Baseline:
    ref = plan.baseline()
    assert (ref.check is not None) == (mode == "kernel"), plan.kernel_error
    return ref


def _packed(
    specs: list[tuple[int, torch.dtype]], gap: int = 0, seed: int = 11
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Tensors with their own storages packed into one buffer (as the caching allocator
    packs weights), `gap` bytes of other memory between neighbours."""
    sizes = [n * torch.empty(0, dtype=d).element_size() for n, d in specs]
    base = torch.randint(0, 256, (sum(sizes) + gap * len(sizes),), dtype=torch.uint8)
    arr = base.numpy()
    out, off = [], 0
    for (n, d), size in zip(specs, sizes, strict=True):
        out.append(torch.frombuffer(arr, dtype=d, count=n, offset=off))
        off += size + gap
    g = torch.Generator().manual_seed(seed)
    for t in out:
        t.view(torch.uint8).copy_(
            torch.randint(0, 256, (t.numel() * t.element_size(),), generator=g)
        )
    return base, out


SPECS = [
    (ROW_WORDS * 8, torch.bfloat16),  # 8 KiB
    (64, torch.float32),
    (ROW_WORDS * 3 + 4, torch.float32),
    (8, torch.int64),
    (ROW_WORDS * 4 * 2, torch.int8),
]


def test_adjacent_storages_form_one_span_and_a_flip_names_its_tensor(check: str) -> None:
    _base, ts = _packed(SPECS)
    assert len({t.untyped_storage().data_ptr() for t in ts}) == len(ts)  # own storages
    plan = Plan(ts)
    assert (plan.n_storages, plan.n_spans) == (len(ts), 1)
    ref = _baseline(plan, check)
    # the per-tensor values are unchanged; the kernel holds its own, per piece
    want = fingerprints(ts) if check == "eager" else [None] * len(ts)
    assert plan.per_tensor(ref) == want
    assert plan.changed(ref) == []
    for k, t in enumerate(ts):
        n = storage_bytes(t).numel()
        for byte in sorted({0, n // 2, n - 1}):
            _flip(t, byte, 5)
            assert plan.changed(ref) == [k], (k, byte)
            _flip(t, byte, 5)
    assert plan.changed(ref) == []
    _flip(ts[0], 3, 1)
    _flip(ts[3], 60, 0)
    assert plan.changed(ref) == [0, 3]


def test_a_span_sees_swapped_neighbours(check: str) -> None:
    _, ts = _packed([(ROW_WORDS * 2, torch.float32), (ROW_WORDS * 2, torch.float32)])
    plan = Plan(ts)
    assert plan.n_spans == 1
    ref = _baseline(plan, check)
    a, b = ts[0].clone(), ts[1].clone()
    ts[0].copy_(b)
    ts[1].copy_(a)  # the same bytes, the two tensors' halves swapped
    assert plan.changed(ref) == [0, 1]


def test_gaps_between_storages_are_never_read(check: str) -> None:
    base, ts = _packed(SPECS, gap=8)
    plan = Plan(ts)
    assert plan.n_spans == len(ts)  # not adjacent: no span crosses allocator free space
    ref = _baseline(plan, check)
    end = storage_bytes(ts[0]).numel()
    base[end : end + 8].bitwise_not_()  # the gap after the first tensor
    base[-8:].bitwise_not_()  # the gap after the last
    assert plan.changed(ref) == []
    _flip(ts[2], 7, 7)
    assert plan.changed(ref) == [2]


def test_spans_the_kernel_does_not_read_are_checked_eagerly(check: str) -> None:
    _, ts = _packed(SPECS[:2])
    lone = _rand((ROW_WORDS + 3,), torch.float32, 13)
    tensors = [ts[0], torch.empty(0), ts[1], lone]
    plan = Plan(tensors)
    ref = _baseline(plan, check)
    if check == "kernel":
        assert len(ref.covered) == 3  # the packed pair's storages and the lone tensor's
        assert ref.rest is not None
        assert len(ref.rest) == 1  # the empty storage: nothing for the kernel to read
    assert plan.changed(ref) == []
    lone[0] += 1
    assert plan.changed(ref) == [3]


def test_a_span_that_differs_while_its_storages_agree_names_all_of_them() -> None:
    _, ts = _packed(SPECS[:3])
    plan = Plan(ts, kernel="off")
    ref = plan.baseline()
    spans = list(ref.spans)
    spans[0] = (spans[0][0], spans[0][1] ^ 1, spans[0][2])
    assert plan.changed(fpmod.Baseline(spans, ref.storages)) == [0, 1, 2]  # never silent


def test_shared_storages_and_mixed_spans_name_every_tensor_on_them(check: str) -> None:
    _, ts = _packed(SPECS[:2])
    lone = _rand((ROW_WORDS + 3,), torch.float32, 12)
    tensors = [ts[0], lone, ts[1], ts[0].view(-1)[5:], lone[1:]]
    plan = Plan(tensors)
    assert (plan.n_storages, plan.n_spans) == (3, 2)
    ref = _baseline(plan, check)
    if check == "eager":
        assert plan.per_tensor(ref) == fingerprints(tensors)
    else:  # the kernel holds them, per piece on the device
        assert plan.per_tensor(ref) == [None] * len(tensors)
    _flip(ts[0], 0, 0)
    assert plan.changed(ref) == [0, 3]
    _flip(ts[0], 0, 0)
    lone[0] += 1
    assert plan.changed(ref) == [1, 4]


def test_the_kernels_baseline_reads_what_it_covers_once(
    check: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No per-storage eager pass beside the kernel's: under a fused sleep's copies that pass
    over every byte was most of the prepare. A flipped element is still named alone."""
    _, ts = _packed(SPECS)
    lone = _rand((ROW_WORDS + 3,), torch.float32, 14)
    tensors = [*ts, lone]
    plan = Plan(tensors)
    read: list[int] = []
    eager = fpmod._run_items
    monkeypatch.setattr(
        fpmod, "_run_items", lambda items: read.append(sum(i.nbytes for i in items)) or eager(items)
    )
    ref = _baseline(plan, check)
    total = sum(storage_bytes(t).numel() for t in tensors)
    assert sum(read) == (0 if check == "kernel" else 2 * total), read
    _flip(ts[2], 11, 4)
    assert plan.changed(ref) == [2]


def test_a_later_plan_over_the_same_ranges_reuses_the_check_and_reads_the_bytes_again(
    check: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel check is built and proven once for a set of ranges; a later plan over the
    same ranges (the next sleep's prepare) reuses it without the cross-check, but takes its
    own values: a write between the two baselines is the new baseline, not a mismatch, and
    the earlier baseline still sees it."""
    _, ts = _packed(SPECS)
    proven: list[int] = []
    ref_fn = fpkernel._reference
    monkeypatch.setattr(
        fpkernel, "_reference", lambda ptr, n, dev: proven.append(ptr) or ref_fn(ptr, n, dev)
    )
    first = Plan(ts)
    ref1 = _baseline(first, check)
    assert first.kernel_reused is False
    assert bool(proven) == (check == "kernel")
    proven.clear()
    _flip(ts[1], 2, 6)  # written while awake, between two prepares
    second = Plan(ts)
    ref2 = _baseline(second, check)
    assert second.kernel_reused == (check == "kernel")
    assert proven == []  # no cross-check the second time
    if check == "kernel":
        assert ref2.check is ref1.check
        assert ref2.values is not ref1.values
    assert second.changed(ref2) == []  # the new bytes are the new baseline
    assert first.changed(ref1) == [1]  # the earlier baseline kept its own values
    _flip(ts[3], 5, 0)
    assert second.changed(ref2) == [3]
    assert first.changed(ref1) == [1, 3]
    # other ranges (one storage fewer): built and proven anew
    third = Plan(ts[:-1])
    _baseline(third, check)
    assert third.kernel_reused is False
    assert bool(proven) == (check == "kernel")


def test_no_coalescing_when_asked(check: str) -> None:
    _, ts = _packed(SPECS)
    plan = Plan(ts, coalesce=False)
    assert plan.n_spans == len(ts)
    ref = _baseline(plan, check)
    _flip(ts[4], 9, 3)
    assert plan.changed(ref) == [4]


def test_snapshot_verify_names_one_changed_element_in_packed_weights(check: str) -> None:
    from worker_ext import ownership, snapshot

    _, ts = _packed(SPECS[:4])
    model = torch.nn.Module()
    for i, t in enumerate(ts):
        model.register_parameter(f"p{i}", torch.nn.Parameter(t, requires_grad=False))
    recs = ownership.walk(model, None)
    snap = snapshot.prepare(1, recs, set(), pin=False)
    assert snap.plan is not None
    assert snap.plan.n_spans == 1
    assert snap.baseline is not None
    assert (snap.baseline.check is not None) == (check == "kernel")
    assert snapshot.verify(snap) == (4, [], [])
    model.p2.data.view(torch.int32).view(-1)[ROW_WORDS] ^= 1  # one element of one weight
    assert snapshot.verify(snap) == (4, ["p2"], [])


def test_the_next_prepare_reuses_the_check_and_fingerprints_what_was_written_awake(
    check: str,
) -> None:
    """Two sleeps' prepares over the same weights: the second reuses the first's kernel
    check (`snap_check_reused`) but its baseline is the bytes as they are then, so a write
    made while awake between the two is neither lost nor a false mismatch."""
    from worker_ext import ownership, snapshot

    _, ts = _packed(SPECS[:4])
    model = torch.nn.Module()
    for i, t in enumerate(ts):
        model.register_parameter(f"p{i}", torch.nn.Parameter(t, requires_grad=False))
    steps: dict[str, float] = {}
    snap = snapshot.prepare(1, ownership.walk(model, None), set(), pin=False, steps=steps)
    assert steps["snap_check_reused"] == 0.0
    assert snapshot.verify(snap) == (4, [], [])
    del snap  # the wake verified: its snapshot goes
    model.p1.data.view(torch.int32).view(-1)[3] ^= 1 << 7  # written while awake
    steps = {}
    snap = snapshot.prepare(1, ownership.walk(model, None), set(), pin=False, steps=steps)
    assert steps["snap_check_reused"] == (1.0 if check == "kernel" else 0.0)
    assert snapshot.verify(snap) == (4, [], [])
    model.p3.data.view(torch.int32).view(-1)[0] ^= 1  # lost in the sleep
    assert snapshot.verify(snap) == (4, ["p3"], [])


def _waits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The kernel check's waits and launches, in order."""
    seen: list[str] = []
    sync, run = fpkernel.SpanCheck._sync, fpkernel.SpanCheck._run

    def _sync(self: fpkernel.SpanCheck, device_wide: bool) -> None:
        seen.append("device-wide wait" if device_wide else "stream wait")
        sync(self, device_wide)

    def _run(self: fpkernel.SpanCheck) -> tuple[object, object]:
        seen.append("run")
        return run(self)

    monkeypatch.setattr(fpkernel.SpanCheck, "_sync", _sync)
    monkeypatch.setattr(fpkernel.SpanCheck, "_run", _run)
    return seen


@needs_interp
def test_a_reused_kernel_checks_baseline_and_every_verify_run_after_a_device_wide_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The 8B swap's mismatch (issue 31): the reused check's baseline was one launch with
    no wait before it. Every baseline, reused or not, starts after a wait for the current
    stream (where the proven check's cross-check made one; not device-wide: a fused sleep's
    copies run on), and every verify read after a wait for the whole device."""
    monkeypatch.setattr(fpmod, "DEFAULT_KERNEL", "on")
    monkeypatch.setattr(fpkernel, "PIECE_WORDS", 64)
    monkeypatch.setattr(fpkernel, "BLOCK", 16)
    _, ts = _packed(SPECS)
    Plan(ts).baseline()  # built and proven
    seen = _waits(monkeypatch)
    plan = Plan(ts)
    ref = plan.baseline()
    assert plan.kernel_reused
    assert seen == ["stream wait", "run"]
    seen.clear()
    assert plan.changed(ref) == []
    assert seen == ["device-wide wait", "run"]


@needs_interp
def test_a_kernel_difference_gone_after_a_device_wide_wait_is_not_a_mismatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bytes still being written when verify's kernel first reads them (a missing wait)
    differ at that read; the check reads them again after a device-wide wait and names
    only what still differs, with the evidence in `kernel_recheck`. A real change is still
    named, with its pieces and torch's sums of the first one."""
    monkeypatch.setattr(fpmod, "DEFAULT_KERNEL", "on")
    monkeypatch.setattr(fpkernel, "PIECE_WORDS", 64)
    monkeypatch.setattr(fpkernel, "BLOCK", 16)
    _, ts = _packed(SPECS)
    plan = Plan(ts)
    ref = plan.baseline()
    assert ref.check is not None
    _flip(ts[2], 40, 3)  # a write not yet landed ...
    waits = {"n": 0}
    sync = fpkernel.SpanCheck._sync

    def _sync(self: fpkernel.SpanCheck, device_wide: bool) -> None:
        waits["n"] += 1
        if waits["n"] == 2:  # ... lands during the wait before the second read
            _flip(ts[2], 40, 3)
        sync(self, device_wide)

    monkeypatch.setattr(fpkernel.SpanCheck, "_sync", _sync)
    assert plan.changed(ref) == []
    seen = plan.kernel_recheck
    assert seen is not None
    assert seen["first_read"] == [2]
    assert seen["second_read"] == []
    assert seen["pieces_differing"] == 1
    assert seen["pieces_differing_again"] == 0
    waits["n"] = 10  # no more landing writes: a real change
    _flip(ts[4], 7, 0)
    assert plan.changed(ref) == [4]
    seen = plan.kernel_recheck
    assert seen is not None
    assert seen["first_read"] == seen["second_read"] == [4]
    k, n = seen["pieces_by_range"][4]
    assert (k, n) == (1, storage_bytes(ts[4]).numel() // (64 * 8))
    assert seen["piece_kernel_now"] == seen["piece_torch_now"]  # the kernel reads the bytes
    assert seen["piece_baseline"] != seen["piece_kernel_now"]
    _flip(ts[4], 7, 0)
    assert plan.changed(ref) == []
    assert plan.kernel_recheck is None


@needs_interp
def test_snapshot_verify_names_a_kernel_mismatch_and_its_recheck(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker_ext import ownership, snapshot

    monkeypatch.setattr(fpmod, "DEFAULT_KERNEL", "on")
    monkeypatch.setattr(fpkernel, "PIECE_WORDS", 64)
    monkeypatch.setattr(fpkernel, "BLOCK", 16)
    _, ts = _packed(SPECS[:4])
    model = torch.nn.Module()
    for i, t in enumerate(ts):
        model.register_parameter(f"p{i}", torch.nn.Parameter(t, requires_grad=False))
    snap = snapshot.prepare(1, ownership.walk(model, None), set(), pin=False)
    assert snapshot.verify(snap) == (4, [], [])
    assert snapshot.recheck(snap) is None
    model.p2.data.view(torch.int32).view(-1)[ROW_WORDS] ^= 1
    assert snapshot.verify(snap) == (4, ["p2"], [])
    seen = snapshot.recheck(snap)
    assert seen is not None
    assert seen["first_read"] == seen["second_read"] == ["p2"]
    assert seen["pieces_by_range"]["p2"][0] == 1
    # the differing piece's address and baseline, for a look at the host copy after it
    [(addr, n, s1, s2)] = snapshot.differing_pieces(snap)
    raw = storage_bytes(model.p2)
    assert int(raw.data_ptr()) <= addr
    assert addr + n <= int(raw.data_ptr()) + raw.numel()
    assert n == 64 * 8
    from worker_ext.rawmem import raw_bytes

    now = raw_bytes(addr, n, raw.device)
    assert fpkernel.piece_sums(now) != (s1, s2)
    model.p2.data.view(torch.int32).view(-1)[ROW_WORDS] ^= 1  # the baseline's bytes again
    assert fpkernel.piece_sums(now) == (s1, s2)
    assert snapshot.verify(snap) == (4, [], [])
    assert snapshot.differing_pieces(snap) == []


# -- the kernel itself (Triton's CPU interpreter) ---------------------------------------


def test_kernel_cases_under_the_triton_interpreter() -> None:
    """The [kernel] span cases and the kernel tests below, in a child pytest."""
    if INTERP:
        pytest.skip("this is the child")
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        __file__,
        "-k",
        "kernel and not interpreter and not hopper",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    m = re.search(r"(\d+) passed", done.stdout)
    assert m is not None, tail
    assert int(m.group(1)) >= 23, tail  # 10 span cases + 13 kernel cases, none skipped
    assert "skipped" not in done.stdout.splitlines()[-1], tail


@pytest.fixture
def interp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fpkernel, "PIECE_WORDS", 40)
    monkeypatch.setattr(fpkernel, "BLOCK", 16)


def _piece_ref(words: list[int]) -> tuple[int, int]:
    """(s1, NH) as fpkernel's docstring defines them, in Python integers."""
    mask, lo = (1 << 64) - 1, (1 << 32) - 1
    key = [k & mask for k in fpkernel.process_key("cpu")[: len(words)].tolist()]
    nh = 0
    for w, k in zip((w & mask for w in words), key, strict=True):
        nh += (((w & lo) + (k & lo)) & lo) * (((w >> 32) + (k >> 32)) & lo)
    return sum(words) & mask, nh & mask


@pytest.mark.parametrize("nbytes", [8, 16 * 8, 40 * 8, 40 * 8 + 8, 40 * 8 * 3 + 5, 3])
@needs_interp
def test_kernel_piece_sums_follow_the_definition(interp: None, nbytes: int) -> None:
    buf = torch.randint(-(2**62), 2**62, ((nbytes + 7) // 8,), dtype=torch.int64)
    ptr = int(buf.data_ptr())
    check = fpkernel.SpanCheck([(ptr, nbytes)], torch.device("cpu"))
    words = buf.tolist()[: nbytes // 8]
    want = [_piece_ref(words[i : i + 40]) for i in range(0, len(words), 40)]
    assert check.sums() == want
    assert check.n_pieces == len(want)
    check.baseline()
    assert check.differing() == []


@needs_interp
def test_kernel_sees_a_swap_inside_a_piece_and_names_the_range(interp: None) -> None:
    a = torch.randint(-(2**62), 2**62, (100,), dtype=torch.int64)
    b = torch.randint(-(2**62), 2**62, (30,), dtype=torch.int64)
    check = fpkernel.SpanCheck(
        [(int(a.data_ptr()), 800), (int(b.data_ptr()), 30 * 8 - 3)], torch.device("cpu")
    )
    check.baseline()
    a[3], a[9] = a[9].clone(), a[3].clone()  # same words, order changed, one piece
    assert check.differing() == [0]
    a[3], a[9] = a[9].clone(), a[3].clone()
    assert check.differing() == []
    b.view(torch.uint8)[30 * 8 - 4] ^= 1  # the last byte of range 1's 5-byte tail
    assert check.differing() == [1]
    b.view(torch.uint8)[30 * 8 - 4] ^= 1
    b.view(torch.uint8)[30 * 8 - 3] ^= 1  # past the range: never read
    assert check.differing() == []


@needs_interp
def test_kernel_sees_a_change_that_keeps_linear_sums(interp: None) -> None:
    """+d, -2d, +d at three words of one piece: s1 and the old position-weighted sum stay,
    NH does not."""
    a = torch.randint(-(2**62), 2**62, (100,), dtype=torch.int64)
    check = fpkernel.SpanCheck([(int(a.data_ptr()), 800)], torch.device("cpu"))
    check.baseline()
    before = check.sums()
    _keep_linear_sums(a, [3, 4, 5])
    after = check.sums()
    assert after[0][0] == before[0][0]  # s1 kept
    assert check.differing() == [0]


@needs_interp
def test_kernel_refuses_what_it_cannot_check(interp: None, monkeypatch: pytest.MonkeyPatch) -> None:
    buf = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(fpkernel.Unavailable, match="aligned"):
        fpkernel.SpanCheck([(int(buf.data_ptr()) + 1, 16)], torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(fpkernel.Unavailable, match="interpreter"):
        fpkernel.SpanCheck([(int(buf.data_ptr()), 16)], torch.device("cpu"))


@needs_interp
def test_a_kernel_that_disagrees_with_torch_is_not_trusted(
    interp: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fpmod, "DEFAULT_KERNEL", "on")
    monkeypatch.setattr(fpkernel, "_reference", lambda ptr, n, dev: (1, 2))
    _, ts = _packed(SPECS)
    plan = Plan(ts)
    ref = plan.baseline()
    assert ref.check is None  # fell back to the eager check, and says why
    assert plan.kernel_error is not None
    assert "torch" in plan.kernel_error
    _flip(ts[1], 0, 0)
    assert plan.changed(ref) == [1]


def test_the_kernel_compiles_for_a_hopper_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's compiler (no GPU needed) accepts the kernel for sm_90, in both variants:
    catches what the CPU interpreter does not check (globals, annotations, types)."""
    if INTERP:
        pytest.skip("compiles for a GPU: not under the interpreter")
    triton = pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # integer kernel; silences 3.9's notice
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this Triton has no ahead-of-time compile API")
    fpkernel._kernel()  # binds triton.language for the kernel
    fn = triton.jit(fpkernel._piece_sums)
    sig = {"ptrs": "*i64", "nwords": "*i32", "key": "*i64", "out": "*i64", "BLOCK": "constexpr"}
    sig["ALIGNED"] = "constexpr"
    for aligned in (True, False):
        src = ASTSource(
            fn=fn, signature=sig, constexprs={"BLOCK": fpkernel.BLOCK, "ALIGNED": aligned}
        )
        try:
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        except (ImportError, FileNotFoundError, RuntimeError) as e:
            if "ptxas" in str(e) or "backend" in str(e).lower():
                pytest.skip(f"no CUDA toolchain in this Triton: {e}")
            raise
        ptx = k.asm["ptx"]
        assert ("ld.global.v2.b64" in ptx) == aligned  # wide loads exactly when aligned
