"""Protect at-risk tensors across a sleep and prove bit for bit that everything came back.

Fingerprint: the storage's bytes viewed as int32 words w_0..w_{n-1} (a tail of 1-3 bytes
as extra words) reduced on the tensor's device to two int64 sums, modulo 2**64:

    s1 = sum(w_i)            s2 = sum((i + 1) * w_i)

- One changed word changes s1 by d = w' - w with 0 < |d| < 2**33, never a multiple of 2**64.
  Any single changed element (one bit of a bf16, one float32, one int64 half) changes at
  least one word; a change confined to one word is therefore always detected.
- Swapping two different words i < j keeps s1 but changes s2 by (j - i) * (w_i - w_j),
  nonzero and below 2**64 in magnitude while j - i < 2**31 (storages under 8 GiB).
The sums run chunk by chunk so the int64 temporaries stay bounded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from worker_ext.ownership import TensorRecord, storage_key

CHUNK_WORDS = 1 << 22  # 16 MiB of int32 per step: 32 MiB of int64 temporaries
_MASK = (1 << 64) - 1
_positions: dict[tuple[str, int], Any] = {}


def _pos(device: Any, n: int) -> Any:
    key = (str(device), n)
    p = _positions.get(key)
    if p is None:
        p = torch.arange(1, n + 1, dtype=torch.int64, device=device)
        _positions[key] = p
    return p


def storage_bytes(t: Any) -> Any:
    """A uint8 tensor over the whole storage of `t` (all aliases, any view offset)."""
    st = t.untyped_storage()
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    out.set_(st, 0, (st.nbytes(),), (1,))
    return out


def fingerprint(t: Any) -> tuple[int, int, int]:
    """(nbytes, s1, s2) of the storage under `t`."""
    raw = storage_bytes(t)
    n = raw.numel()
    nwords = n // 4
    s1 = torch.zeros((), dtype=torch.int64, device=raw.device)
    s2 = torch.zeros((), dtype=torch.int64, device=raw.device)
    if nwords:
        words = raw[: nwords * 4].view(torch.int32)
        for a in range(0, nwords, CHUNK_WORDS):
            w = words[a : a + CHUNK_WORDS].to(torch.int64)
            ws = w.sum()
            s1 += ws
            # sum((a + j + 1) * w_j) = a * sum(w) + sum((j + 1) * w_j)
            s2 += ws * a + (w * _pos(raw.device, w.numel())).sum()
    if n % 4:
        tail = raw[nwords * 4 :].to(torch.int64)
        s1 += tail.sum()
        s2 += (tail * (_pos(raw.device, tail.numel()) + nwords)).sum()
    return n, int(s1.item()) & _MASK, int(s2.item()) & _MASK


@dataclass
class _Entry:
    record: TensorRecord
    original: Any  # the tensor object that sat in the first slot
    alias: Any  # a detached view that pins the original storage even if `.data` is swapped
    slot_values: list[Any]  # what each slot held at prepare time
    fp: tuple[int, int, int]
    backup: Any = None  # host copy of the storage bytes (at-risk only)


@dataclass
class Snapshot:
    level: int
    entries: list[_Entry] = field(default_factory=list)

    @property
    def protected(self) -> list[_Entry]:
        return [e for e in self.entries if e.backup is not None]


def prepare(level: int, records: list[TensorRecord], at_risk: set[str], pin: bool) -> Snapshot:
    """Fingerprint every record but the KV cache; copy the at-risk ones to host memory."""
    snap = Snapshot(level)
    for rec in records:
        if rec.is_kv:
            continue
        t = rec.tensor
        entry = _Entry(
            record=rec,
            original=t,
            alias=t.detach(),
            slot_values=[s.get() for s in rec.slots],
            fp=fingerprint(t),
        )
        if rec.name in at_risk:
            raw = storage_bytes(t)
            backup = torch.empty(raw.numel(), dtype=torch.uint8, pin_memory=pin)
            backup.copy_(raw, non_blocking=pin)
            entry.backup = backup
        snap.entries.append(entry)
    if pin and torch.cuda.is_available():
        torch.cuda.synchronize()
    return snap


def rebind(snap: Snapshot) -> list[str]:
    """Put the original tensors back into every slot a reload pointed elsewhere.

    The new values are copied into the original storage first, so what the reload loaded
    survives while captured graphs keep reading the original addresses."""
    rebound: list[str] = []
    for e in snap.entries:
        key = storage_key(e.alias)
        changed = False
        for slot, before in zip(e.record.slots, e.slot_values, strict=True):
            cur = slot.get()
            if cur is before and (not isinstance(cur, torch.Tensor) or storage_key(cur) == key):
                continue
            if isinstance(cur, torch.Tensor) and cur.shape == e.alias.shape:
                with torch.no_grad():
                    e.alias.copy_(cur)
            if isinstance(before, torch.Tensor):
                if storage_key(before) != key:
                    before.data = e.alias
                slot.set(before)
            changed = True
        if changed:
            rebound.append(e.record.name)
    return rebound


def restore(snap: Snapshot) -> int:
    """Copy the at-risk bytes back into their own storage (same data_ptr)."""
    n = 0
    for e in snap.protected:
        raw = storage_bytes(e.alias)
        if raw.numel() != e.backup.numel():
            raise RuntimeError(
                f"{e.record.name}: storage is {raw.numel()} bytes, backup {e.backup.numel()}"
            )
        raw.copy_(e.backup, non_blocking=True)
        n += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return n


def verify(snap: Snapshot) -> tuple[int, list[str]]:
    """(count checked, names whose bytes differ from prepare time)."""
    mismatched = [e.record.name for e in snap.entries if fingerprint(e.alias) != e.fp]
    return len(snap.entries), mismatched
