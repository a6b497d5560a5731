"""The host codec (worker_ext/codec.py): the torch reference round-trips any bytes, chooses
raw where coding does not pay, meets the ratio on trained-like weights; the Triton kernels
(under Triton's CPU interpreter, in a child) write the reference's bytes exactly."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker_ext import codec, devmodels

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_interp = pytest.mark.skipif(not INTERP, reason="run in a child with TRITON_INTERPRET=1")
SPECIAL = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001, 0x807F, 0x7F7F]


def _roundtrip(data: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    pieces = codec.encode(data)
    back = codec.decode(pieces)
    assert back.dtype == torch.uint8
    assert torch.equal(back, data), "decode(encode(x)) != x"
    return pieces


def _bf16_words(kind: str, n: int, seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        w = (torch.randn(n, generator=g) * scale).to(torch.bfloat16).view(torch.int16)
    elif kind == "special":
        idx = torch.randint(0, len(SPECIAL), (n,), generator=g)
        w = torch.tensor(SPECIAL, dtype=torch.int32)[idx].to(torch.int16)
    elif kind == "denormal":  # exponent 0, any mantissa, either sign
        w = (torch.randint(0, 0x80, (n,), generator=g) | (torch.randint(0, 2, (n,)) << 15)).to(
            torch.int16
        )
    elif kind == "constant":
        w = torch.full((n,), int(scale * 1000) % 65536 - 32768, dtype=torch.int16)
    else:  # random bits
        w = torch.randint(-32768, 32768, (n,), generator=g, dtype=torch.int32).to(torch.int16)
    return w.view(torch.uint8).clone()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=0, max_size=20000))
def test_any_bytes_roundtrip(raw: bytes) -> None:
    data = torch.tensor(list(raw), dtype=torch.uint8)
    _roundtrip(data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["normal", "special", "denormal", "constant", "bits"]),
    n=st.integers(min_value=1, max_value=3 * codec.BLOCK + 17),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
    scale=st.floats(min_value=1e-30, max_value=1e30),
    odd=st.booleans(),
)
def test_bf16_patterns_roundtrip(kind: str, n: int, seed: int, scale: float, odd: bool) -> None:
    data = _bf16_words(kind, n, seed, scale)
    if odd:
        data = torch.cat([data, torch.tensor([0xA5], dtype=torch.uint8)])
    _roundtrip(data)


@pytest.mark.parametrize("n_words", [codec.CHUNK_WORDS + 1, codec.CHUNK_WORDS * 2 - 7])
def test_chunk_boundaries_roundtrip(n_words: int) -> None:
    data = _bf16_words("normal", n_words, 3, 0.02)
    data.view(torch.int16)[::997] = 0x7FC0  # NaNs sprinkled across blocks and chunks
    pieces = _roundtrip(data)
    assert len(pieces) == 1


def test_every_exponent_distinct_is_kept_raw() -> None:
    """256 exponents equally often: no k pays, so the chunk is raw (k = 0), 2 bytes a word."""
    w = (torch.arange(8192, dtype=torch.int32) % 256) << 7
    data = w.to(torch.int16).view(torch.uint8)
    [(chunks, piece)] = _roundtrip(data)
    meta = piece[: codec.META_BYTES].view(torch.int32)
    assert chunks == 1
    assert int(meta[codec.K]) == 0
    assert int(piece.numel()) <= codec.header_bytes(1) + data.numel() + codec.PIECE_ALIGN


@pytest.mark.parametrize("k", codec.KS)
def test_exactly_the_table_then_one_escape(k: int) -> None:
    """2^k - 1 exponents fit the table with no exception; one more exponent escapes."""
    n = 4 * codec.BLOCK + 3
    base = torch.arange(n, dtype=torch.int32) % ((1 << k) - 1)
    data = ((base + 100) << 7).to(torch.int16).view(torch.uint8).clone()
    [(_, piece)] = _roundtrip(data)
    meta = piece[: codec.META_BYTES].view(torch.int32)
    assert int(meta[codec.NEXC]) == 0
    w = data.view(torch.int16)
    w[codec.BLOCK + 5] = 3 << 7  # an exponent the table lacks, in the second block
    w[-1] = 7 << 7  # and in the last, partial block
    [(_, piece)] = _roundtrip(data)
    meta = piece[: codec.META_BYTES].view(torch.int32)
    assert int(meta[codec.K]) >= k
    assert int(meta[codec.NEXC]) in (0, 2)


def test_noise_and_fp8_stay_raw_realistic_compresses() -> None:
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (codec.CHUNK_WORDS,), generator=g, dtype=torch.int32)
    fp8 = (torch.randn(codec.CHUNK_WORDS, generator=g) * 0.5).to(torch.float8_e4m3fn)
    for data in (noise.to(torch.uint8), fp8.view(torch.uint8)):
        [(_, piece)] = _roundtrip(data)
        assert int(piece[: codec.META_BYTES].view(torch.int32)[codec.K]) == 0
        assert piece.numel() <= data.numel() + codec.header_bytes(1) + codec.PIECE_ALIGN
    t = torch.empty(codec.CHUNK_WORDS, dtype=torch.bfloat16)
    devmodels.realistic_fill_(t, "mlp.down_proj", 5)
    [(_, piece)] = _roundtrip(t.view(torch.uint8))
    ratio = piece.numel() / (2 * t.numel())
    assert ratio <= 0.72, ratio


def test_select_is_deterministic_on_ties() -> None:
    hist = torch.zeros((1, 256), dtype=torch.int64)
    hist[0, [5, 9, 3]] = 13000  # three equal counts: the smaller exponent first
    hist[0, 200] = 1000
    meta, inv = codec.select(hist, torch.tensor([40000]))
    assert int(meta[0, codec.K]) == 2
    table = meta[0, 8:12].contiguous().view(torch.uint8)[:3].tolist()
    assert table == [3, 5, 9]
    assert int(inv[0, 200]) == 3  # the escape code
    assert int(meta[0, codec.NEXC]) == 1000


@settings(max_examples=200, deadline=None)
@given(
    k=st.sampled_from([0, *codec.KS]),
    n=st.integers(min_value=1, max_value=codec.CHUNK_WORDS),
    frac=st.floats(min_value=0.0, max_value=1.0),
)
def test_payload_sizes_is_payload_size_over_tensors(k: int, n: int, frac: float) -> None:
    n_exc = int(n * frac) if k else 0
    t = codec.payload_sizes(torch.tensor([k]), torch.tensor([n]), torch.tensor([n_exc]))
    assert tuple(t[0].tolist()) == codec.payload_size(k, n, n_exc)
    a = codec.payload_sizes(np.array([k]), np.array([n]), np.array([n_exc]))  # the tier's check
    assert isinstance(a, np.ndarray)
    assert tuple(a[0].tolist()) == codec.payload_size(k, n, n_exc)


# -- the Triton kernels, under the CPU interpreter (a child pytest) ----------------------
# The interpreter runs every program of a launch in Python, a chunk's CHUNK_BLOCKS of them
# whatever its length; so the cases below run on chunks of SMALL_CHUNK_BLOCKS blocks (the
# same kernels: they take the chunk's blocks as CHUNK // BLOCK; the same BLOCK, so several
# blocks a chunk, partial blocks, several chunks a piece and a range), and the warm proof,
# which the backend runs before it trusts the kernels, at the production geometry.

SMALL_CHUNK_BLOCKS = 8


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "CHUNK_BLOCKS", SMALL_CHUNK_BLOCKS)
    monkeypatch.setattr(codec, "CHUNK_WORDS", codec.BLOCK * SMALL_CHUNK_BLOCKS)


def test_codec_kernels_under_the_triton_interpreter() -> None:
    if INTERP:
        pytest.skip("this is the child")
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    cmd += ["-k", "kernel and not interpreter"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout, tail


@needs_interp
@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize(
    ("kind", "n_words"),
    [("normal", 2 * codec.BLOCK + 5), ("special", 777), ("bits", codec.BLOCK), ("mixed", 0)],
)
def test_kernel_matches_reference(kind: str, n_words: int) -> None:
    if kind == "mixed":  # a coded chunk, then a raw one: two chunks of one range
        data = torch.cat(
            [_bf16_words("normal", codec.CHUNK_WORDS, 1, 0.02), _bf16_words("bits", 301, 2, 1.0)]
        )
    else:
        data = _bf16_words(kind, n_words, 7, 0.03)
    gc = codec.GpuCodec("cpu", piece_chunks=4)
    plan = gc.plan([(int(data.data_ptr()), int(data.numel()))])
    ref = codec.encode(data, piece_chunks=4)
    assert len(plan.pieces) == len(ref) == 1
    piece = plan.pieces[0]
    slot = gc.slots()[0]
    slot.fill_(0xEE)
    gc._counts.fill_(-7)  # the per-piece scratch is made unzeroed: whatever was there
    gc._boff.fill_(0x5A5A5A5A)
    gc.encode_into(plan, piece, slot)
    assert piece.size == ref[0][1].numel()
    got = slot[: piece.size].clone()
    # the reference leaves alignment padding zero; the kernel does not write it
    meta = ref[0][1][: piece.n_chunks * codec.META_BYTES].view(torch.int32)
    written = torch.zeros(piece.size, dtype=torch.bool)
    written[: piece.n_chunks * codec.META_BYTES] = True
    for c in range(piece.n_chunks):
        row = meta.view(piece.n_chunks, codec.META_INTS)[c]
        k, off, n, nexc = (int(row[i]) for i in (codec.K, codec.OFF, codec.NWORDS, codec.NEXC))
        if k == 0:
            written[off : off + 2 * n] = True
            continue
        pk, bo, ex = (int(row[i]) for i in (codec.PACKED, codec.BOFF, codec.EXC))
        written[off : off + n] = True
        written[off + pk : off + pk + (n + 7) // 8 * k] = True
        written[off + bo : off + bo + 4 * ((n + codec.BLOCK - 1) // codec.BLOCK)] = True
        written[off + ex : off + ex + nexc] = True
    assert torch.equal(got[written], ref[0][1][written])
    for decoder in codec.DECODERS:  # each decode kernel gives back the same bytes
        gc.decoder = decoder
        dst = torch.full_like(data, 0xA5)
        gc.decode_to(got, piece.n_chunks, int(dst.data_ptr()), int(dst.numel()))
        assert torch.equal(dst, data), decoder


@needs_interp
@pytest.mark.usefixtures("small_chunks")
def test_plan_table_kernel_equals_the_ranges_plan() -> None:
    """The plan's one launch over a table of every chunk, laid out by tensor ops, gives
    the same rows, maps, pieces and host layout as one launch per range laid out piece by
    piece: several ranges, multi-chunk and odd-sized, two chunks a piece, an empty one."""
    datas = [
        _bf16_words("normal", 2 * codec.CHUNK_WORDS + 999, 3, 0.02),
        _bf16_words("bits", 5, 4, 1.0),
        torch.zeros(0, dtype=torch.uint8),
        _bf16_words("special", 3 * codec.CHUNK_WORDS + 1, 5, 1.0),
    ]
    ranges = [(int(d.data_ptr()), int(d.numel())) for d in datas]
    plans = {}
    for impl in ("table", "ranges"):
        gc = codec.GpuCodec("cpu", piece_chunks=2)
        gc.plan_impl = impl
        plans[impl] = gc.plan(ranges)
        assert gc.plan_impl == impl  # no fallback
    a, b = plans["table"], plans["ranges"]
    assert a.pieces == b.pieces
    assert (a.total, a.raw_total, a.by_k) == (b.total, b.raw_total, b.by_k)
    assert torch.equal(a.meta, b.meta)
    assert torch.equal(a.inv, b.inv)
    assert len(a.pieces) == 2 + 1 + 2
    assert all(p.host_off % codec.HOST_ALIGN == 0 for p in a.pieces)
    # and each piece is what the reference encoder makes of its bytes
    for p in a.pieces:
        d = datas[p.rng][p.dev_off : p.dev_off + p.raw_bytes]
        ref = codec.encode_piece(d)
        assert p.size == ref.numel()
        head = ref[: p.n_chunks * codec.META_BYTES].view(torch.int32).view(p.n_chunks, -1)
        rows = a.meta[p.first : p.first + p.n_chunks]
        assert torch.equal(rows[:, : codec.SIZE + 1], head[:, : codec.SIZE + 1])


def _encode_all(gc: codec.GpuCodec, plan: codec.Plan, guard: int = 4096) -> list[torch.Tensor]:
    """Each piece encoded into a slot full of 0xEE, checked untouched past the piece (and
    `guard` bytes of the slot further on); the pieces' bytes."""
    out = []
    slot = gc.slots()[0]
    for piece in plan.pieces:
        slot.fill_(0xEE)
        gc.encode_into(plan, piece, slot)
        tail = slot[piece.size : piece.size + guard]
        assert bool((tail == 0xEE).all()), "the encoder wrote past its piece"
        out.append(slot[: piece.size].clone())
    return out


def _decoded(gc: codec.GpuCodec, plan: codec.Plan, pieces: list[torch.Tensor]) -> torch.Tensor:
    (_ptr, n) = plan.ranges[0]
    dst = torch.full((n,), 0xA5, dtype=torch.uint8)
    for piece, got in zip(plan.pieces, pieces, strict=True):
        at = int(dst.data_ptr()) + piece.dev_off
        gc.decode_to(got, piece.n_chunks, at, piece.raw_bytes)
    return dst


def _change(data: torch.Tensor, how: str, seed: int) -> None:
    """Change `data` in place: "mantissa" (signs and mantissas only: every exponent kept),
    "fewer" (some words zeroed: exponents the table holds), "more" (a run of random bits:
    exponents the table does not hold, more escapes than laid out)."""
    g = torch.Generator().manual_seed(seed)
    w = data.view(torch.int16)
    n = int(w.numel())
    at = torch.randint(0, n, (max(1, n // 50),), generator=g)
    if how == "mantissa":
        flip = torch.randint(0, 0x80, (int(at.numel()),), generator=g, dtype=torch.int32)
        w[at] = (w[at].to(torch.int32) ^ flip ^ 0x8000).to(torch.int16)
    elif how == "fewer":  # each word set to its chunk's most common exponent
        c = at // codec.CHUNK_WORDS
        e = (codec._words(data) >> 7) & 0xFF
        modes = torch.stack(
            [torch.mode(e[j * codec.CHUNK_WORDS : (j + 1) * codec.CHUNK_WORDS]).values
             for j in range(int(c.max()) + 1)]
        )  # fmt: skip
        w[at] = (modes[c] << 7).to(torch.int16)
    else:
        start = int(torch.randint(0, max(1, n - 3000), (1,), generator=g))
        w[start : start + 3000] = torch.randint(
            -32768, 32768, (min(3000, n - start),), generator=g, dtype=torch.int32
        ).to(torch.int16)


@needs_interp
@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize(
    ("how", "seed"), [("same", 0), ("mantissa", 0), ("fewer", 0), ("more", 0), ("more", 1)]
)
def test_reused_plan_kernel_check_and_exact_bytes(how: str, seed: int) -> None:
    """A plan reused for bytes that changed since (the tuning's codec_plan_reuse): its check
    passes exactly when every chunk's escapes fit what it laid out, and then the reused
    plan's pieces decode to the bytes there now, bit for bit; where the check refuses it,
    the encoder still never writes past a piece. A stale plan never yields a wrong byte:
    either the check refuses it or its bytes are exact."""
    data = torch.cat(
        [
            _bf16_words("normal", codec.CHUNK_WORDS, 10 + seed, 0.02),
            _bf16_words("normal", 3 * codec.BLOCK + 7, 20 + seed, 0.05),
        ]
    )
    gc = codec.GpuCodec("cpu", piece_chunks=1)
    first = gc.plan([(int(data.data_ptr()), int(data.numel()))])
    first.keep_on_host()
    assert first.by_k.get(0, 0) == 0  # both chunks coded: escapes are laid out
    if how != "same":
        _change(data, how, seed)
    plan = gc.reuse(first)
    assert plan.ranges == first.ranges
    assert plan.pieces == first.pieces
    assert plan.pieces[0] is not first.pieces[0]
    refused = bool(gc.check(plan))
    fresh = gc.plan(plan.ranges)
    fits = bool((fresh.meta[:, codec.NEXC] <= 0).all()) or all(
        # the escapes the bytes have now, under the old maps, against the old layout
        int(n_now) <= int(n_laid)
        for n_now, n_laid in zip(_escapes(data, first), first.meta_h[:, codec.NEXC], strict=True)
    )
    assert refused == (not fits)
    if how in ("same", "mantissa", "fewer"):
        assert not refused, how
    if how == "more":
        assert refused
    pieces = _encode_all(gc, plan)
    if not refused:
        assert torch.equal(_decoded(gc, plan, pieces), data), how


def _escapes(data: torch.Tensor, plan: codec.Plan) -> list[int]:
    """Per chunk: the words whose exponent the plan's map of that chunk escapes (torch)."""
    words = codec._words(data)
    e = (words >> 7) & 0xFF
    out = []
    inv = plan.inv_h.to(torch.int64)
    for c in range(int(plan.meta_h.shape[0])):
        k = int(plan.meta_h[c, codec.K])
        part = e[c * codec.CHUNK_WORDS : (c + 1) * codec.CHUNK_WORDS]
        out.append(int((inv[c][part] == (1 << k) - 1).sum()) if k else 0)
    return out


@needs_interp
@pytest.mark.usefixtures("small_chunks")
def test_reuse_kernel_needs_the_kept_host_copies() -> None:
    """A plan whose maps were never kept on the host cannot be reused (the backend plans
    anew); keep_on_host makes it reusable, and its rows are the plan's own."""
    data = _bf16_words("normal", 2 * codec.BLOCK, 3, 0.02)
    gc = codec.GpuCodec("cpu", piece_chunks=1)
    plan = gc.plan([(int(data.data_ptr()), int(data.numel()))])
    assert plan.inv_h is None
    assert plan.meta_h is not None
    assert plan.tab_h is not None
    with pytest.raises(ValueError, match="host copies"):
        gc.reuse(plan)
    plan.keep_on_host()
    again = gc.reuse(plan)
    assert torch.equal(again.meta, plan.meta)
    assert torch.equal(again.inv, plan.inv)
    assert not bool(gc.check(again))


# -- the wake queue's order, with recording fakes for CUDA streams and events -------------


class _Ev:
    n = 0

    def __init__(self, log: list[str]) -> None:
        _Ev.n += 1
        self.id, self.log = _Ev.n, log

    def record(self, stream: _Stream) -> None:
        self.log.append(f"{stream.cuda_stream} records e{self.id}")


class _Stream:
    def __init__(self, name: str, log: list[str]) -> None:
        self.cuda_stream, self.log = name, log

    def wait_event(self, ev: _Ev) -> None:
        self.log.append(f"{self.cuda_stream} waits e{ev.id}")

    def record_event(self) -> _Ev:
        ev = _Ev(self.log)
        ev.record(self)
        return ev


class _Slot:
    def __init__(self, i: int) -> None:
        self.i = i

    def data_ptr(self) -> int:
        return 1000 + self.i


class _Codec:
    def __init__(self, log: list[str], n_slots: int) -> None:
        self.log, self.n = log, n_slots

    def slots(self, n: int | None = None) -> list[_Slot]:
        return [_Slot(i) for i in range(self.n if n is None else n)]

    def decode_into(self, plan: object, piece: codec.Piece, slot: _Slot) -> None:
        self.log.append(f"decode p{piece.first} from slot {slot.i}")


@pytest.mark.parametrize("profile", [False, True])
def test_wake_queue_reuses_a_slot_after_its_decode(
    monkeypatch: pytest.MonkeyPatch, profile: bool
) -> None:
    """The wake's queue copies each piece into the next slot and decodes it from there, in
    order; a later piece's copy into a reused slot waits for that slot's last decode, and
    every decode waits for its own piece's copy."""
    log: list[str] = []
    monkeypatch.setattr(codec.torch.cuda, "Event", lambda **_: _Ev(log))
    monkeypatch.setattr(codec.torch.cuda, "stream", lambda _s: contextlib.nullcontext())
    pieces = [codec.Piece(0, 0, 8, j, 1, 4, 4 * j) for j in range(5)]

    def copy(host_off: int, dev: int, n: int, to_host: bool, stream: str) -> None:
        assert not to_host
        log.append(f"{stream} copies host {host_off} to slot {dev - 1000}")

    dma, dec = _Stream("dma", log), _Stream("dec", log)
    wq = codec.WakeQueue(_Codec(log, 3), None, copy, dma, dec, profile=profile)  # type: ignore[arg-type]
    assert wq.n_slots == 3
    for p in pieces:
        wq.queue(p)
    decodes = [e for e in log if e.startswith("decode")]
    assert decodes == [f"decode p{j} from slot {j % 3}" for j in range(5)]
    # piece 3's copy reuses slot 0: it waits for the event recorded after piece 0's decode
    d0 = log.index("decode p0 from slot 0")
    freed = next(e for e in log[d0:] if e.startswith("dec records")).split()[-1]
    c3 = log.index("dma copies host 12 to slot 0")
    assert f"dma waits {freed}" in log[d0:c3]
    for j in range(5):
        c = log.index(f"dma copies host {4 * j} to slot {j % 3}")
        copied = next(e for e in log[c:] if e.startswith("dma records")).split()[-1]
        dj = log.index(f"decode p{j} from slot {j % 3}")
        assert f"dec waits {copied}" in log[c:dj]


class _ZeroingCodec(_Codec):
    """slots() zeroes its per-piece counts on the caller's stream, as GpuCodec._scratch
    does the first time after a release."""

    def slots(self, n: int | None = None) -> list[_Slot]:
        self.log.append("current zeroes the scratch")
        return super().slots(n)

    def encode_into(self, plan: object, piece: codec.Piece, slot: _Slot) -> None:
        self.log.append(f"encode p{piece.first} into slot {slot.i}")


class _Ordered(_Stream):
    def wait_stream(self, other: _Stream) -> None:
        self.log.append(f"{self.cuda_stream} waits {other.cuda_stream}")


@pytest.mark.parametrize("kind", ["sleep", "wake"])
def test_a_queue_orders_its_streams_after_the_scratch_it_zeroes(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A queue's streams wait for the caller's stream after its scratch was made there:
    the H200's 2x8B swap and 12-model density runs (2026-12-02) failed wakes on the first
    64 MiB of the first range (32 of the verify's 2 MiB pieces: one codec piece), and the
    sleep's queue was ordered after the current stream before the per-piece counts its
    encode reads were zeroed on that stream."""
    log: list[str] = []
    monkeypatch.setattr(codec.torch.cuda, "Event", lambda **_: _Ev(log))
    monkeypatch.setattr(codec.torch.cuda, "stream", lambda _s: contextlib.nullcontext())
    a, b, current = _Ordered("a", log), _Ordered("b", log), _Stream("current", log)
    gc = _ZeroingCodec(log, 2)
    piece = codec.Piece(0, 0, 8, 0, 1, 4, 0)

    def copy(host_off: int, dev: int, n: int, to_host: bool, stream: str) -> None:
        log.append(f"{stream} copies")

    if kind == "sleep":
        codec.SleepQueue(gc, None, copy, a, b, after=current).queue(piece)  # type: ignore[arg-type]
        first = "encode p0 into slot 0"
    else:
        codec.WakeQueue(gc, None, copy, a, b, after=current).queue(piece)  # type: ignore[arg-type]
        first = "decode p0 from slot 0"
    zeroed = log.index("current zeroes the scratch")
    for name in ("a", "b"):
        assert zeroed < log.index(f"{name} waits current") < log.index(first), log


def test_making_the_scratch_queues_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The staging slots and per-piece counts are allocated, never filled: a fill queued on
    the caller's stream raced the encode stream on the H200 (the per-piece counts zeroed
    after the first piece's encode wrote them: that piece's exponents wrong in the host
    copy); the encoder needs none (test_kernel_matches_reference encodes over garbage)."""
    filled: list[str] = []
    for name in ("zeros", "zeros_like", "full", "ones"):
        real = getattr(codec.torch, name)

        def fill(*a: object, _n: str = name, _f: Any = real, **k: object) -> Any:
            filled.append(_n)
            return _f(*a, **k)

        monkeypatch.setattr(codec.torch, name, fill)
    gc = codec.GpuCodec.__new__(codec.GpuCodec)
    gc.device, gc.piece_chunks, gc.n_slots, gc.slot_bytes = torch.device("cpu"), 2, 2, 64
    gc._slots, gc._counts, gc._boff, gc.peak_scratch = [], None, None, 0
    assert len(gc.slots()) == 2
    assert gc._counts is not None
    assert tuple(gc._counts.shape) == (2, codec.CHUNK_BLOCKS)
    assert filled == []


def test_the_coded_copies_order_their_queues_after_the_current_stream() -> None:
    """The backend's queues are made with the worker's current stream to wait for (the
    ordering is the queue's, after its scratch), not ordered before they are made."""
    from worker_ext.cumem.coded import CodedCopies

    log: list[str] = []
    current = _Stream("current", log)

    class _Streams:
        def all(self) -> list[_Stream]:
            return [_Ordered("a", log), _Ordered("b", log)]

        def current(self) -> _Stream:
            return current

        def after_current(self, streams: list[_Stream]) -> None:
            log.append("ordered before the queue was made")

        def copier(self, host: int) -> object:
            return lambda *_a: None

    class _Host:
        ptr = 0

    coded = CodedCopies(None, "cpu", _Streams(), lambda: None)  # type: ignore[arg-type]
    coded._gc = _ZeroingCodec(log, 2)  # type: ignore[assignment]
    coded.sleep_queue(coded._gc, None, _Host())  # type: ignore[arg-type]
    coded.wake_queue(None, _Host())  # type: ignore[arg-type]
    assert "ordered before the queue was made" not in log
    assert log == [
        "current zeroes the scratch",
        "a waits current",
        "b waits current",
        "current zeroes the scratch",
        "a waits current",
        "b waits current",
    ]


def test_rates_by_part_splits_pieces_in_order() -> None:
    # 8 pieces of 1 GB: the first two slow (as right after a large release), the rest fast
    secs = [1 / 28, 1 / 28] + [1 / 55] * 6
    rates = codec.rates_by_part(secs, [10**9] * 8)
    assert [round(r or 0, 6) for r in rates] == [28.0, 55.0, 55.0, 55.0]
    odd = codec.rates_by_part([0.5, 0.5, 0.5], [10**9, 2 * 10**9, 10**9], parts=2)
    assert [round(r or 0, 6) for r in odd] == [2.0, 3.0]  # [0:1] and [1:3]
    assert codec.rates_by_part([], [], parts=2) == [None, None]
    assert codec.rates_by_part([0.0, 0.0], [5, 5]) == [None, None, None, None]
    with pytest.raises(ValueError, match="3 times for 2 sizes"):
        codec.rates_by_part([1.0, 1.0, 1.0], [1, 1])


@needs_interp
def test_warm_kernel_proves_the_codec_and_its_reuse_check() -> None:
    """codec.warm (the backend's proof before it trusts the kernels): encode, decode and a
    reused plan's check, which passes its own bytes and refuses bytes with more escapes."""
    gc, report = codec.warm("cpu")
    assert report["ok"], report
    assert gc is not None


# -- after a verify's mismatch: the host copy against the baseline (cumem/hostcheck) --------

SUMS_BYTES = 64 << 10  # the differing pieces' size here (the verify's are 2 MiB)


def _coded_copy(data: torch.Tensor) -> tuple[codec.GpuCodec, codec.Plan, torch.Tensor]:
    """`data` coded as a sleep codes it (one chunk a piece), laid out in a host buffer."""
    gc = codec.GpuCodec("cpu", piece_chunks=1)
    plan = gc.plan([(int(data.data_ptr()), int(data.numel()))])
    host = torch.zeros(plan.total, dtype=torch.uint8)
    for piece, got in zip(plan.pieces, _encode_all(gc, plan), strict=True):
        host[piece.host_off : piece.host_off + piece.size] = got
    return gc, plan, host


def _pieces(
    data: torch.Tensor, offsets: list[int], size: int = SUMS_BYTES
) -> list[tuple[int, int, int, int]]:
    """The verify's differing pieces at these offsets: address, bytes, baseline sums."""
    from worker_ext import fpkernel

    ptr = int(data.data_ptr())
    return [(ptr + o, size, *fpkernel.piece_sums(data[o : o + size])) for o in offsets]


def _wake(gc: codec.GpuCodec, plan: codec.Plan, host: torch.Tensor) -> None:
    """Decode the host copy into place, as the wake does."""
    for p in plan.pieces:
        at = plan.ranges[p.rng][0] + p.dev_off
        gc.decode_to(host[p.host_off : p.host_off + p.size], p.n_chunks, at, p.raw_bytes)


@needs_interp
@pytest.mark.usefixtures("small_chunks")
def test_host_copy_check_kernel_tells_a_wrong_restore_from_a_wrong_host_copy() -> None:
    """After a verify's mismatch, each differing piece's host copy is decoded on the
    device and compared with its baseline: a host copy that holds it says the wake wrote
    the device wrong; one that does not (its escapes overwritten: what the sleep's
    encode with wrong per-block counts wrote) says the sleep wrote it wrong."""
    from worker_ext.cumem import hostcheck

    data = torch.cat(
        [
            _bf16_words("normal", codec.CHUNK_WORDS, 3, 0.02),
            _bf16_words("normal", 8 * codec.BLOCK, 4, 0.05),
        ]
    )
    gc, plan, host = _coded_copy(data)
    # the differing pieces a 16th of a chunk (SUMS_BYTES at the production geometry): at
    # the first piece's start, the middle of the first chunk, one across the first two
    sums = codec.CHUNK_WORDS // 16
    bad = _pieces(data, [0, codec.CHUNK_WORDS, 2 * codec.CHUNK_WORDS - sums // 2], sums)
    coded = (gc, plan, int(host.data_ptr()))
    # the wake wrote the device wrong: the host copy still decodes to the baseline
    wrong = data.clone()
    stride = sums * 7 // 16  # words between changed words: some in every differing piece
    data.view(torch.int16)[::stride] ^= 0x0100
    res = hostcheck.check(bad, "cpu", coded, {})
    assert res["error"] is None, res
    assert (res["pieces"], res["host_good"], res["host_bad"]) == (3, 3, 0)
    assert res["equal_to_device"] == 0
    assert res["decoded"] == 2
    assert res["rows"][0]["bits_differing"] == "0x0100"  # what changed: one exponent bit
    assert res["rows"][0]["words_differing"] == len(range(0, sums // 2, stride))
    assert "holds the baseline in 3 " in res["summary"]
    assert "in bits 0x0100" in res["summary"]
    # the sleep wrote the host copy wrong: every escape of the first piece overwritten
    data.copy_(wrong)
    first = plan.pieces[0]
    row = plan.meta_h[first.first]
    assert int(row[codec.NEXC]) > 0
    at = first.host_off + int(row[codec.OFF]) + int(row[codec.EXC])
    host[at : at + int(row[codec.NEXC])] = 0
    _wake(gc, plan, host)  # the wake restores exactly what the host copy holds
    res = hostcheck.check(bad, "cpu", coded, {})
    assert res["error"] is None, res
    assert (res["host_good"], res["host_bad"]) == (0, 3)  # the third reads piece 0 too
    assert res["equal_to_device"] == 3
    assert "and not in 3 (the sleep wrote" in res["summary"]


def test_host_copy_check_reads_raw_copies_and_bounds_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A raw host copy is read as it is; what no copy covers is counted so; the coded
    pieces decoded stop at MAX_DECODED; a look that fails says so and never raises."""
    from worker_ext.cumem import hostcheck

    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, 256, (4 * SUMS_BYTES,), generator=g, dtype=torch.int32)
    data = data.to(torch.uint8)
    host = data.clone()
    ptr = int(data.data_ptr())
    raw = {ptr: (int(host.data_ptr()), 0, 2 * SUMS_BYTES)}  # the first half copied raw
    bad = _pieces(data, [0, SUMS_BYTES, 2 * SUMS_BYTES])
    data[5] ^= 1
    res = hostcheck.check(bad, "cpu", None, raw)
    assert (res["pieces"], res["host_good"], res["not_in_copy"]) == (3, 2, 1), res
    assert res["equal_to_device"] == 1  # the second piece was not changed
    assert [r["host"] for r in res["rows"]] == ["baseline", "baseline", "none"]

    class Broken:
        def decode_to(self, *args: object) -> None:
            raise RuntimeError("no kernels here")

    plan = codec.Plan(
        ranges=[(ptr, 4 * SUMS_BYTES)],
        pieces=[codec.Piece(0, 0, 4 * SUMS_BYTES, 0, 1, 64, 0)],
        meta=None,
        inv=None,
        total=64,
        raw_total=4 * SUMS_BYTES,
    )
    coded = (Broken(), plan, int(host.data_ptr()))
    res = hostcheck.check(bad, "cpu", coded, {})  # type: ignore[arg-type]
    assert res["error"] == "RuntimeError: no kernels here"
    assert "error: RuntimeError" in res["summary"]
    monkeypatch.setattr(hostcheck, "MAX_DECODED", 0)
    res = hostcheck.check(bad, "cpu", coded, {})  # type: ignore[arg-type]
    assert (res["pieces"], res["error"]) == (0, None)


def test_the_last_wake_s_host_copy_is_read_only_while_its_buffer_is_the_backend_s() -> None:
    """What the last wake copied back from (cumem/hostcheck.WokeFrom): read after the
    backend's wait, only where its buffer is still one of the backend's (a buffer released,
    ptr 0, or another pinned in its place counts as no copy); a resume that decoded nothing
    leaves the coded copy as it was; a wait that fails is the answer's error."""
    from worker_ext.cumem import hostcheck

    data = torch.arange(2 * SUMS_BYTES, dtype=torch.int32).to(torch.uint8)
    host = data.clone()

    class _Buf:
        def __init__(self, ptr: int) -> None:
            self.ptr = ptr

    buf = _Buf(int(host.data_ptr()))
    woke = hostcheck.WokeFrom()
    woke.add({int(data.data_ptr()): (buf.ptr, 0, 2 * SUMS_BYTES)}, None, None, buf)  # type: ignore[arg-type]
    woke.add({}, None, None, buf)  # type: ignore[arg-type]  # the KV cache's resume: no copy
    assert woke.coded is None
    bad = _pieces(data, [SUMS_BYTES])
    waits: list[int] = []
    res = woke.check(bad, "cpu", lambda: waits.append(1), [buf])  # type: ignore[list-item]
    assert waits == [1]
    assert (res["pieces"], res["host_good"], res["equal_to_device"]) == (1, 1, 1), res
    other = _Buf(buf.ptr + 4096)  # another buffer pinned in its place
    res = woke.check(bad, "cpu", lambda: None, [other, None])  # type: ignore[list-item]
    assert (res["pieces"], res["not_in_copy"]) == (1, 1), res
    buf.ptr = 0  # released
    res = woke.check(bad, "cpu", lambda: None, [buf])  # type: ignore[list-item]
    assert res["not_in_copy"] == 1, res

    def fails() -> None:
        raise RuntimeError("copies failed")

    res = woke.check(bad, "cpu", fails, [buf])  # type: ignore[list-item]
    assert res["error"] == "RuntimeError: copies failed"
    assert res["summary"] == "not checked: RuntimeError: copies failed"
