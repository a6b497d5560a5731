"""Bit-exact, keyed fingerprints of many tensors' storages, computed on their device in one batch.

A fingerprint is (nbytes, s1, s2) of the bytes of a tensor's whole storage (all aliases,
any view offset, contiguous or not):

- the storage is read as int64 words, cut into pieces of PIECE_WORDS words (the last one
  shorter); the bytes that are no whole word (a 1-7 byte tail, or all of an unaligned
  storage) are taken one word per byte, in pieces of their own;
- s1 = the sum of all those values modulo 2**64: any change confined to one word (one
  flipped bit of any element of any dtype) changes it, with certainty;
- s2 = BLAKE2b (8 bytes) of the pieces' NH values in order (0 for no bytes), NH as in
  `fpkernel` with the process key (`fpkernel.process_key`, a secret drawn once per
  process): a change of any
  kind (swapped words or rows, several values changed so that linear sums stay equal)
  keeps a piece's NH with probability at most 2**-32 for whoever does not hold the key
  (docs/contracts.md §1.4, the threat model).

Values depend on the process key, so they compare only within one process (a sleep and
its wake), which is all verify needs.

Spans (the eager check, `Plan.baseline` / `Plan.changed`): storages that are byte-adjacent
on one device (one ends exactly where the next begins, as the caching allocator packs a
model's weights) are fingerprinted together as one span, read through one raw view, so a
model's ~550 tensors cost a few dozen reductions instead of one each. A span holds only
storage bytes (a gap of allocator free space ends it). A span that differs from its
baseline is re-checked storage by storage, against per-storage baselines taken at the same
time, to name the tensors; that happens only on a mismatch. The kernel (below) needs
neither: it reads each storage as its own range, so what differs is named at once, and
the baseline reads the bytes it covers once (a per-storage eager pass over every byte was
most of a prepare's time under a sleep's copies: docs/benchmarks-log.md).

Cost on a GPU: a few kernels per span (or storage) with whole pieces, a handful for the
short pieces of the whole batch, and one device-to-host copy of the NH values; no
per-tensor sync.

Kernel (a plan's `kernel`, the worker's HOTSWAP_VERIFY_KERNEL: `auto`, the default, on
CUDA; `on` also on CPU under Triton's interpreter; `off` never): `Plan.baseline` builds a
`fpkernel.SpanCheck` over the storages of the CUDA device that holds most of the bytes
(storages elsewhere, e.g. a runner's CPU tensors, and those that do not start on 8 bytes,
keep the eager check, by span), and `Plan.changed` runs it: one Triton launch over all those
storages in 2 MiB pieces, each piece's (s1, NH) compared on the device, one bool to the
host, about one memory pass. The check is cross-checked against torch on a sample of
pieces when built; if Triton is missing or anything about the kernel fails, the eager
span check runs instead (`kernel_error` says why). The plan's storages keep their
addresses across sleep/wake (in-place restore), so the kernel's address table stays valid
for the plan's life; a check once built and proven is kept for its ranges (device,
address and length of each, in order), and a later plan over exactly those ranges reuses
it (`kernel_reused`): no table to build, no cross-check with its host syncs, but the bytes
are read again for every baseline (each baseline holds its own values).
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from worker_ext import fpkernel
from worker_ext.fpkernel import SpanCheck, Values, nh_terms, process_key
from worker_ext.rawmem import raw_bytes

PIECE_WORDS = 1 << 15  # 256 KiB pieces: each one NH value to the host (a 16 GB span: 64K)
CHUNK_PIECES = 64  # whole pieces reduced per step: NH's temporaries stay at 16 MiB each
log = logging.getLogger(__name__)
_WARNED: set[str] = set()
_MASK = (1 << 64) - 1
_LAYOUTS: OrderedDict[tuple[Any, ...], tuple[Any, Any, Any]] = OrderedDict()
_MAX_LAYOUTS = 8  # prepare and verify share them; a few models or levels share the cache
# Kernel checks already built and proven, by (device, piece size, ranges): a prepare over
# the same ranges as an earlier one (the weights keep their addresses across sleeps) reuses
# the address table and its proof, and reads the bytes again for its own baseline.
_CHECKS: OrderedDict[tuple[Any, ...], SpanCheck] = OrderedDict()
_MAX_CHECKS = 4  # a level-1 and a level-2 plan, a kept KV cache's, the warm prepare's

Fp = tuple[int, int, int]


def storage_bytes(t: Any) -> Any:
    """A uint8 tensor over the whole storage of `t` (all aliases, any view offset)."""
    st = t.untyped_storage()
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    out.set_(st, 0, (st.nbytes(),), (1,))
    return out


class _Item:
    """One byte range as its pieces: whole pieces of words (one 2-D view) and short ones
    (the leftover words, the bytes that are no whole word), reduced at run time."""

    __slots__ = ("device", "full", "nbytes", "raw", "short")

    def __init__(self, raw: Any) -> None:
        n = int(raw.numel())
        self.raw = raw  # keeps the view (and so the storage it reads) alive
        self.nbytes = n
        self.device = raw.device
        self.full: Any = None  # (pieces, PIECE_WORDS) int64 view
        self.short: list[Any] = []  # 1-D pieces of at most PIECE_WORDS values
        aligned = raw.data_ptr() % 8 == 0
        nwords = n // 8 if aligned else 0
        if nwords:
            words = raw[: nwords * 8].view(torch.int64)
            k = nwords // PIECE_WORDS
            if k:
                self.full = words[: k * PIECE_WORDS].view(k, PIECE_WORDS)
            if k * PIECE_WORDS < nwords:
                self.short.append(words[k * PIECE_WORDS :])
        rest = raw[nwords * 8 :]  # uint8: widened at run time
        self.short += [rest[i : i + PIECE_WORDS] for i in range(0, int(rest.numel()), PIECE_WORDS)]

    @property
    def n_pieces(self) -> int:
        return (0 if self.full is None else int(self.full.shape[0])) + len(self.short)


def _layout(device: Any, lengths: list[int]) -> tuple[Any, Any, Any]:
    """(key index 0..k-1 within each short piece, start index, end index) on `device`."""
    key = (str(device), tuple(lengths))
    hit = _LAYOUTS.get(key)
    if hit is not None:
        _LAYOUTS.move_to_end(key)
        return hit
    lens = torch.tensor(lengths, dtype=torch.int64)
    ends = torch.cumsum(lens, 0)
    starts = ends - lens
    total = int(ends[-1]) if lengths else 0
    pos = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(starts, lens)
    out = (pos.to(device), starts.to(device), ends.to(device))
    _LAYOUTS[key] = out
    while len(_LAYOUTS) > _MAX_LAYOUTS:
        _LAYOUTS.popitem(last=False)
    return out


def _short_sums(shorts: list[Any], device: Any) -> Any:
    """(2, len(shorts)) int64: each short piece's sum and NH, in one batch (no host sync)."""
    layout = _layout(device, [int(v.numel()) for v in shorts])
    pos, starts, ends = layout
    seq = torch.cat([v if v.dtype == torch.int64 else v.to(torch.int64) for v in shorts])
    both = torch.stack((seq, nh_terms(seq, process_key(device)[pos])))
    scan = torch.cumsum(both, dim=1)  # wraps modulo 2**64, exact
    scan = torch.cat((torch.zeros((2, 1), dtype=torch.int64, device=device), scan), 1)
    return scan[:, ends] - scan[:, starts]


def _run_device(group: list[_Item], device: Any) -> list[tuple[int, int]]:
    """(s1, s2) per item of one device: one host transfer of every piece's sum and NH."""
    key = process_key(device)[:PIECE_WORDS]
    parts: list[Any] = []
    for it in group:
        for c in range(0, 0 if it.full is None else int(it.full.shape[0]), CHUNK_PIECES):
            rows = it.full[c : c + CHUNK_PIECES]
            parts.append(torch.stack((rows.sum(dim=1), nh_terms(rows, key).sum(dim=1))))
    shorts = [v for it in group for v in it.short]
    if shorts:
        parts.append(_short_sums(shorts, device))
    got = torch.cat(parts, dim=1).cpu() if parts else torch.zeros((2, 0), dtype=torch.int64)
    sums, nhs = got[0].tolist(), got[1].numpy()  # the one host sync
    out: list[tuple[int, int]] = []
    f = 0  # next whole piece's column
    s = sum(0 if it.full is None else int(it.full.shape[0]) for it in group)  # next short's
    for it in group:
        k = 0 if it.full is None else int(it.full.shape[0])
        n = len(it.short)
        blob = nhs[f : f + k].tobytes() + nhs[s : s + n].tobytes()
        s2 = int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little") if blob else 0
        out.append(((sum(sums[f : f + k]) + sum(sums[s : s + n])) & _MASK, s2))
        f, s = f + k, s + n
    return out


def _run_items(items: list[_Item]) -> list[Fp]:
    """(nbytes, s1, s2) per item: one batch (one host transfer) per device."""
    sums: list[tuple[int, int]] = [(0, 0)] * len(items)
    by_device: dict[str, list[int]] = {}
    for i, it in enumerate(items):
        by_device.setdefault(str(it.device), []).append(i)
    for dev, idx in by_device.items():
        group = [items[i] for i in idx]
        for i, pair in zip(idx, _run_device(group, torch.device(dev)), strict=True):
            sums[i] = pair
    return [(it.nbytes, s1, s2) for it, (s1, s2) in zip(items, sums, strict=True)]


DEFAULT_KERNEL = "auto"  # a plan's kernel mode when none is given (the worker passes its own)


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(msg)


@dataclass(frozen=True)
class Baseline:
    """What `Plan.changed` compares against, taken at one time: the kernel's values for the
    storages it covers, eager values for the spans of the rest, and their storages'."""

    spans: list[Fp]  # eager values of the spans in `rest` (all spans when rest is None)
    storages: Sequence[Fp | None]  # per storage; None for those `check` reads (it names them)
    check: SpanCheck | None = None
    covered: list[int] = field(default_factory=list)  # storage indices `check` reads, in order
    rest: list[int] | None = None  # span indices checked eagerly; None: all of them
    values: Values | None = None  # the check's values at this baseline (on its device)


class Plan:
    """Fingerprints of a fixed list of tensors; build once, run as often as needed.

    The plan holds views of the storages, so it keeps them alive and fingerprints exactly
    those storages on every run (whatever the tensors' slots point to by then)."""

    def __init__(
        self, tensors: list[Any], coalesce: bool = True, kernel: str | None = None
    ) -> None:
        self._kernel = DEFAULT_KERNEL if kernel is None else kernel
        self.kernel_error: str | None = None  # why the last baseline checks eagerly
        self.kernel_reused = False  # the last baseline's check was built by an earlier plan
        # what the kernel saw when `changed` found a mismatch (SpanCheck.last_recheck), the
        # ranges named by tensor; None when it saw none
        self.kernel_recheck: dict[str, Any] | None = None
        # the kernel's differing pieces at `changed`'s mismatch: (address, bytes, baseline
        # s1, s2) each (SpanCheck.last_differing); empty when it saw none
        self.kernel_differing: list[tuple[int, int, int, int]] = []
        self._index: list[int] = []  # tensor i -> its storage's item
        seen: dict[tuple[str, int, int], int] = {}
        self._items: list[_Item] = []
        addr: list[tuple[str, int, int]] = []  # (device, data_ptr, nbytes) per storage
        for t in tensors:
            st = t.untyped_storage()
            key = (str(t.device), int(st.data_ptr()), int(st.nbytes()))
            i = seen.get(key)
            if i is None:
                i = seen[key] = len(self._items)
                self._items.append(_Item(storage_bytes(t)))
                addr.append(key)
            self._index.append(i)
        self._tensors_of: list[list[int]] = [[] for _ in self._items]
        for ti, si in enumerate(self._index):
            self._tensors_of[si].append(ti)
        # spans: runs of byte-adjacent storages per device (singletons reuse their item)
        self._span_members: list[list[int]] = []
        self._span_items: list[_Item] = []
        order = sorted(range(len(addr)), key=lambda i: (addr[i][0], addr[i][1]))
        runs: list[list[int]] = []
        for i in order:
            dev, ptr, n = addr[i]
            if n == 0:
                runs.append([i])
                continue
            if coalesce and runs:
                last = runs[-1][-1]
                ldev, lptr, ln = addr[last]
                if ldev == dev and ln > 0 and lptr + ln == ptr:
                    runs[-1].append(i)
                    continue
            runs.append([i])
        for run in runs:
            item = self._items[run[0]]
            if len(run) > 1:
                _dev, ptr, _n = addr[run[0]]
                end = addr[run[-1]][1] + addr[run[-1]][2]
                try:
                    item = _Item(raw_bytes(ptr, end - ptr, item.device))
                except Exception:  # no raw view here: keep these storages apart
                    for i in run:
                        self._span_members.append([i])
                        self._span_items.append(self._items[i])
                    continue
            self._span_members.append(run)
            self._span_items.append(item)

    def __len__(self) -> int:
        return len(self._index)

    @property
    def n_storages(self) -> int:
        return len(self._items)

    @property
    def n_spans(self) -> int:
        return len(self._span_items)

    def run(self) -> list[Fp]:
        """(nbytes, s1, s2) of each tensor's storage, in the order given."""
        per_storage = _run_items(self._items)
        return [per_storage[i] for i in self._index]

    def run_spans(self) -> list[Fp]:
        """(nbytes, s1, s2) of each span (the fast check's values)."""
        return _run_items(self._span_items)

    def _kernel_check(self) -> tuple[SpanCheck, list[int], Values] | None:
        """A baselined Triton check over the storages of the device holding most of the
        bytes (a CUDA device; any device when the mode is `on`), each its own range, the
        storage indices it covers and its baseline values; None when everything is checked
        eagerly (`kernel_error` says why, if it failed). A check built and proven earlier
        for exactly these ranges is reused (`kernel_reused`): its values are taken anew."""
        self.kernel_reused = False
        if self._kernel == "off":
            return None
        by_device: dict[Any, list[int]] = {}
        for i, it in enumerate(self._items):
            aligned = int(it.raw.data_ptr()) % 8 == 0  # the kernel reads words
            if it.nbytes and aligned and (self._kernel == "on" or it.device.type == "cuda"):
                by_device.setdefault(it.device, []).append(i)
        if not by_device:
            return None
        device, covered = max(
            by_device.items(), key=lambda kv: sum(self._items[i].nbytes for i in kv[1])
        )
        ranges = tuple((int(self._items[i].raw.data_ptr()), self._items[i].nbytes) for i in covered)
        key = (str(device), fpkernel.PIECE_WORDS, ranges)
        check = _CHECKS.get(key)
        if check is not None:
            _CHECKS.move_to_end(key)
            self.kernel_reused = True
            return check, covered, check.baseline(prove=False)
        try:
            check = SpanCheck(list(ranges), device)
            values = check.baseline()
        except Exception as e:
            self.kernel_error = f"{type(e).__name__}: {e}"
            _warn_once("kernel", f"verify: Triton span check unavailable, checking eagerly: {e}")
            return None
        _CHECKS[key] = check
        while len(_CHECKS) > _MAX_CHECKS:
            _CHECKS.popitem(last=False)
        return check, covered, values

    def baseline(self) -> Baseline:
        """Fingerprints now, for `changed` to compare against: the kernel check (the plan's
        `kernel`) takes its own values of the storages it covers, once; the spans holding
        any storage it does not (other devices, empty or unaligned ones) are fingerprinted
        eagerly, with per-storage values of their storages to name them by."""
        self.kernel_error = None
        found = self._kernel_check()
        if found is None:
            return Baseline(self.run_spans(), _run_items(self._items))
        check, covered, values = found
        taken = set(covered)
        rest = [k for k, m in enumerate(self._span_members) if any(i not in taken for i in m)]
        spans = _run_items([self._span_items[k] for k in rest])
        eager = [i for k in rest for i in self._span_members[k]]
        storages: list[Fp | None] = [None] * len(self._items)
        for i, fp in zip(eager, _run_items([self._items[i] for i in eager]), strict=True):
            storages[i] = fp
        return Baseline(spans, storages, check, covered, rest, values)

    def per_tensor(self, base: Baseline) -> list[Fp | None]:
        """The baseline's fingerprint of each tensor's storage, in the order given (None
        where the kernel check holds it: its values are per piece, on the device)."""
        return [base.storages[i] for i in self._index]

    def changed(self, base: Baseline) -> list[int]:
        """Indices (in the order given) of the tensors whose storage bytes differ from
        `base`. The kernel's storages in one launch, each differing one named; the rest in
        one eager batch over their spans, where only a differing span is re-read storage by
        storage to name its tensors (all of them, if its storages all read equal again)."""
        out: set[int] = set()
        self.kernel_recheck = None
        self.kernel_differing = []
        if base.check is not None:
            for j in base.check.differing(base.values):
                out.update(self._tensors_of[base.covered[j]])
            seen = base.check.last_recheck
            if seen is not None:
                self.kernel_recheck = self._named(seen, base.covered)
                self.kernel_differing = list(base.check.last_differing)
        rest = list(range(len(self._span_items))) if base.rest is None else base.rest
        bad: list[int] = []
        if rest:
            now = _run_items([self._span_items[k] for k in rest])
            bad = [k for k, a, b in zip(rest, now, base.spans, strict=True) if a != b]
        if bad:
            storages = [i for k in bad for i in self._span_members[k]]
            again = _run_items([self._items[i] for i in storages])
            differ = {i for i, fp in zip(storages, again, strict=True) if fp != base.storages[i]}
            for k in bad:
                members = self._span_members[k]
                hit = [i for i in members if i in differ] or members
                for i in hit:
                    out.update(self._tensors_of[i])
        return sorted(out)

    def _named(self, seen: dict[str, Any], covered: list[int]) -> dict[str, Any]:
        """SpanCheck.last_recheck with each range as the index of its first tensor."""

        def tensor(r: int) -> int:
            return self._tensors_of[covered[r]][0]

        out = dict(seen)
        out["first_read"] = [tensor(r) for r in seen["first_read"]]
        out["second_read"] = [tensor(r) for r in seen["second_read"]]
        out["pieces_by_range"] = {tensor(r): v for r, v in seen["pieces_by_range"].items()}
        return out


def forget_checks() -> None:
    """Drop the kept kernel checks (tests; a process that frees what they cover for good)."""
    _CHECKS.clear()


def fingerprints(tensors: list[Any]) -> list[Fp]:
    """(nbytes, s1, s2) of each tensor's storage, one batch per device."""
    return Plan(tensors, coalesce=False).run()


def fingerprint(t: Any) -> Fp:
    """(nbytes, s1, s2) of the storage under `t`."""
    return fingerprints([t])[0]
