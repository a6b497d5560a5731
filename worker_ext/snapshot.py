"""Protect what a sleep loses and prove bit for bit that everything came back.

Two ways to protect, chosen by the caller (docs/contracts.md §1.2):
- by range (a `protect.Protection`, CUDA): every byte of a discarded pool the level's own
  mechanism does not bring back is copied to one pinned host buffer and, after the wake,
  written back at the same addresses; the bytes no named tensor holds are fingerprinted as
  ranges next to the named storages;
- by object (the at-risk names): each at-risk tensor's storage is copied and written back.

Fingerprints (worker_ext.fingerprint) are taken of every non-KV storage (and every unnamed
protected range) at prepare and again at verify, all in one batch per device with one host
transfer; verification is an exact comparison. Verify reads byte-adjacent storages as one
span each and names the differing tensors (or ranges) only on a mismatch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from worker_ext.fingerprint import Baseline, Plan, fingerprint, storage_bytes
from worker_ext.ownership import TensorRecord, storage_key
from worker_ext.protect import Protection
from worker_ext.rawmem import raw_bytes

__all__ = [
    "Snapshot",
    "differing_pieces",
    "fingerprint",
    "prepare",
    "rebind",
    "recheck",
    "restore",
    "storage_bytes",
    "verify",
]


@dataclass
class _Entry:
    record: TensorRecord
    original: Any  # the tensor object that sat in the first slot
    alias: Any  # a detached view that pins the original storage even if `.data` is swapped
    slot_values: list[Any]  # what each slot held at prepare time
    fp: tuple[int, int, int] | None  # None: the plan's kernel check holds it (verify uses the plan)
    backup: Any = None  # host copy of the storage bytes (at-risk only)


@dataclass
class _Range:
    start: int
    end: int
    pool: str
    view: Any  # uint8 device tensor over [start, end) (owns nothing)
    backup: Any = None  # host bytes (protected ranges only)


@dataclass
class Snapshot:
    level: int
    entries: list[_Entry] = field(default_factory=list)
    plan: Plan | None = None  # the entries' original storages, then the unnamed ranges
    baseline: Baseline | None = None  # the plan's values at prepare
    protection: Protection | None = None  # protection by range (None: by object)
    ranges: list[_Range] = field(default_factory=list)  # protected, written back
    unnamed: list[_Range] = field(default_factory=list)  # fingerprinted as ranges
    host: Any = None  # the one host buffer the protected ranges' backups slice
    # The KV cache kept across the sleep (docs/contracts.md §1.3): its storages' own plan,
    # so a sleep that falls back to discarding drops it without touching the rest.
    kv_names: list[str] = field(default_factory=list)
    kv_plan: Plan | None = None
    kv_baseline: Baseline | None = None
    kv_bytes: int = 0

    def forget_kv(self) -> None:
        """The KV cache is discarded after all: nothing of it is verified."""
        self.kv_names, self.kv_plan, self.kv_baseline, self.kv_bytes = [], None, None, 0

    @property
    def protected(self) -> list[_Entry]:
        return [e for e in self.entries if e.backup is not None]

    @property
    def protected_bytes(self) -> int:
        named = sum(int(e.backup.numel()) for e in self.protected)
        return named + sum(r.end - r.start for r in self.ranges)


def prepare(
    level: int,
    records: list[TensorRecord],
    at_risk: set[str],
    pin: bool,
    protection: Protection | None = None,
    device: Any = None,
    kernel: str | None = None,
    keep_kv: bool = False,
    copied: Callable[[], None] | None = None,
    steps: dict[str, float] | None = None,
) -> Snapshot:
    """Fingerprint every record but the KV cache; copy the at-risk ones to host memory, or
    with a `protection`, every protected range (on `device`) and fingerprint its unnamed
    ones. `kernel`: the fingerprint check's mode (fingerprint.Plan; None: its default).
    `keep_kv`: the KV cache's storages are fingerprinted too, in a plan of their own.
    `copied`: called once the protected ranges' copies are queued, before the fingerprints
    (hotswap_sleep queues the rest of the weights' copies then, behind these small ones).
    `steps`: filled with each step's seconds (snap_*_s), to place a slow prepare."""
    snap = Snapshot(level, protection=protection)
    clock = _Steps(steps)
    # The protected ranges first: their copies go to the copy engine before anything else
    # the caller queues there; nothing writes these bytes, so the order is free.
    if protection is not None and protection.protect:
        host = torch.empty(protection.protected_bytes, dtype=torch.uint8, pin_memory=pin)
        off = 0
        for s, e, pool in protection.protect:
            r = _Range(s, e, pool, raw_bytes(s, e - s, device), host[off : off + e - s])
            r.backup.copy_(r.view, non_blocking=pin)
            snap.ranges.append(r)
            off += e - s
        snap.host = host
    clock.step("snap_protect_s")
    if copied is not None:
        copied()
    clock.step("snap_copied_s")
    if keep_kv:
        kv = [rec for rec in records if rec.is_kv and rec.nbytes]
        snap.kv_names = [rec.name for rec in kv]
        snap.kv_plan = Plan([rec.tensor.detach() for rec in kv], kernel=kernel)
        snap.kv_baseline = snap.kv_plan.baseline()
        stores = {(st.data_ptr(), st.nbytes()) for st in (r.tensor.untyped_storage() for r in kv)}
        snap.kv_bytes = sum(int(n) for _, n in stores)
    kept = [rec for rec in records if not rec.is_kv]
    aliases = [rec.tensor.detach() for rec in kept]
    if protection is not None:
        snap.unnamed = [
            _Range(s, e, pool, raw_bytes(s, e - s, device)) for s, e, pool in protection.unnamed
        ]
    plan = Plan(aliases + [r.view for r in snap.unnamed], kernel=kernel)
    clock.step("snap_plan_s")
    base = plan.baseline()
    clock.step("snap_baseline_s")
    if steps is not None:  # 1.0: the kernel check was an earlier prepare's (not built here)
        steps["snap_check_reused"] = float(plan.kernel_reused)
    fps = plan.per_tensor(base)[: len(kept)]
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
        # This stream only (the fingerprints and the protected copies are queued on it): a
        # fused sleep's weight copies run on the backend's own streams meanwhile.
        torch.cuda.current_stream(device).synchronize()
    clock.step("snap_sync_s")
    return snap


class _Steps:
    """Seconds between successive marks, into `into` (nothing when it is None)."""

    def __init__(self, into: dict[str, float] | None) -> None:
        self._into = into
        self._t = time.perf_counter()

    def step(self, name: str) -> None:
        if self._into is not None:
            now = time.perf_counter()
            self._into[name] = now - self._t
            self._t = now


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
    for r in snap.ranges:  # the same addresses: CUDA maps the pools back in place
        r.view.copy_(r.backup, non_blocking=True)
        n += 1
    # Device-wide: the backend's copy streams (resumed weights) and these copies are done
    # before anything, on any stream, reads the restored bytes; verify relies on it.
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return n


def verify(snap: Snapshot) -> tuple[int, list[str], list[dict[str, Any]]]:
    """(count checked, names whose bytes differ from prepare time, the unnamed ranges that
    differ: address range, size, pool and nearest named tensor; each also in the names)."""
    if snap.plan is None or snap.baseline is None:
        now = Plan([e.alias for e in snap.entries], coalesce=False).run()
        bad = [i for i, (e, fp) in enumerate(zip(snap.entries, now, strict=True)) if fp != e.fp]
    else:
        bad = snap.plan.changed(snap.baseline)
    n = len(snap.entries)
    names = [snap.entries[i].record.name for i in bad if i < n]
    if snap.kv_plan is not None and snap.kv_baseline is not None:
        kv_bad = snap.kv_plan.changed(snap.kv_baseline)
        names += [f"{snap.kv_names[i]} (KV cache kept)" for i in kv_bad]
    ranges: list[dict[str, Any]] = []
    for i in bad:
        if i < n:
            continue
        r = snap.unnamed[i - n]
        if snap.protection is not None:
            d = snap.protection.describe((r.start, r.end), r.pool)
        else:
            d = {"start": r.start, "end": r.end, "bytes": r.end - r.start, "pool": r.pool}
            d["range"], d["nearest"] = f"{r.start:#x}-{r.end:#x}", None
        ranges.append(d)
        near = f", near {d['nearest']}" if d.get("nearest") else ""
        names.append(f"<unnamed {d['pool']} {d['range']} ({d['bytes']} bytes{near})>")
    return n + len(snap.unnamed) + len(snap.kv_names), names, ranges


def recheck(snap: Snapshot) -> dict[str, Any] | None:
    """What the last `verify`'s kernel check saw when it found a mismatch (its first read,
    its second after a device-wide wait, pieces and sums: fpkernel.SpanCheck.differing),
    tensors by name; None when it found none."""
    plans = [(snap.plan, None), (snap.kv_plan, snap.kv_names)]
    out: dict[str, Any] | None = None
    for plan, kv in plans:
        seen = plan.kernel_recheck if plan is not None else None
        if seen is None:
            continue

        def name(i: int, kv: list[str] | None = kv) -> str:
            if kv is not None:
                return f"{kv[i]} (KV cache kept)"
            if i < len(snap.entries):
                return snap.entries[i].record.name
            r = snap.unnamed[i - len(snap.entries)]
            return f"<unnamed {r.pool} {r.start:#x}-{r.end:#x}>"

        named = dict(seen)
        named["first_read"] = [name(i) for i in seen["first_read"]]
        named["second_read"] = [name(i) for i in seen["second_read"]]
        named["pieces_by_range"] = {name(i): v for i, v in seen["pieces_by_range"].items()}
        if out is None:
            out = named
        else:
            out["kv_cache"] = named
    return out


def differing_pieces(snap: Snapshot) -> list[tuple[int, int, int, int]]:
    """The pieces the last `verify`'s kernel check still saw differ (address, bytes,
    baseline s1, s2), its plans' in turn (the KV cache kept last); empty when it saw none."""
    out: list[tuple[int, int, int, int]] = []
    for plan in (snap.plan, snap.kv_plan):
        if plan is not None:
            out.extend(plan.kernel_differing)
    return out
