"""A lossless, data-parallel codec for bf16-heavy byte ranges (the level-1 host copy).

A range is read as little-endian 16-bit words w. bf16 is 1 sign, 8 exponent, 7 mantissa
bits: the byte s = sign << 7 | mantissa travels raw, and the exponent byte
e = (w >> 7) & 0xFF, which carries about 2.6-2.9 bits in a trained model, is coded:

- per chunk of CHUNK_WORDS words (2 MiB), a table of the 2^k - 1 most frequent exponents
  (k in KS); each word's exponent becomes a k-bit code, the last code an escape;
- codes are stored as bit planes, k bytes per group of 8 words (byte p of a group holds
  bit p of its 8 codes), so a word's code is k byte loads and shifts, with no bitstream;
- escaped exponents go raw into a side stream in word order, located by a per-block
  (BLOCK words) prefix count stored with the chunk;
- a chunk where nothing of this pays (fp8, int4, fp32 low halves, noise) is kept raw
  (k = 0): the choice is the smallest of the candidate sizes, raw winning ties.

Decoding is a gather: unpack, table lookup, one prefix sum per block, merge with the raw
byte. Any byte pattern round-trips (NaN, Inf, denormals, non-bf16 data): the codec never
interprets a value, it moves bit fields.

A piece is a run of at most `piece_chunks` chunks of one range, self-describing:
  [META_BYTES per chunk: k, payload offset, words, exceptions, packed/boff/exc offsets,
   payload size, 16-byte table][payloads, each ALIGN-aligned], padded to PIECE_ALIGN.
The chunk payload (k > 0, n words, x exceptions):
  s bytes (n) | bit planes (ceil(n/8) * k) | block offsets (u32 per block) | exceptions (x)
each part ALIGN-aligned; k = 0: the n words as they are.

`encode_piece` / `decode_piece` are the torch reference (any device, tests on CPU);
`GpuCodec` runs the same format with Triton kernels and pipelines it with the copies
(worker_ext/cumem/). The GPU encoder's output is byte-identical to the reference's.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

BLOCK = 4096  # words per Triton program (and per exception prefix count)
CHUNK_BLOCKS = 256  # blocks per chunk (the kernels take it as CHUNK // BLOCK)
CHUNK_WORDS = BLOCK * CHUNK_BLOCKS  # 2 MiB of words: one table per chunk
KS = (2, 3, 4)  # candidate code widths
META_INTS = 16
META_BYTES = META_INTS * 4
TABLE_AT = 32  # the table's byte offset inside a meta row (ints 8..11)
ALIGN = 16
PIECE_ALIGN = 256
HOST_ALIGN = 4096  # a piece's offset in the host copy (the pages the DMA reads)
NUM_WARPS = 8

# meta columns
K, OFF, NWORDS, NEXC, PACKED, BOFF, EXC, SIZE = range(8)


class Unavailable(RuntimeError):
    """The GPU codec cannot run here (no Triton, no CUDA)."""


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def header_bytes(n_chunks: int) -> int:
    return _align(n_chunks * META_BYTES, PIECE_ALIGN)


def payload_size(k: int, n: int, n_exc: int) -> tuple[int, int, int, int]:
    """(packed, block offsets, exceptions, total) byte offsets of one chunk's payload."""
    if k == 0:
        return 0, 0, 0, _align(2 * n, ALIGN)
    packed = _align(n, ALIGN)
    boff = _align(packed + (n + 7) // 8 * k, ALIGN)
    exc = boff + 4 * ((n + BLOCK - 1) // BLOCK)
    return packed, boff, exc, _align(exc + n_exc, ALIGN)


def _align_t(x: Any, a: int) -> Any:
    return (x + (a - 1)) // a * a


def payload_sizes(k: Any, n: Any, n_exc: Any) -> Any:
    """`payload_size` over int64 tensors (or numpy arrays: the disk tier's host-side
    check) of chunks: [C, 4] (packed, boff, exc, total)."""
    xp: Any = np if isinstance(n, np.ndarray) else torch
    coded = k > 0
    packed = _align_t(n, ALIGN)
    boff = _align_t(packed + (n + 7) // 8 * k, ALIGN)
    exc = boff + 4 * ((n + BLOCK - 1) // BLOCK)
    total = xp.where(coded, _align_t(exc + n_exc, ALIGN), _align_t(2 * n, ALIGN))
    zero = xp.zeros_like(n)
    return xp.stack(
        [
            xp.where(coded, packed, zero),
            xp.where(coded, boff, zero),
            xp.where(coded, exc, zero),
            total,
        ],
        1,
    )


def select(hist: Any, n: Any) -> tuple[Any, Any]:
    """Per chunk, from its exponent histogram [C, 256] and word count [C]: the meta rows
    [C, META_INTS] int32 (all but OFF) and the exponent -> code maps [C, 256] uint8.
    Pure torch on the histogram's device; ties broken by exponent, so every device agrees."""
    dev = hist.device
    c = int(hist.shape[0])
    hist = hist.to(torch.int64)
    n = n.to(torch.int64)
    ar = torch.arange(256, dtype=torch.int64, device=dev)
    key = hist * 256 + (255 - ar)  # unique: count first, then the smaller exponent
    order = torch.argsort(key, dim=1, descending=True)
    top = order[:, :15]
    cum = torch.gather(hist, 1, top).cumsum(1)
    cands = [_align_t(2 * n, ALIGN)]  # raw first: argmin keeps the first of equal sizes
    excs = [torch.zeros_like(n)]
    for k in KS:
        n_exc = n - cum[:, (1 << k) - 2]
        packed = _align_t(n, ALIGN)
        boff = _align_t(packed + (n + 7) // 8 * k, ALIGN)
        exc = boff + 4 * ((n + BLOCK - 1) // BLOCK)
        cands.append(_align_t(exc + n_exc, ALIGN))
        excs.append(n_exc)
    sizes = torch.stack(cands, 1)
    pick = torch.argmin(sizes, dim=1)
    ks = torch.tensor((0, *KS), dtype=torch.int64, device=dev)[pick]
    meta = torch.zeros((c, META_INTS), dtype=torch.int64, device=dev)
    meta[:, K] = ks
    meta[:, NWORDS] = n
    meta[:, NEXC] = torch.gather(torch.stack(excs, 1), 1, pick[:, None])[:, 0]
    packed = _align_t(n, ALIGN)
    boff = _align_t(packed + (n + 7) // 8 * ks, ALIGN)
    exc = boff + 4 * ((n + BLOCK - 1) // BLOCK)
    coded = ks > 0
    meta[:, PACKED] = torch.where(coded, packed, 0)
    meta[:, BOFF] = torch.where(coded, boff, 0)
    meta[:, EXC] = torch.where(coded, exc, 0)
    meta[:, SIZE] = torch.gather(sizes, 1, pick[:, None])[:, 0]
    esc = (1 << ks) - 1  # 0 for raw chunks: unused
    j = torch.arange(15, dtype=torch.int64, device=dev)
    in_table = j[None, :] < esc[:, None]
    table = torch.where(in_table, top, 0).to(torch.uint8)
    tbytes = torch.zeros((c, 16), dtype=torch.uint8, device=dev)
    tbytes[:, :15] = table
    meta32 = meta.to(torch.int32)
    meta32[:, 8:12] = tbytes.view(torch.int32)
    inv = esc[:, None].expand(c, 256).clone()
    inv.scatter_(1, top, torch.where(in_table, j[None, :].expand(c, 15), esc[:, None]))
    return meta32, inv.to(torch.uint8)


def layout(meta: Any) -> int:
    """Set each chunk's payload offset (OFF) in a piece's meta rows (CPU tensor, one
    cumulative sum: no Python per chunk); returns the piece's size."""
    sizes = meta[:, SIZE].to(torch.int64)
    ends = torch.cumsum(sizes, 0)
    head = header_bytes(int(meta.shape[0]))
    meta[:, OFF] = (head + ends - sizes).to(torch.int32)
    return _align(head + (int(ends[-1]) if int(ends.numel()) else 0), PIECE_ALIGN)


def _words(data: Any) -> Any:
    """int32 values 0..65535 of a uint8 tensor of even length."""
    return data.view(torch.int16).to(torch.int32) & 0xFFFF


def histograms(words: Any) -> tuple[Any, Any]:
    """Exponent histogram [C, 256] and word count [C] of each chunk (torch)."""
    n = int(words.numel())
    c = max(1, (n + CHUNK_WORDS - 1) // CHUNK_WORDS)
    e = (words >> 7) & 0xFF
    idx = torch.arange(n, device=words.device) // CHUNK_WORDS
    hist = torch.bincount(idx * 256 + e, minlength=c * 256).view(c, 256)
    counts = torch.full((c,), CHUNK_WORDS, dtype=torch.int64, device=words.device)
    counts[-1] = n - (c - 1) * CHUNK_WORDS
    return hist, counts


def _encode_chunk(w: Any, row: Any, inv: Any, out: Any) -> None:
    """One chunk's payload into `out` (uint8, its size) with torch."""
    k, n = int(row[K]), int(w.numel())
    if k == 0:
        out[: 2 * n].copy_(w.to(torch.int16).view(torch.uint8))
        return
    s = ((w >> 8) & 0x80) | (w & 0x7F)
    out[:n].copy_(s.to(torch.uint8))
    e = (w >> 7) & 0xFF
    code = inv.to(torch.int32)[e]
    groups = (n + 7) // 8
    padded = torch.zeros(groups * 8, dtype=torch.int32, device=w.device)
    padded[:n] = code
    g = padded.view(groups, 8)
    lanes = torch.arange(8, dtype=torch.int32, device=w.device)
    planes = torch.stack([(((g >> p) & 1) << lanes).sum(1) for p in range(k)], 1)
    pk = int(row[PACKED])
    out[pk : pk + groups * k].copy_(planes.reshape(-1).to(torch.uint8))
    esc = code == (1 << k) - 1
    nb = (n + BLOCK - 1) // BLOCK
    per_block = torch.zeros(nb * BLOCK, dtype=torch.int64, device=w.device)
    per_block[:n] = esc.to(torch.int64)
    counts = per_block.view(nb, BLOCK).sum(1)
    boff = (counts.cumsum(0) - counts).to(torch.int32)
    bo = int(row[BOFF])
    out[bo : bo + 4 * nb].copy_(boff.view(torch.uint8))
    ex = int(row[EXC])
    x = e[esc].to(torch.uint8)
    out[ex : ex + int(x.numel())].copy_(x)


def encode_piece(data: Any) -> Any:
    """The reference encoder: one piece (uint8 tensor, even length, any number of chunks)."""
    if int(data.numel()) % 2:
        raise ValueError("a piece holds whole 16-bit words")
    w = _words(data)
    hist, n = histograms(w)
    meta, inv = select(hist, n)
    meta = meta.cpu()
    size = layout(meta)
    out = torch.zeros(size, dtype=torch.uint8, device=data.device)
    out[: int(meta.shape[0]) * META_BYTES].copy_(meta.reshape(-1).view(torch.uint8))
    for i in range(int(meta.shape[0])):
        lo = i * CHUNK_WORDS
        row = meta[i]
        off = int(row[OFF])
        _encode_chunk(w[lo : lo + int(row[NWORDS])], row, inv[i], out[off : off + int(row[SIZE])])
    return out


def decode_piece(piece: Any, n_chunks: int) -> Any:
    """The reference decoder: the piece's bytes (uint8 tensor on the piece's device)."""
    meta = piece[: n_chunks * META_BYTES].cpu().view(torch.int32).view(n_chunks, META_INTS)
    n_total = int(meta[:, NWORDS].sum())
    out = torch.empty(n_total, dtype=torch.int32, device=piece.device)
    for i in range(n_chunks):
        row = meta[i]
        k, n, off = int(row[K]), int(row[NWORDS]), int(row[OFF])
        body = piece[off : off + int(row[SIZE])]
        lo = i * CHUNK_WORDS
        if k == 0:
            out[lo : lo + n] = _words(body[: 2 * n])
            continue
        s = body[:n].to(torch.int32)
        pk, bo, ex = int(row[PACKED]), int(row[BOFF]), int(row[EXC])
        idx = torch.arange(n, device=piece.device)
        g, lane = idx >> 3, (idx & 7).to(torch.int32)
        code = torch.zeros(n, dtype=torch.int32, device=piece.device)
        for p in range(k):
            b = body[pk + g * k + p].to(torch.int32)
            code |= ((b >> lane) & 1) << p
        table = piece[i * META_BYTES + TABLE_AT : i * META_BYTES + TABLE_AT + 16].to(torch.int32)
        esc = code == (1 << k) - 1
        e = table[code.clamp(max=15)]
        nb = (n + BLOCK - 1) // BLOCK
        boff = body[bo : bo + 4 * nb].clone().view(torch.int32).to(torch.int64)
        esc64 = esc.to(torch.int64)
        incl = torch.zeros(nb * BLOCK, dtype=torch.int64, device=piece.device)
        incl[:n] = esc64
        rank = (incl.view(nb, BLOCK).cumsum(1) - incl.view(nb, BLOCK) + boff[:, None]).view(-1)
        pos = rank[:n][esc]
        nexc = int(row[NEXC])
        inside = (pos >= 0) & (pos < nexc)  # as the kernel: a corrupt count reads nothing
        at = (ex + pos.clamp(0, max(0, nexc - 1))).clamp(max=int(body.numel()) - 1)
        e[esc] = torch.where(inside, body[at].to(torch.int32), 0)
        out[lo : lo + n] = ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)
    return out.to(torch.int16).view(torch.uint8)


# -- a whole byte string (tests, the disk tier) ------------------------------------------


def encode(data: Any, piece_chunks: int = 32) -> list[tuple[int, Any]]:
    """Any uint8 tensor as (chunk count, piece) pairs; an odd last byte in a raw piece."""
    n = int(data.numel())
    out: list[tuple[int, Any]] = []
    even = n - n % 2
    step = piece_chunks * CHUNK_WORDS * 2
    for lo in range(0, even, step):
        hi = min(even, lo + step)
        out.append(
            ((hi - lo + 2 * CHUNK_WORDS - 1) // (2 * CHUNK_WORDS), encode_piece(data[lo:hi]))
        )
    if n % 2:
        out.append((0, data[even:].clone()))
    return out


def decode(pieces: list[tuple[int, Any]]) -> Any:
    parts = [decode_piece(p, c) if c else p for c, p in pieces]
    if not parts:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.cat(parts)


# -- the Triton kernels (the same format) ------------------------------------------------

tl: Any = None  # triton.language, bound on first use (the kernels read it as a global)
_KERNELS: dict[bool, dict[str, Any]] = {}


# Only the constexprs are annotated: Triton's compiler reads annotations.
def _k_hist(src, n, hist, CHUNK: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """hist[c, e] += count of exponent e in block (c, b) of the words at src."""
    c = tl.program_id(0)
    b = tl.program_id(1)
    offs = c.to(tl.int64) * CHUNK + b * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    w = tl.load(src + offs, mask=valid, other=0).to(tl.int32) & 0xFFFF
    e = tl.where(valid, (w >> 7) & 0xFF, 256)
    h = tl.histogram(e, 512)
    bins = tl.arange(0, 512)
    tl.atomic_add(hist + c * 256 + bins, h, mask=bins < 256)


def _k_hist_table(tab, hist, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """hist[i, e] += count of exponent e in block b of chunk i, whose word address and
    word count are tab[i] (every chunk of every range in one launch)."""
    i = tl.program_id(0)
    b = tl.program_id(1)
    base = tl.load(tab + 2 * i).to(tl.pointer_type(tl.int16))
    n = tl.load(tab + 2 * i + 1)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    w = tl.load(base + offs, mask=valid, other=0).to(tl.int32) & 0xFFFF
    e = tl.where(valid, (w >> 7) & 0xFF, 256)
    h = tl.histogram(e, 512)
    bins = tl.arange(0, 512)
    tl.atomic_add(hist + i * 256 + bins, h, mask=bins < 256)


def _k_encode(src, out, meta, inv, counts, CHUNK: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """Block (c, b): raw words (k = 0), or s bytes, bit planes and its escape count."""
    c = tl.program_id(0)
    b = tl.program_id(1)
    row = meta + c * 16
    k = tl.load(row + 0)
    off = tl.load(row + 1)
    nc = tl.load(row + 2)
    i = b * BLOCK + tl.arange(0, BLOCK)
    valid = i < nc
    w = tl.load(src + c * CHUNK + i, mask=valid, other=0).to(tl.int32) & 0xFFFF
    if k == 0:
        dst = (out + off).to(tl.pointer_type(tl.int16))
        tl.store(dst + i, w.to(tl.int16), mask=valid)
    else:
        s = ((w >> 8) & 0x80) | (w & 0x7F)
        tl.store(out + off + i, s.to(tl.uint8), mask=valid)
        e = (w >> 7) & 0xFF
        code = tl.load(inv + c * 256 + e, mask=valid, other=0).to(tl.int32)
        esc = (code == (1 << k) - 1) & valid
        tl.store(counts + c * (CHUNK // BLOCK) + b, tl.sum(esc.to(tl.int32), axis=0))
        code2 = tl.reshape(code, (BLOCK // 8, 8))
        lanes = tl.arange(0, 8)[None, :]
        g = b * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        gvalid = g * 8 < nc
        packed = out + off + tl.load(row + 4)
        for p in range(0, k):
            plane = tl.sum(((code2 >> p) & 1) << lanes, axis=1)
            tl.store(packed + g * k + p, plane.to(tl.uint8), mask=gvalid)


def _k_exceptions(src, out, meta, inv, boff, CHUNK: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """Block (c, b) of a coded chunk: its prefix count and its escaped exponents."""
    c = tl.program_id(0)
    b = tl.program_id(1)
    row = meta + c * 16
    k = tl.load(row + 0)
    nc = tl.load(row + 2)
    if k != 0 and b * BLOCK < nc:
        off = tl.load(row + 1)
        i = b * BLOCK + tl.arange(0, BLOCK)
        valid = i < nc
        w = tl.load(src + c * CHUNK + i, mask=valid, other=0).to(tl.int32) & 0xFFFF
        e = (w >> 7) & 0xFF
        code = tl.load(inv + c * 256 + e, mask=valid, other=0).to(tl.int32)
        esc = ((code == (1 << k) - 1) & valid).to(tl.int32)
        base = tl.load(boff + c * (CHUNK // BLOCK) + b)
        rank = tl.cumsum(esc, axis=0) - esc + base
        # never past the escapes the plan laid out (a reused plan whose bytes changed: its
        # check refuses it before anything is released; this keeps the writes inside)
        inside = (esc != 0) & (rank < tl.load(row + 3))
        tl.store(out + off + tl.load(row + 6) + rank, e.to(tl.uint8), mask=inside)
        slot = (out + off + tl.load(row + 5)).to(tl.pointer_type(tl.int32))
        tl.store(slot + b, base)


def _k_check(tab, meta, inv, escapes, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """escapes[i] += the escapes block b of chunk i (word address and count tab[i]) has
    under the plan's map of that chunk (its meta row and inv row i); raw chunks count 0."""
    i = tl.program_id(0)
    b = tl.program_id(1)
    k = tl.load(meta + i * 16)
    n = tl.load(tab + 2 * i + 1)
    if k != 0 and b * BLOCK < n:
        base = tl.load(tab + 2 * i).to(tl.pointer_type(tl.int16))
        offs = b * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n
        w = tl.load(base + offs, mask=valid, other=0).to(tl.int32) & 0xFFFF
        e = (w >> 7) & 0xFF
        code = tl.load(inv + i * 256 + e, mask=valid, other=0).to(tl.int32)
        esc = ((code == (1 << k) - 1) & valid).to(tl.int32)
        tl.atomic_add(escapes + i, tl.sum(esc, axis=0))


def _k_decode(piece, dst, CHUNK: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """Block (c, b) of an encoded piece (meta read from the piece) into dst's words."""
    c = tl.program_id(0)
    b = tl.program_id(1)
    row = piece.to(tl.pointer_type(tl.int32)) + c * 16
    k = tl.load(row + 0)
    off = tl.load(row + 1)
    nc = tl.load(row + 2)
    i = b * BLOCK + tl.arange(0, BLOCK)
    valid = i < nc
    out = dst + c * CHUNK + i
    body = piece + off
    if k == 0:  # (names differ between the branches: Triton types them apart)
        raw = tl.load(body.to(tl.pointer_type(tl.int16)) + i, mask=valid, other=0)
        tl.store(out, raw, mask=valid)
    else:
        s = tl.load(body + i, mask=valid, other=0).to(tl.int32)
        g = i >> 3
        lane = i & 7
        packed = body + tl.load(row + 4)
        code = tl.zeros([BLOCK], dtype=tl.int32)
        for p in range(0, k):
            byte = tl.load(packed + g * k + p, mask=valid, other=0).to(tl.int32)
            code |= ((byte >> lane) & 1) << p
        table = piece + c * 64 + 32
        e = tl.load(table + code, mask=valid, other=0).to(tl.int32)
        esc = ((code == (1 << k) - 1) & valid).to(tl.int32)
        base = tl.load((body + tl.load(row + 5)).to(tl.pointer_type(tl.int32)) + b)
        rank = tl.cumsum(esc, axis=0) - esc + base
        nexc = tl.load(row + 3)
        inside = (esc != 0) & (rank >= 0) & (rank < nexc)  # a corrupt count reads nothing
        x = tl.load(body + tl.load(row + 6) + rank, mask=inside, other=0).to(tl.int32)
        e = tl.where(esc != 0, x, e)
        w = ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)
        tl.store(out, w.to(tl.int16), mask=valid)


def _k_decode_groups(piece, dst, CHUNK: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """The same decode as _k_decode, by groups of 8 words: each bit-plane byte is loaded
    once per group (not once per word), and the escapes' ranks are a prefix count over the
    groups plus one inside each group, so no [BLOCK] gather repeats a byte 8 times."""
    c = tl.program_id(0)
    b = tl.program_id(1)
    row = piece.to(tl.pointer_type(tl.int32)) + c * 16
    k = tl.load(row + 0)
    off = tl.multiple_of(tl.load(row + 1), 16)  # ALIGN: the loads below are vectorized
    nc = tl.load(row + 2)
    body = piece + off
    if k == 0:
        i = b * BLOCK + tl.arange(0, BLOCK)
        valid = i < nc
        raw = tl.load(body.to(tl.pointer_type(tl.int16)) + i, mask=valid, other=0)
        tl.store(dst + c * CHUNK + i, raw, mask=valid)
    else:
        g = b * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        lanes = tl.arange(0, 8)
        i2 = g[:, None] * 8 + lanes[None, :]
        valid2 = i2 < nc
        s2 = tl.load(body + i2, mask=valid2, other=0).to(tl.int32)
        gvalid = g * 8 < nc
        packed = body + tl.multiple_of(tl.load(row + 4), 16)
        code2 = tl.zeros([BLOCK // 8, 8], dtype=tl.int32)
        for p in range(0, k):
            byte = tl.load(packed + g * k + p, mask=gvalid, other=0).to(tl.int32)
            code2 |= ((byte[:, None] >> lanes[None, :]) & 1) << p
        table = piece + c * 64 + 32
        e2 = tl.load(table + code2, mask=valid2, other=0).to(tl.int32)
        esc2 = ((code2 == (1 << k) - 1) & valid2).to(tl.int32)
        per_group = tl.sum(esc2, axis=1)
        before = tl.cumsum(per_group, axis=0) - per_group
        boff = body + tl.multiple_of(tl.load(row + 5), 16)
        base = tl.load(boff.to(tl.pointer_type(tl.int32)) + b)
        rank2 = base + before[:, None] + tl.cumsum(esc2, axis=1) - esc2
        nexc = tl.load(row + 3)
        inside = (esc2 != 0) & (rank2 >= 0) & (rank2 < nexc)  # a corrupt count reads nothing
        x2 = tl.load(body + tl.load(row + 6) + rank2, mask=inside, other=0).to(tl.int32)
        e2 = tl.where(esc2 != 0, x2, e2)
        w2 = ((s2 & 0x80) << 8) | (e2 << 7) | (s2 & 0x7F)
        tl.store(dst + c * CHUNK + i2, w2.to(tl.int16), mask=valid2)


DECODERS = ("planes", "groups")  # _k_decode, _k_decode_groups: the same bytes out


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip() == "1"


def kernels() -> dict[str, Any]:
    """The jitted kernels, on first use (Triton is imported only then)."""
    global tl
    mode = _interpreting()
    hit = _KERNELS.get(mode)
    if hit is not None:
        return hit
    try:
        import triton
        import triton.language
    except Exception as e:
        raise Unavailable(f"triton: {e!r}") from e
    tl = triton.language
    made = {
        "hist": triton.jit(_k_hist),
        "hist_table": triton.jit(_k_hist_table),
        "encode": triton.jit(_k_encode),
        "exceptions": triton.jit(_k_exceptions),
        "check": triton.jit(_k_check),
        "decode": triton.jit(_k_decode),
        "decode_groups": triton.jit(_k_decode_groups),
    }
    _KERNELS[mode] = made
    return made


def _launch2(kernel: Any, grid: tuple[int, int], device: Any, *args: Any) -> None:
    """A launch of a kernel whose only constexpr is BLOCK."""
    kw: dict[str, Any] = {"BLOCK": BLOCK}
    if device.type == "cuda":
        kw["num_warps"] = NUM_WARPS
    kernel[grid](*args, **kw)


def _launch(kernel: Any, grid: tuple[int, int], device: Any, *args: Any) -> None:
    kw: dict[str, Any] = {"CHUNK": CHUNK_WORDS, "BLOCK": BLOCK}
    if device.type == "cuda":
        kw["num_warps"] = NUM_WARPS
    kernel[grid](*args, **kw)


# -- the GPU path: plan, encode, decode (the same format, Triton) -----------------------


@dataclass
class Piece:
    """One encoded piece: where its bytes live on the device and in the host copy."""

    rng: int  # index of its range in the plan
    dev_off: int  # byte offset inside the range
    raw_bytes: int
    first: int  # its first chunk's row in the plan's meta
    n_chunks: int
    size: int  # encoded bytes
    host_off: int = 0


@dataclass
class Plan:
    """Every range's pieces, their meta rows on the device and the host layout."""

    ranges: list[tuple[int, int]]
    pieces: list[Piece]
    meta: Any  # [C, META_INTS] int32 on the device, OFF set
    inv: Any  # [C, 256] uint8 on the device
    total: int  # encoded bytes of every piece, in host order
    raw_total: int
    plan_s: float = 0.0
    by_k: dict[int, int] = field(default_factory=dict)  # chunks per code width
    # Host copies of what a later sleep of the same ranges reuses (GpuCodec.reuse): the
    # meta rows (OFF set), the maps, and the chunk table (address, words) of the ranges.
    meta_h: Any = None
    inv_h: Any = None
    tab_h: Any = None

    def ratio(self) -> float:
        return self.total / self.raw_total if self.raw_total else 1.0

    def keep_on_host(self) -> None:
        """Copy the maps to host memory (the rows are there already), so that the device's
        copies can be dropped and a later sleep can still reuse this plan."""
        if self.inv_h is None and self.inv is not None:
            self.inv_h = self.inv.cpu()


class GpuCodec:
    """The codec on one CUDA device (or Triton's interpreter on CPU tensors, for tests).

    Scratch: `slots` staging buffers of one piece each (the pipeline's double buffer), the
    plan's meta and maps, and small per-piece counts; `scratch_bytes()` reports it."""

    def __init__(
        self, device: Any, piece_chunks: int = 32, slots: int = 2, decoder: str = "planes"
    ) -> None:
        device = torch.device(device)
        if device.type == "cpu" and not _interpreting():
            raise Unavailable("CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")
        if device.type == "cuda" and device.index is None:  # raw views name their index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.piece_chunks = piece_chunks
        self.n_slots = max(2, slots)
        self.slot_bytes = _align(
            header_bytes(piece_chunks) + piece_chunks * (2 * CHUNK_WORDS + ALIGN), PIECE_ALIGN
        )
        if decoder not in DECODERS:
            raise ValueError(f"decoder {decoder!r}: expected one of {DECODERS}")
        self.decoder = decoder  # which decode kernel runs (the same bytes out)
        self._k = kernels()
        self._slots: list[Any] = []
        self._counts: Any = None
        self._boff: Any = None
        self.peak_scratch = 0
        # where each piece starts in the host copy: a whole page (no copy starts inside
        # one; against 256-byte alignment it made no difference to the wake's copies:
        # docs/benchmarks.md; it costs < 4 KiB a piece)
        self.host_align = HOST_ALIGN
        self.plan_impl = "table"  # or "ranges" (see plan)

    # scratch ---------------------------------------------------------------------------

    def _scratch(self, n_slots: int) -> None:
        while len(self._slots) < n_slots:
            self._slots.append(torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device))
        if self._counts is None:  # not zeroed: no kernel on the caller's stream
            # (the encode writes every count of a coded chunk, the cumsum every offset; a
            # raw chunk's are never read: a zeroing on the caller's stream, racing the
            # encode stream, is what wrote the H200's wrong host copies)
            self._counts = torch.empty(
                (self.piece_chunks, CHUNK_BLOCKS), dtype=torch.int32, device=self.device
            )
            self._boff = torch.empty_like(self._counts)

    def scratch_bytes(self, plan: Plan | None = None, slots: int | None = None) -> int:
        """Device bytes the pipeline holds while it runs (`slots` staging slots, default
        n_slots; counts; the plan's rows)."""
        k = self.n_slots if slots is None else slots
        n = k * self.slot_bytes + 2 * self.piece_chunks * CHUNK_BLOCKS * 4
        if plan is not None:
            n += int(plan.meta.numel()) * 4 + int(plan.inv.numel())
        return n

    def release(self) -> None:
        """Give the scratch back to torch (the caller empties torch's cache if it wants)."""
        self._slots = []
        self._counts = None
        self._boff = None

    # plan ------------------------------------------------------------------------------

    def _view(self, ptr: int, nbytes: int) -> Any:
        from worker_ext.rawmem import raw_bytes

        return raw_bytes(ptr, nbytes, self.device)

    def plan(self, ranges: list[tuple[int, int]]) -> Plan:
        """Histograms and tables of every chunk of `ranges` ((address, bytes), even bytes),
        one host sync, the host layout. `plan_impl` "table": one histogram launch over a
        table of every chunk and the layout as a few tensor ops (no Python per chunk or per
        range on the device side); "ranges": one launch per range and the layout piece by
        piece (the first implementation, and the fallback if the table's kernel fails)."""
        t0 = time.perf_counter()
        per = []
        for ptr, nbytes in ranges:
            if nbytes % 2 or ptr % 2:
                raise ValueError(f"range at {ptr:#x} of {nbytes} bytes is not whole words")
            per.append(max(1, (nbytes // 2 + CHUNK_WORDS - 1) // CHUNK_WORDS) if nbytes else 0)
        total_chunks = sum(per)
        hist = torch.zeros((max(1, total_chunks), 256), dtype=torch.int32, device=self.device)
        addrs: list[int] = []
        words: list[int] = []
        for (ptr, nbytes), c in zip(ranges, per, strict=True):
            if c:
                addrs.extend(range(ptr, ptr + c * 2 * CHUNK_WORDS, 2 * CHUNK_WORDS))
                words.extend([CHUNK_WORDS] * (c - 1))
                words.append(nbytes // 2 - (c - 1) * CHUNK_WORDS)
        counts = torch.tensor(words or [0], dtype=torch.int64)
        table = self.plan_impl == "table"
        tab = torch.tensor([addrs, words], dtype=torch.int64).t().contiguous()
        if table and total_chunks:
            try:
                _launch2(self._k["hist_table"], (total_chunks, CHUNK_BLOCKS), self.device,
                         tab.to(self.device), hist)  # fmt: skip
            except Exception:  # the first implementation, per range
                self.plan_impl, table = "ranges", False
                hist.zero_()
        if not table:
            row = 0
            for (ptr, nbytes), c in zip(ranges, per, strict=True):
                if not c:
                    continue
                view = self._view(ptr, nbytes).view(torch.int16)
                _launch(self._k["hist"], (c, CHUNK_BLOCKS), self.device, view, nbytes // 2,
                        hist[row:])  # fmt: skip
                row += c
        meta, inv = select(hist[:total_chunks], counts[:total_chunks].to(self.device))
        meta_h = meta.cpu()  # the one host sync
        pieces = (self._layout_table if table else self._layout_ranges)(ranges, per, meta_h)
        by_k: dict[int, int] = {}
        for kk, count in enumerate(torch.bincount(meta_h[:, K].to(torch.int64)).tolist()):
            if count:
                by_k[kk] = int(count)
        meta_d = meta_h.to(self.device)
        return Plan(
            ranges=list(ranges),
            pieces=pieces,
            meta=meta_d,
            inv=inv,
            total=pieces[-1].host_off + pieces[-1].size if pieces else 0,
            raw_total=sum(n for _, n in ranges),
            plan_s=time.perf_counter() - t0,
            by_k=by_k,
            meta_h=meta_h,
            tab_h=tab,
        )

    def reuse(self, template: Plan) -> Plan:
        """A plan for the same ranges as `template` from its host copies (no pass over the
        bytes). Not proven for the bytes there now: `check` says whether every chunk's
        escapes fit what it laid out, and only then may its encoding be trusted."""
        t0 = time.perf_counter()
        if template.meta_h is None or template.inv_h is None or template.tab_h is None:
            raise ValueError("the plan kept no host copies to reuse")
        return Plan(
            ranges=list(template.ranges),
            pieces=[dataclasses.replace(p) for p in template.pieces],
            meta=template.meta_h.to(self.device),
            inv=template.inv_h.to(self.device),
            total=template.total,
            raw_total=template.raw_total,
            plan_s=time.perf_counter() - t0,
            by_k=dict(template.by_k),
            meta_h=template.meta_h,
            inv_h=template.inv_h,
            tab_h=template.tab_h,
        )

    def check(self, plan: Plan) -> Any:
        """Whether the bytes now in `plan`'s ranges have, in some chunk, more escapes under
        its maps than it laid out (a 0-d bool on the device, queued on the current stream:
        True means its encoding would not fit, so the plan must not be used). One launch
        over every chunk, one pass over the bytes, no host sync."""
        c = int(plan.meta.shape[0])
        escapes = torch.zeros(max(1, c), dtype=torch.int32, device=self.device)
        if c:
            tab = plan.tab_h.to(self.device, non_blocking=False)
            _launch2(self._k["check"], (c, CHUNK_BLOCKS), self.device, tab, plan.meta,
                     plan.inv, escapes)  # fmt: skip
        return torch.gt(escapes[:c], plan.meta[:, NEXC]).any()

    def _layout_ranges(
        self, ranges: list[tuple[int, int]], per: list[int], meta_h: Any
    ) -> list[Piece]:
        """Each piece's rows laid out (OFF set in meta_h), piece by piece."""
        pieces: list[Piece] = []
        row, host = 0, 0
        for r, ((_ptr, nbytes), c) in enumerate(zip(ranges, per, strict=True)):
            for j in range(0, c, self.piece_chunks):
                n_ch = min(self.piece_chunks, c - j)
                size = layout(meta_h[row + j : row + j + n_ch])
                raw = min(nbytes - j * 2 * CHUNK_WORDS, n_ch * 2 * CHUNK_WORDS)
                host = _align(host, self.host_align)
                pieces.append(Piece(r, j * 2 * CHUNK_WORDS, raw, row + j, n_ch, size, host))
                host += size
            row += c
        return pieces

    def _layout_table(
        self, ranges: list[tuple[int, int]], per: list[int], meta_h: Any
    ) -> list[Piece]:
        """The same layout as `_layout_ranges` (OFF set in meta_h, the same pieces), with
        the offsets and sizes as tensor ops over every chunk at once."""
        out: list[Piece] = []
        row = 0
        for r, ((_ptr, nbytes), c) in enumerate(zip(ranges, per, strict=True)):
            for j in range(0, c, self.piece_chunks):
                n_ch = min(self.piece_chunks, c - j)
                raw = min(nbytes - j * 2 * CHUNK_WORDS, n_ch * 2 * CHUNK_WORDS)
                out.append(Piece(r, j * 2 * CHUNK_WORDS, raw, row + j, n_ch, 0, 0))
            row += c
        if not out:
            return out
        first = torch.tensor([p.first for p in out], dtype=torch.int64)
        nch = torch.tensor([p.n_chunks for p in out], dtype=torch.int64)
        pid = torch.repeat_interleave(torch.arange(len(out)), nch)
        sizes = meta_h[:, SIZE].to(torch.int64)
        ends = torch.cumsum(sizes, 0)
        before = torch.cat([torch.zeros(1, dtype=torch.int64), ends])[first]  # per piece
        head = _align_t(nch * META_BYTES, PIECE_ALIGN)
        meta_h[:, OFF] = (head[pid] + ends - sizes - before[pid]).to(torch.int32)
        psize = _align_t(head + ends[first + nch - 1] - before, PIECE_ALIGN)
        step = _align_t(psize, self.host_align)
        host = torch.cumsum(step, 0) - step
        for p, sz, h in zip(out, psize.tolist(), host.tolist(), strict=True):
            p.size, p.host_off = int(sz), int(h)
        return out

    # one piece -------------------------------------------------------------------------

    def encode_into(self, plan: Plan, piece: Piece, out: Any) -> None:
        """Encode `piece` into `out` (uint8, >= piece.size) on the current stream."""
        ptr, _n = plan.ranges[piece.rng]
        src = self._view(ptr + piece.dev_off, piece.raw_bytes).view(torch.int16)
        rows = plan.meta[piece.first : piece.first + piece.n_chunks]
        inv = plan.inv[piece.first : piece.first + piece.n_chunks]
        counts = self._counts[: piece.n_chunks]
        boff = self._boff[: piece.n_chunks]
        grid = (piece.n_chunks, CHUNK_BLOCKS)
        _launch(self._k["encode"], grid, self.device, src, out, rows, inv, counts)
        torch.cumsum(counts, 1, dtype=torch.int32, out=boff)
        boff.sub_(counts)
        _launch(self._k["exceptions"], grid, self.device, src, out, rows, inv, boff)
        out[: piece.n_chunks * META_BYTES].view(torch.int32).view(piece.n_chunks, META_INTS).copy_(
            rows
        )

    def decode_into(self, plan: Plan, piece: Piece, staged: Any) -> None:
        """Decode `staged` (the piece's bytes on the device) into its range, current stream."""
        ptr, _n = plan.ranges[piece.rng]
        self.decode_to(staged, piece.n_chunks, ptr + piece.dev_off, piece.raw_bytes)

    def decode_to(self, staged: Any, n_chunks: int, dst_ptr: int, nbytes: int) -> None:
        dst = self._view(dst_ptr, nbytes).view(torch.int16)
        kernel = self._k["decode_groups" if self.decoder == "groups" else "decode"]
        _launch(kernel, (n_chunks, CHUNK_BLOCKS), self.device, staged, dst)

    # pipelines -------------------------------------------------------------------------

    def slots(self, n: int | None = None) -> list[Any]:
        """The first `n` staging slots (default n_slots), made on first use."""
        k = self.n_slots if n is None else max(1, min(n, self.n_slots))
        self._scratch(k)
        self.peak_scratch = max(self.peak_scratch, self.scratch_bytes(slots=len(self._slots)))
        return self._slots[:k]


Copy = Any  # (host offset, device address, bytes, to_host, raw cudaStream_t) -> None


SLEEP_SLOTS = 2  # a sleep's double buffer (it runs while the KV cache is still mapped)


def _order_after(after: Any, streams: tuple[Any, ...]) -> None:
    """A queue's streams wait for `after` (the stream its caller works on) once the queue's
    scratch is made there (allocated on that stream: the caching allocator's order). Its
    per-piece counts were zeroed there on first use (now made without a kernel), and an
    encode that ran before that zeroing landed (the streams ordered earlier) read counts
    the zeroing then overwrote: the first piece's escapes at wrong offsets, that whole
    piece (64 MiB at the default piece size) of the first range wrong in its host copy
    (in its exponents only: the H200's failed wakes' sums differ in exponent bits only).
    `after=None`: the caller orders the streams."""
    if after is not None:
        for s in streams:
            s.wait_stream(after)


class SleepQueue:
    """Encode pieces into the staging slots on `enc` and copy each to the host on `copy`
    (double-buffered: piece j + slots waits for piece j's copy to leave its slot)."""

    def __init__(
        self, gc: GpuCodec, plan: Plan, copy: Copy, enc: Any, dma: Any, after: Any = None
    ) -> None:
        self.gc, self.plan, self._copy = gc, plan, copy
        self.enc, self.dma = enc, dma
        self._slots = gc.slots(SLEEP_SLOTS)
        _order_after(after, (enc, dma))
        self._free: list[Any] = [None] * len(self._slots)
        self._j = 0

    def queue(self, piece: Piece) -> Any:
        """Queue one piece; returns the event after which its range's bytes are not read."""
        s = self._j % len(self._slots)
        self._j += 1
        slot = self._slots[s]
        if self._free[s] is not None:
            self.enc.wait_event(self._free[s])
        with torch.cuda.stream(self.enc):
            self.gc.encode_into(self.plan, piece, slot)
        encoded = self.enc.record_event()
        self.dma.wait_event(encoded)
        self._copy(piece.host_off, slot.data_ptr(), piece.size, True, self.dma.cuda_stream)
        self._free[s] = self.dma.record_event()
        return encoded


def rates_by_part(seconds: list[float], nbytes: list[int], parts: int = 4) -> list[float | None]:
    """GB/s of each of `parts` consecutive runs of pieces (piece j took seconds[j] for
    nbytes[j]); None for a run with no time. A wake profiled right after a large release
    shows the driver's scrub as slow first parts (docs/benchmarks.md)."""
    if len(seconds) != len(nbytes):
        raise ValueError(f"{len(seconds)} times for {len(nbytes)} sizes")
    n = len(seconds)
    out: list[float | None] = []
    for q in range(parts):
        lo, hi = q * n // parts, (q + 1) * n // parts
        t = sum(seconds[lo:hi])
        out.append(sum(nbytes[lo:hi]) / t / 1e9 if t > 0 else None)
    return out


class WakeQueue:
    """Copy pieces from the host into the staging slots on `dma` and decode each into its
    final place on `dec`, piece j + 1 on the wire while piece j decodes.

    `profile=True` records timing events around every piece's copy and decode (a few
    microseconds of CPU per piece); `profile_summary()`, once the streams are done, says
    where the GPU time went: the wire busy, the decoder busy, the DMA stream idle because
    nothing was queued yet (the CPU behind) or because it waited for a free slot (the
    decoder behind)."""

    def __init__(
        self,
        gc: GpuCodec,
        plan: Plan,
        copy: Copy,
        dma: Any,
        dec: Any,
        profile: bool = False,
        after: Any = None,
    ) -> None:
        self.gc, self.plan, self._copy = gc, plan, copy
        self.dma, self.dec = dma, dec
        self._slots = gc.slots()
        _order_after(after, (dma, dec))
        self._free: list[Any] = [None] * len(self._slots)
        self._j = 0
        self._prof: list[tuple[Any, ...]] | None = [] if profile else None
        self._sizes: list[tuple[int, int]] = []  # (coded, raw) bytes per piece, profiled

    @property
    def n_slots(self) -> int:
        return len(self._slots)

    def _event(self, stream: Any) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def _copy_in(self, piece: Piece) -> tuple[int, tuple[Any, ...]]:
        """Piece's bytes into the next slot on `dma` (after that slot's last decode)."""
        s = self._j % len(self._slots)
        dma = self.dma
        self._j += 1
        prof = self._prof is not None
        queued = self._event(dma) if prof else None
        if self._free[s] is not None:
            dma.wait_event(self._free[s])
        h0 = self._event(dma) if prof else None
        slot = self._slots[s]
        self._copy(piece.host_off, slot.data_ptr(), piece.size, False, dma.cuda_stream)
        staged = self._event(dma) if prof else dma.record_event()
        return s, (queued, h0, staged)

    def queue(self, piece: Piece) -> None:
        """Copy `piece` into the next slot, then decode it into its place (mapped by now)
        on `dec`."""
        s, evs = self._copy_in(piece)
        self.dec.wait_event(evs[2])
        prof = self._prof
        d0 = self._event(self.dec) if prof is not None else None
        with torch.cuda.stream(self.dec):
            self.gc.decode_into(self.plan, piece, self._slots[s])
        self._free[s] = self._event(self.dec) if prof is not None else self.dec.record_event()
        if prof is not None:
            prof.append((*evs, d0, self._free[s]))
            self._sizes.append((piece.size, piece.raw_bytes))

    def profile_summary(self) -> dict[str, Any] | None:
        """Seconds by kind over the profiled pieces (call after the streams are done)."""
        prof = self._prof
        if not prof:
            return None
        ms = [[a.elapsed_time(b) for a, b in itertools.pairwise(ev)] for ev in prof]
        # per piece: (queued->h0 slot wait, h0->staged wire, staged->d0 decoder's lag, d0->end)
        gaps = [prof[j - 1][2].elapsed_time(prof[j][0]) for j in range(1, len(prof))]
        wire = [m[1] for m in ms]
        dec = [m[3] for m in ms]
        slow = [j for j in range(len(prof)) if dec[j] > wire[j]]
        coded = sum(c for c, _ in self._sizes)
        raw = sum(r for _, r in self._sizes)
        return {
            "pieces": len(prof),
            "total_s": prof[0][0].elapsed_time(prof[-1][4]) / 1000.0,
            "wire_s": sum(wire) / 1000.0,
            "decode_s": sum(dec) / 1000.0,
            "slot_wait_s": sum(m[0] for m in ms) / 1000.0,
            "dma_idle_cpu_s": sum(max(0.0, g) for g in gaps) / 1000.0,
            "decode_lag_s": sum(m[2] for m in ms) / 1000.0,
            "decode_slower_than_wire": len(slow),
            "wire_gbps": coded / (sum(wire) / 1000.0) / 1e9 if sum(wire) else None,
            # the wire's rate by quarter of the pieces, in queue order
            "wire_gbps_by_quarter": rates_by_part(
                [w / 1000.0 for w in wire], [c for c, _ in self._sizes]
            ),
            "decode_gbps_raw": raw / (sum(dec) / 1000.0) / 1e9 if sum(dec) else None,
            "largest_cpu_gaps_ms": sorted(((round(g, 3), j + 1) for j, g in enumerate(gaps)))[-5:],
        }


def warm(
    device: Any, piece_chunks: int = 32, decoder: str = "planes", slots: int = 2
) -> tuple[GpuCodec | None, dict[str, Any]]:
    """Compile the kernels and prove them on `device` (a coded and a raw chunk, NaNs and
    denormals; byte-identical to the reference encoder, decoded exactly) before the backend
    trusts them: (codec or None, {"ok", "s", "error"}); never raises."""
    t = time.perf_counter()
    try:
        gc = GpuCodec(device, piece_chunks=piece_chunks, slots=2, decoder=decoder)
        g = torch.Generator(device="cpu").manual_seed(0)
        coded = (torch.randn(CHUNK_WORDS, generator=g) * 0.02).to(torch.bfloat16).view(torch.int16)
        coded[::97] = 0x7FC1  # a NaN
        coded[5::101] = 0x0003  # a denormal
        noise = torch.randint(-32768, 32768, (BLOCK + 7,), generator=g, dtype=torch.int32)
        host = torch.cat([coded, noise.to(torch.int16)]).view(torch.uint8)
        data = host.to(gc.device)
        plan = gc.plan([(int(data.data_ptr()), int(data.numel()))])
        [piece] = plan.pieces
        slot = gc.slots()[0]
        slot.zero_()
        gc.encode_into(plan, piece, slot)
        ref = encode_piece(host)
        if piece.size != ref.numel() or plan.by_k.get(0) != 1:
            raise Unavailable(f"plan {piece.size} B {plan.by_k}, reference {ref.numel()} B")
        back = torch.zeros_like(data)
        gc.decode_to(slot, piece.n_chunks, int(back.data_ptr()), int(back.numel()))
        if not torch.equal(back.cpu(), host):
            raise Unavailable("decode(encode(x)) != x on the device")
        if not torch.equal(decode_piece(slot[: piece.size].cpu(), piece.n_chunks), host):
            raise Unavailable("the reference decoder disagrees with the device's bytes")
        # a reused plan's check (compiled now, not in the first sleep): its own bytes fit
        plan.keep_on_host()
        if bool(gc.check(gc.reuse(plan))):
            raise Unavailable("the plan's check refused the bytes it was made for")
        data.view(torch.int16)[::7] = 0x7F7F  # an exponent the table does not hold
        if not bool(gc.check(gc.reuse(plan))):
            raise Unavailable("the plan's check passed bytes with more escapes")
        gc.release()
        gc.n_slots = max(2, slots)  # a wake's slots, made when it runs
    except Exception as e:
        return None, {
            "ok": False,
            "s": time.perf_counter() - t,
            "error": f"{type(e).__name__}: {e}",
        }
    return gc, {"ok": True, "s": time.perf_counter() - t, "error": None}
