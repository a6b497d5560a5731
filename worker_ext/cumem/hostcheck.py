"""After a verify found bytes that differ from the prepare's fingerprints: does the host
copy the wake brought them back from still hold what the prepare fingerprinted?

Each differing piece of the verify's kernel check (address, bytes, baseline sums) is read
again from the host copy: a coded copy's pieces are copied to device scratch and decoded
there by the codec's own kernel, a raw copy's bytes are read as they are; the piece's sums
over those bytes (fpkernel.piece_sums: the kernel's sums wherever the bytes lie) are
compared with its baseline. Equal: the host copy is right and the wake wrote the device
wrong (its copies back, its decode in place, or something after them); different: the
sleep wrote the host copy wrong (docs/contracts.md §1.4, `host_copy_check`).

Only after a mismatch, bounded (at most MAX_DECODED coded pieces decoded, two held at a
time), read-only, and never raising: what it could not read is its `error`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from worker_ext import codec
from worker_ext.cudart import HostBuffer
from worker_ext.fpkernel import piece_sums
from worker_ext.rawmem import raw_bytes

Bad = tuple[int, int, int, int]  # a differing piece: address, bytes, baseline s1, s2
# The coded host copy: its codec, its plan and the host address its pieces lie at.
Coded = tuple[codec.GpuCodec, codec.Plan, int]
MAX_DECODED = 4  # coded pieces decoded into scratch (each of its raw size, 64 MiB by default)
MAX_ROWS = 4  # pieces described one by one
_CPU = torch.device("cpu")


@dataclass
class WokeFrom:
    """What the backend's last wake copied back from (a suspend starts a new one): the
    coded copy (codec, plan, the buffer it lies in) and each raw record's (host address,
    offset, size)."""

    coded: tuple[codec.GpuCodec, codec.Plan, HostBuffer] | None = None
    raw: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    def add(
        self,
        raw: Mapping[int, tuple[int, int, int]],
        gc: codec.GpuCodec | None,
        wq: codec.WakeQueue | None,
        host: HostBuffer | None,
    ) -> None:
        """One resume's copies: its raw records, and its coded ones if it decoded any."""
        self.raw.update(raw)
        if wq is not None and gc is not None and host is not None:
            self.coded = (gc, wq.plan, host)

    def check(
        self,
        bad: Sequence[Bad],
        device: Any,
        settle: Callable[[], None],
        live: Sequence[HostBuffer | None],
    ) -> dict[str, Any]:
        """`check` over what is still there once `settle` (the backend's wait for its
        copies) returns: a buffer released since, or pinned anew, counts as no copy
        (`live`: the backend's buffers now). Never raises."""
        try:
            settle()
            now = {b.ptr: b for b in live if b is not None and b.ptr}
            coded = None
            if self.coded is not None:
                gc, plan, buf = self.coded
                if buf.ptr and now.get(buf.ptr) is buf:
                    coded = (gc, plan, buf.ptr)
            raw = {p: e for p, e in self.raw.items() if e[0] in now}
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
            return {"pieces": 0, "error": err, "summary": f"not checked: {err}"}
        return check(bad, device, coded, raw)


class _Source:
    """Where the host copy of device bytes lies: the coded pieces (decoded on demand, the
    last two kept) and the raw records' layout."""

    def __init__(self, device: Any, coded: Coded | None, raw: Mapping[int, tuple[int, int, int]]):
        self.device = device
        self.coded = coded
        self.raw = sorted((ptr, base + off, n) for ptr, (base, off, n) in raw.items())
        self.decoded = 0
        self._cache: list[tuple[int, Any]] = []  # (piece index, its decoded bytes)
        self.spans: list[tuple[int, int, int]] = []  # (device start, end, coded piece index)
        if coded is not None:
            _gc, plan, _host = coded
            for j, p in enumerate(plan.pieces):
                start = plan.ranges[p.rng][0] + p.dev_off
                self.spans.append((start, start + p.raw_bytes, j))

    def _piece(self, j: int) -> Any:
        """Coded piece j decoded on the device (a uint8 tensor of its raw bytes)."""
        for k, t in self._cache:
            if k == j:
                return t
        assert self.coded is not None
        if self.decoded >= MAX_DECODED:
            raise _Budget
        gc, plan, host = self.coded
        p = plan.pieces[j]
        staged = raw_bytes(host + p.host_off, p.size, _CPU).to(self.device)
        out = torch.empty(p.raw_bytes, dtype=torch.uint8, device=self.device)
        gc.decode_to(staged, p.n_chunks, int(out.data_ptr()), p.raw_bytes)
        del staged
        self.decoded += 1
        self._cache = [*self._cache[-1:], (j, out)]
        return out

    def read(self, addr: int, n: int) -> Any | None:
        """The host copy of [addr, addr + n) on the device; None where no copy covers all
        of it."""
        parts: list[Any] = []
        at, end = addr, addr + n
        while at < end:
            part = self._coded_part(at, end)
            if part is None:
                part = self._raw_part(at, end)
            if part is None:
                return None
            parts.append(part)
            at += int(part.numel())
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _coded_part(self, at: int, end: int) -> Any | None:
        for start, stop, j in self.spans:
            if start <= at < stop:
                return self._piece(j)[at - start : min(end, stop) - start]
        return None

    def _raw_part(self, at: int, end: int) -> Any | None:
        for ptr, host, n in self.raw:
            if ptr <= at < ptr + n:
                m = min(end, ptr + n) - at
                return raw_bytes(host + (at - ptr), m, _CPU).to(self.device)
        return None


class _Budget(Exception):
    """MAX_DECODED coded pieces decoded: the rest is not checked."""


def check(
    bad: Sequence[Bad],
    device: Any,
    coded: Coded | None,
    raw: Mapping[int, tuple[int, int, int]],
) -> dict[str, Any]:
    """For each differing piece, whether the host copy holds its baseline's bytes; see the
    module's doc. `coded`: the weights' coded copy, or None; `raw`: device address -> (host
    buffer address, offset, bytes) of each record copied back raw. Never raises."""
    out: dict[str, Any] = {
        "pieces": 0,
        "host_good": 0,
        "host_bad": 0,
        "not_in_copy": 0,
        "equal_to_device": 0,
        "decoded": 0,
        "rows": [],
        "error": None,
    }
    try:
        src = _Source(torch.device(device), coded, raw)
        for addr, n, s1, s2 in bad:
            try:
                got = src.read(addr, n)
            except _Budget:
                break
            out["pieces"] += 1
            row: dict[str, Any] = {"address": f"{addr:#x}", "bytes": n}
            if got is None:
                out["not_in_copy"] += 1
                row["host"] = "none"
            else:
                good = piece_sums(got) == (s1, s2)
                now = raw_bytes(addr, n, src.device)
                same = bool(torch.equal(got, now))
                out["host_good" if good else "host_bad"] += 1
                out["equal_to_device"] += int(same)
                row["host"] = "baseline" if good else "differs"
                row["equal_to_device"] = same
                if not same:
                    row.update(_diff(got, now))
            if len(out["rows"]) < MAX_ROWS:
                out["rows"].append(row)
        out["decoded"] = src.decoded
        del src  # its decoded pieces: the device's scratch goes back to the driver
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    except Exception as e:  # a look after the fact: it reports, it never fails the verify
        out["error"] = f"{type(e).__name__}: {e}"
    out["summary"] = summary(out)
    return out


def _diff(a: Any, b: Any) -> dict[str, Any]:
    """Where two byte runs of even length differ, as 16-bit words: how many differ and the
    bits they differ in (bf16: 0x7f80 the exponent only, the codec's escapes; 0x807f the
    sign and mantissa only; 0xffff anything)."""
    x = a.view(torch.int16) ^ b.view(torch.int16)
    bits = sum(1 << k for k in range(16) if bool(((x >> k) & 1).any()))
    return {"words_differing": int((x != 0).sum()), "bits_differing": f"{bits:#06x}"}


def summary(res: Mapping[str, Any]) -> str:
    """One line for the rank's error."""
    n = res.get("pieces", 0)
    parts = [
        f"of {n} differing piece(s) the host copy holds the baseline in {res.get('host_good', 0)} "
        f"(the wake wrote them wrong) and not in {res.get('host_bad', 0)} (the sleep wrote "
        f"the host copy wrong)"
    ]
    if res.get("not_in_copy"):
        parts.append(f"{res['not_in_copy']} not in a host copy")
    parts.append(f"{res.get('equal_to_device', 0)} equal to the device's bytes now")
    row = next((r for r in res.get("rows", []) if "bits_differing" in r), None)
    if row is not None:
        parts.append(
            f"{row['address']}: {row['words_differing']} word(s) differ from the device's, "
            f"in bits {row['bits_differing']}"
        )
    if res.get("error"):
        parts.append(f"error: {res['error']}")
    return "; ".join(parts)
