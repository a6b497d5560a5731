"""Verify's span check in one Triton kernel launch: every span cut into fixed pieces.

`SpanCheck` reads a list of byte ranges (the spans of `fingerprint.Plan`) as int64 words
and, for each piece of at most PIECE_WORDS words of one range, writes (s1, s2) with
s1 = sum(w_i) modulo 2**64 and s2 = NH_k(w) = sum(((lo(w_i) + lo(k_i)) mod 2**32) *
((hi(w_i) + hi(k_i)) mod 2**32)) modulo 2**64, i = 1..n within the piece, lo and hi the
32-bit halves, k the process key (`process_key`: PIECE_WORDS secret words drawn once per
process from the OS's random source, never written or returned). A range's last 1-7 bytes
(when its length is not a multiple of 8) are kept as bytes and compared exactly. The whole
check is one kernel over a table of (address, words) per piece, one element-wise comparison
against the baseline on the device and one host read of a bool: no per-span kernel, no
Python per span. Cost: one pass over the bytes at memory speed (the key, 2 MiB, is read by
every piece: it stays in the L2 cache).

What it sees, per piece: any change confined to one word (s1 changes by d != 0), with
certainty; any other change, crafted or not, unless it keeps NH's value, which without the
key happens with probability at most 2**-32 (NH is 2**-32-almost-universal; the linear
sums this replaced could be kept constant by a change of three words, docs/contracts.md
§1.4).

Loads are two words wide when every piece starts on 16 bytes (the usual case: allocations
are 512-byte aligned), one word wide otherwise.

Availability: Triton with a CUDA device, or Triton's CPU interpreter (TRITON_INTERPRET=1,
for tests). Anything else raises `Unavailable` and the caller checks eagerly. Every new
check compares a sample of its pieces against the same sums computed by torch before it is
trusted (`SpanCheck.baseline`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

from worker_ext.rawmem import raw_bytes

PIECE_WORDS = 1 << 18  # 2 MiB per program: enough pieces to fill the GPU, few to compare
BLOCK = 2048  # words per loop step in one program
NUM_WARPS = 8
SAMPLE = 8  # pieces cross-checked against torch when a check is built
DIFFERING_KEPT = 64  # differing pieces a mismatch keeps the address and baseline of
_MASK = (1 << 64) - 1
_KERNELS: dict[bool, Any] = {}  # interpreted? -> the jitted kernel
_LO = 0xFFFFFFFF
KEY_WORDS = 1 << 18  # the key's length: at least PIECE_WORDS (a piece's word i reads key[i])
_KEY_LOCK = threading.Lock()
_KEY: dict[str, Any] = {}  # "host": the key's words (CPU int64); str(device): a copy there


def process_key(device: Any) -> Any:
    """The NH key (KEY_WORDS int64 words) on `device`: drawn once per process from
    os.urandom, copied to each device on first use. Only this process ever holds it."""
    dev = str(torch.device(device))
    with _KEY_LOCK:
        hit = _KEY.get(dev)
        if hit is None:
            host = _KEY.get("cpu")
            if host is None:
                raw = bytearray(os.urandom(KEY_WORDS * 8))
                host = _KEY["cpu"] = torch.frombuffer(raw, dtype=torch.int64)
            hit = _KEY[dev] = host if dev == "cpu" else host.to(dev)
    return hit


def _halves(t: Any) -> Any:
    """The 32-bit halves of contiguous int64 words, as an int32 view (..., n, 2)."""
    return t.view(torch.int32).unflatten(-1, (-1, 2))


def nh_terms(words: Any, key: Any) -> Any:
    """NH's terms of contiguous int64 `words` against `key` (as long, or broadcast to it),
    as int64: ((lo(w) + lo(k)) mod 2**32) * ((hi(w) + hi(k)) mod 2**32), wrapping modulo
    2**64. Each sum is one int32 add (it wraps modulo 2**32) written into the low half of
    a zeroed int64: on CPU a third of the time of masking int64 values."""
    shape = torch.broadcast_shapes(words.shape, key.shape)
    a = torch.zeros(shape, dtype=torch.int64, device=words.device)
    b = torch.zeros_like(a)
    w, k = _halves(words), _halves(key)
    torch.add(w[..., 0], k[..., 0], out=_halves(a)[..., 0])
    torch.add(w[..., 1], k[..., 1], out=_halves(b)[..., 0])
    return a.mul_(b)


class Unavailable(RuntimeError):
    """This check cannot run here (no Triton, no CUDA, an unaligned range)."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip() == "1"


tl: Any = None  # triton.language, bound on first use (the kernel reads it as a global)


# Only the constexprs are annotated: Triton's compiler reads annotations, and may name only
# its own globals in them.
def _piece_sums(ptrs, nwords, key, out, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):  # type: ignore[no-untyped-def]
    """Program `pid`: (s1, NH) of the `nwords[pid]` int64 words at address `ptrs[pid]`,
    word i keyed by key[i]. NH's product is one 32x32->64 multiply per word."""
    pid = tl.program_id(0)
    base = tl.load(ptrs + pid).to(tl.pointer_type(tl.int64))
    if ALIGNED:  # every piece starts on 16 bytes: two words per load
        base = tl.multiple_of(base, 16)
    n = tl.load(nwords + pid)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    acc1 = tl.zeros([BLOCK], dtype=tl.int64)
    acc2 = tl.zeros([BLOCK], dtype=tl.int64)
    full = n // BLOCK * BLOCK
    for start in range(0, full, BLOCK):  # whole blocks: unmasked, so loads can be wide
        idx = start + offs
        v = tl.load(base + idx)
        k = tl.load(key + idx)
        acc1 += v
        a = v.to(tl.uint32) + k.to(tl.uint32)  # wraps modulo 2**32
        b = (v >> 32).to(tl.uint32) + (k >> 32).to(tl.uint32)
        acc2 += (a.to(tl.uint64) * b.to(tl.uint64)).to(tl.int64, bitcast=True)
    idx = full + offs  # the rest, masked (no-op when n is a multiple of BLOCK)
    m = idx < n
    v = tl.load(base + idx, mask=m, other=0)
    k = tl.load(key + idx, mask=m, other=0)  # a masked word's term is 0 * 0
    acc1 += v
    a = v.to(tl.uint32) + k.to(tl.uint32)
    b = (v >> 32).to(tl.uint32) + (k >> 32).to(tl.uint32)
    acc2 += (a.to(tl.uint64) * b.to(tl.uint64)).to(tl.int64, bitcast=True)
    tl.store(out + pid * 2, tl.sum(acc1, axis=0))
    tl.store(out + pid * 2 + 1, tl.sum(acc2, axis=0))


def _kernel() -> Any:
    """`_piece_sums` jitted, on first use (Triton is imported only then)."""
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
    _KERNELS[mode] = triton.jit(_piece_sums)
    return _KERNELS[mode]


def _reference(ptr: int, nwords: int, device: Any) -> tuple[int, int]:
    """(s1, NH) of one piece with torch, for the cross-check."""
    return piece_sums(raw_bytes(ptr, nwords * 8, device))


def piece_sums(data: Any) -> tuple[int, int]:
    """(s1, NH) of one piece's bytes (a uint8 tensor of whole words, at most PIECE_WORDS of
    them, on any device), with torch: what the kernel writes for a piece of these bytes,
    wherever they lie (a piece's word i is keyed by key[i] whatever its address)."""
    v = data.view(torch.int64)
    nh = nh_terms(v, process_key(data.device)[: int(v.numel())]).sum()
    s1, s2 = torch.stack((v.sum(), nh)).cpu().tolist()
    return int(s1) & _MASK, int(s2) & _MASK


@dataclass(frozen=True)
class Values:
    """A check's values at one time, on its device: (s1, NH) per piece and the tail bytes.
    Each baseline has its own, so checks shared by several plans never mix them."""

    pieces: Any
    tail: Any


class SpanCheck:
    """Per-piece sums of fixed byte ranges on one device, in one launch.

    The caller keeps the memory of every range alive for the check's life (the plan's
    views do): the kernel reads raw addresses."""

    def __init__(self, ranges: list[tuple[int, int]], device: Any) -> None:
        device = torch.device(device)
        if PIECE_WORDS > KEY_WORDS:
            raise Unavailable(f"pieces of {PIECE_WORDS} words need a longer key")
        if device.type == "cpu" and not _interpreting():
            raise Unavailable("CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")
        if device.type not in ("cuda", "cpu"):
            raise Unavailable(f"no kernel for {device}")
        self.device = device
        self._kernel = _kernel()
        ptrs: list[int] = []
        nwords: list[int] = []
        self.owner: list[int] = []  # piece -> range index
        tails: list[Any] = []
        self.tail_owner: list[int] = []  # tail byte -> range index
        for r, (ptr, n) in enumerate(ranges):
            if ptr % 8:
                raise Unavailable(f"range {r} at {ptr:#x} is not 8-byte aligned")
            words = n // 8
            for w in range(0, words, PIECE_WORDS):
                ptrs.append(ptr + 8 * w)
                nwords.append(min(PIECE_WORDS, words - w))
                self.owner.append(r)
            if n % 8:
                tails.append(raw_bytes(ptr + 8 * words, n % 8, device))
                self.tail_owner.extend([r] * (n % 8))
        self.aligned = all(p % 16 == 0 for p in ptrs)
        self.n_pieces = len(ptrs)
        self._ptrs_host = ptrs
        self._nwords_host = nwords
        # The address table stays on the host (pinned on CUDA) and goes to the device at
        # every run, into fresh memory, as does the output: a check kept across sleeps
        # holds no device state of its own that a run depends on but the process key.
        ptrs_h = torch.tensor(ptrs, dtype=torch.int64)
        nwords_h = torch.tensor(nwords, dtype=torch.int32)
        if device.type == "cuda":  # copied to the device without a host wait
            ptrs_h, nwords_h = ptrs_h.pin_memory(), nwords_h.pin_memory()
        self._ptrs_h, self._nwords_h = ptrs_h, nwords_h
        self._key = process_key(device)
        self._tails = tails
        self._base: Values | None = None  # the last baseline (differing's default)
        self.last_recheck: dict[str, Any] | None = None  # differing's evidence on a mismatch
        # the pieces still differing at differing's second read, at most DIFFERING_KEPT:
        # (address, bytes, baseline s1, baseline s2) each, for a look at where they came from
        self.last_differing: list[tuple[int, int, int, int]] = []

    def _sync(self, device_wide: bool) -> None:
        """Wait (CUDA; nothing on CPU) for what is queued on the current stream, or with
        `device_wide` on every stream of the check's device."""
        if self.device.type != "cuda":
            return
        if device_wide:
            torch.cuda.synchronize(self.device)
        else:
            torch.cuda.current_stream(self.device).synchronize()

    def _run(self) -> tuple[Any, Any]:
        """One launch over every piece, queued on the current stream: (out, tail), both
        new tensors (out: (s1, NH) per piece; tail: the ranges' last bytes, or None)."""
        out = torch.zeros((max(1, self.n_pieces), 2), dtype=torch.int64, device=self.device)
        if self.n_pieces:
            grid = (self.n_pieces,)
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    ptrs = self._ptrs_h.to(self.device, non_blocking=True)
                    nwords = self._nwords_h.to(self.device, non_blocking=True)
                    self._kernel[grid](
                        ptrs,
                        nwords,
                        self._key,
                        out,
                        BLOCK=BLOCK,
                        ALIGNED=self.aligned,
                        num_warps=NUM_WARPS,
                    )
            else:
                self._kernel[grid](
                    self._ptrs_h,
                    self._nwords_h,
                    self._key,
                    out,
                    BLOCK=BLOCK,
                    ALIGNED=self.aligned,
                )
        tail = torch.cat(self._tails) if self._tails else None
        return out, tail

    def sums(self) -> list[tuple[int, int]]:
        """(s1, s2) per piece now, on the host (tests and the cross-check)."""
        out, _ = self._run()
        rows = out[: self.n_pieces].cpu().tolist()
        return [(int(a) & _MASK, int(b) & _MASK) for a, b in rows]

    def baseline(self, prove: bool = True) -> Values:
        """Take values later checks compare against (kept as the default for `differing`,
        and returned). With `prove` (a new check), a sample of pieces (first, last, the
        shortest, spread between) is first proven equal to torch's sums of them. Either
        way the run starts after what is queued on the current stream is done (a host wait,
        where the cross-check made one before the baseline's run: not device-wide, so a
        fused sleep's copies on their own streams go on): a check reused for these ranges
        (fingerprint's reuse) skips the table build and the proof, not that wait."""
        self._sync(device_wide=False)
        out, tail = self._run()
        if prove and self.n_pieces:
            rows = out[: self.n_pieces].cpu().tolist()
            got = [(int(a) & _MASK, int(b) & _MASK) for a, b in rows]
            shortest = min(range(self.n_pieces), key=self._nwords_host.__getitem__)
            picks = {0, self.n_pieces - 1, shortest}
            step = max(1, self.n_pieces // SAMPLE)
            picks.update(range(0, self.n_pieces, step))
            for i in sorted(picks)[: SAMPLE + 3]:
                want = _reference(self._ptrs_host[i], self._nwords_host[i], self.device)
                if got[i] != want:
                    raise Unavailable(f"kernel piece {i} gave {got[i]}, torch {want}")
        self._base = Values(out, tail)  # both new tensors on every run
        return self._base

    def _compare(self, base: Values) -> tuple[list[int], Any, Any]:
        """(differing ranges, differing piece indices, the run's values): one run, one
        host sync."""
        out, tail = self._run()
        diff = torch.ne(out, base.pieces).any(dim=1)
        flag = diff.any()
        tdiff = None
        if tail is not None:
            tdiff = torch.ne(tail, base.tail)
            flag = flag | tdiff.any()
        if not bool(flag):  # the one host sync
            return [], [], out
        pieces = [i for i in diff.nonzero().flatten().tolist() if i < self.n_pieces]
        bad = {self.owner[i] for i in pieces}
        if tdiff is not None:
            bad.update(self.tail_owner[i] for i in tdiff.nonzero().flatten().tolist())
        return sorted(bad), pieces, out

    def differing(self, base: Values | None = None) -> list[int]:
        """Indices of the ranges whose bytes differ from `base` (default: the last
        baseline), in one host sync when they all agree. The run starts after every stream
        of the device is done (whatever its caller waited for). A mismatch is read again
        after another device-wide wait, with torch's sums of its first differing piece;
        only what still differs then is returned, and `last_recheck` says what was seen
        (a difference gone on the second read means bytes still being written at the first:
        a missing wait, reported, never the bytes' fault)."""
        base = self._base if base is None else base
        if base is None:
            raise RuntimeError("SpanCheck.differing before baseline")
        self.last_recheck = None
        self.last_differing = []
        self._sync(device_wide=True)
        first, pieces, _ = self._compare(base)
        if not first:
            return []
        self._sync(device_wide=True)
        again, pieces2, out2 = self._compare(base)
        evidence: dict[str, Any] = {
            "first_read": first,
            "second_read": again,
            "pieces_differing": len(pieces),
            "pieces_differing_again": len(pieces2),
            "pieces_by_range": {
                r: [sum(1 for i in pieces2 if self.owner[i] == r), self.owner.count(r)]
                for r in again
            },
        }
        if pieces2:
            kept = pieces2[:DIFFERING_KEPT]
            rows = base.pieces[torch.tensor(kept, device=base.pieces.device)].cpu().tolist()
            self.last_differing = [
                (self._ptrs_host[i], 8 * self._nwords_host[i], int(a) & _MASK, int(b) & _MASK)
                for i, (a, b) in zip(kept, rows, strict=True)
            ]
            i = pieces2[0]
            evidence["piece"] = i
            evidence["piece_baseline"] = [int(v) & _MASK for v in base.pieces[i].tolist()]
            evidence["piece_kernel_now"] = [int(v) & _MASK for v in out2[i].tolist()]
            try:
                torch_now = _reference(self._ptrs_host[i], self._nwords_host[i], self.device)
                evidence["piece_torch_now"] = list(torch_now)
            except Exception as e:  # evidence only
                evidence["piece_torch_now"] = f"{type(e).__name__}: {e}"
        self.last_recheck = evidence
        return again


def warm(device: Any) -> dict[str, Any]:
    """Compile the kernel and prove it on `device` now (a few KiB), so that the first
    prepare does not pay Triton's compile: {"ok", "s", "error"}; never raises."""
    import time

    t = time.perf_counter()
    try:
        buf = torch.arange(3 * BLOCK + 5, dtype=torch.int64, device=device)
        ptr, n = int(buf.data_ptr()), int(buf.numel()) * 8
        for start in (ptr, ptr + 8):  # both variants: 16-byte aligned and not
            check = SpanCheck([(start, ptr + n - 3 - start)], buf.device)
            check.baseline()
            if check.differing():
                raise Unavailable("the warm-up check moved with nothing written")
    except Exception as e:
        return {"ok": False, "s": time.perf_counter() - t, "error": f"{type(e).__name__}: {e}"}
    return {"ok": True, "s": time.perf_counter() - t, "error": None}
