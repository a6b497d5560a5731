"""Protect at-risk tensors across a sleep and prove bit for bit that everything came back.

Fingerprints (worker_ext.fingerprint) are taken of every non-KV storage at prepare and
again at verify, all tensors in one batch per device with one host transfer; verification
is an exact comparison of those fingerprints. Verify reads byte-adjacent storages as one
span each and names the differing tensors from per-storage baselines only on a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from worker_ext.fingerprint import Baseline, Plan, fingerprint, storage_bytes
from worker_ext.ownership import TensorRecord, storage_key

__all__ = ["Snapshot", "fingerprint", "prepare", "rebind", "restore", "storage_bytes", "verify"]


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
    plan: Plan | None = None  # fingerprints the entries' original storages, in order
    baseline: Baseline | None = None  # the plan's values at prepare

    @property
    def protected(self) -> list[_Entry]:
        return [e for e in self.entries if e.backup is not None]


def prepare(level: int, records: list[TensorRecord], at_risk: set[str], pin: bool) -> Snapshot:
    """Fingerprint every record but the KV cache; copy the at-risk ones to host memory."""
    snap = Snapshot(level)
    kept = [rec for rec in records if not rec.is_kv]
    aliases = [rec.tensor.detach() for rec in kept]
    plan = Plan(aliases)
    base = plan.baseline()
    fps = plan.per_tensor(base)
    for rec, alias, fp in zip(kept, aliases, fps, strict=True):
        t = rec.tensor
        entry = _Entry(
            record=rec,
            original=t,
            alias=alias,
            slot_values=[s.get() for s in rec.slots],
            fp=fp,
        )
        if rec.name in at_risk:
            raw = storage_bytes(t)
            backup = torch.empty(raw.numel(), dtype=torch.uint8, pin_memory=pin)
            backup.copy_(raw, non_blocking=pin)
            entry.backup = backup
        snap.entries.append(entry)
    snap.plan = plan
    snap.baseline = base
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
    """Copy the at-risk bytes back into their own storage (same data_ptr), then wait for
    every copy on the device (the backend's resume copies included)."""
    n = 0
    for e in snap.protected:
        raw = storage_bytes(e.alias)
        if raw.numel() != e.backup.numel():
            raise RuntimeError(
                f"{e.record.name}: storage is {raw.numel()} bytes, backup {e.backup.numel()}"
            )
        raw.copy_(e.backup, non_blocking=True)
        n += 1
    # Device-wide: the backend's copy streams (resumed weights) and these copies are done
    # before anything, on any stream, reads the restored bytes; verify relies on it.
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return n


def verify(snap: Snapshot) -> tuple[int, list[str]]:
    """(count checked, names whose bytes differ from prepare time)."""
    if snap.plan is None or snap.baseline is None:
        now = Plan([e.alias for e in snap.entries], coalesce=False).run()
        bad = [i for i, (e, fp) in enumerate(zip(snap.entries, now, strict=True)) if fp != e.fp]
    else:
        bad = snap.plan.changed(snap.baseline)
    return len(snap.entries), [snap.entries[i].record.name for i in bad]
