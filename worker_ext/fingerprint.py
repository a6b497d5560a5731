"""Bit-exact fingerprints of many tensors' storages, computed on their device in one batch.

A fingerprint is (nbytes, s1, s2) of the bytes of a tensor's whole storage (all aliases,
any view offset, contiguous or not), all arithmetic modulo 2**64 (int64 wrap-around):

- the storage is read as int64 words (a 1-7 byte tail, or an unaligned storage, as one
  word per byte). Storages of at least ROW_WORDS words are first reduced row by row (rows
  of ROW_WORDS words: one memory pass, one kernel) and the leftover words are taken as
  they are; every tensor thus becomes a short sequence v_1..v_k of int64 values;
- s1 = sum(v_i), s2 = sum(i * v_i), for all tensors at once: the sequences are
  concatenated, scanned (cumsum) and cut at each tensor's bounds; one transfer to host.

What it detects:
- any change confined to one word (one flipped bit of any element of any dtype): that word
  changes by d != 0 mod 2**64, so its row sum and s1 change by d;
- two different rows (or leftover words, or tail bytes) swapped: s1 stays, s2 changes by
  (j - i) * (v_i - v_j), nonzero unless that product is a multiple of 2**64;
- a swap of two words inside one ROW_WORDS row of a large storage is NOT detected (the row
  sum is order-blind): restoring moves whole pages, never words inside a 4 KiB row.

Spans (the fast check, `Plan.baseline` / `Plan.changed`): storages that are byte-adjacent
on one device (one ends exactly where the next begins, as the caching allocator packs a
model's weights) are fingerprinted together as one span, read through one raw view, so a
model's ~550 tensors cost a few dozen reductions instead of one each. A span holds only
storage bytes (a gap of allocator free space ends it). A span that differs from its
baseline is re-checked storage by storage, against per-storage baselines taken at the same
time, to name the tensors; that happens only on a mismatch.

Cost on a GPU: one reduction kernel per span (or storage) of ROW_WORDS words or more, a
handful of kernels for the whole batch, and one device-to-host copy; no per-tensor sync.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

ROW_WORDS = 512  # 4 KiB rows of int64 words
_MASK = (1 << 64) - 1
_LAYOUTS: OrderedDict[tuple[Any, ...], tuple[Any, Any, Any]] = OrderedDict()
_MAX_LAYOUTS = 8  # prepare and verify share them; a few models or levels share the cache

Fp = tuple[int, int, int]


def storage_bytes(t: Any) -> Any:
    """A uint8 tensor over the whole storage of `t` (all aliases, any view offset)."""
    st = t.untyped_storage()
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    out.set_(st, 0, (st.nbytes(),), (1,))
    return out


class _CudaRange:
    """`__cuda_array_interface__` of `n` bytes at device address `ptr` (for torch.as_tensor)."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": "|u1",
            "strides": None,
            "data": (ptr, False),
            "version": 2,
        }


def raw_bytes(ptr: int, n: int, device: Any) -> Any:
    """A uint8 tensor over [ptr, ptr + n) on `device`; the caller keeps that memory alive."""
    if device.type == "cuda":
        out = torch.as_tensor(_CudaRange(ptr, n), device=device)
    elif device.type == "cpu":
        out = torch.frombuffer((ctypes.c_uint8 * n).from_address(ptr), dtype=torch.uint8)
    else:
        raise ValueError(f"no raw view on {device}")
    if int(out.data_ptr()) != ptr or int(out.numel()) != n or out.device != device:
        raise RuntimeError(f"raw view of {n} bytes at {ptr:#x} on {device} came out wrong")
    return out


class _Item:
    """One byte range split into device tensors whose values form its sequence v_1..v_k."""

    __slots__ = ("device", "length", "nbytes", "raw", "row_views", "word_views")

    def __init__(self, raw: Any) -> None:
        n = int(raw.numel())
        self.raw = raw  # keeps the view (and so the storage it reads) alive
        self.nbytes = n
        self.device = raw.device
        self.row_views: Any = None  # (rows, ROW_WORDS) int64 view, reduced at run time
        self.word_views: list[Any] = []  # 1-D int64 values taken as they are
        aligned = raw.data_ptr() % 8 == 0
        nwords = n // 8 if aligned else 0
        nrows = nwords // ROW_WORDS
        if nwords:
            words = raw[: nwords * 8].view(torch.int64)
            if nrows:
                self.row_views = words[: nrows * ROW_WORDS].view(nrows, ROW_WORDS)
            if nwords % ROW_WORDS:
                self.word_views.append(words[nrows * ROW_WORDS :])
        if n > nwords * 8:
            self.word_views.append(raw[nwords * 8 :])  # uint8: widened at run time
        self.length = nrows + sum(int(v.numel()) for v in self.word_views)

    def values(self) -> list[Any]:
        out: list[Any] = []
        if self.row_views is not None:
            out.append(torch.sum(self.row_views, dim=1))
        for v in self.word_views:
            out.append(v if v.dtype == torch.int64 else v.to(torch.int64))
        return out


def _layout(device: Any, lengths: list[int]) -> tuple[Any, Any, Any]:
    """(positions 1..k within each item, start index, end index) on `device`, cached."""
    key = (str(device), tuple(lengths))
    hit = _LAYOUTS.get(key)
    if hit is not None:
        _LAYOUTS.move_to_end(key)
        return hit
    lens = torch.tensor(lengths, dtype=torch.int64)
    ends = torch.cumsum(lens, 0)
    starts = ends - lens
    total = int(ends[-1]) if lengths else 0
    pos = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(starts, lens) + 1
    out = (pos.to(device), starts.to(device), ends.to(device))
    _LAYOUTS[key] = out
    while len(_LAYOUTS) > _MAX_LAYOUTS:
        _LAYOUTS.popitem(last=False)
    return out


def _run_items(items: list[_Item]) -> list[Fp]:
    """(nbytes, s1, s2) per item: one batch (one scan, one host transfer) per device."""
    sums: list[tuple[int, int]] = [(0, 0)] * len(items)
    by_device: dict[str, list[int]] = {}
    for i, it in enumerate(items):
        by_device.setdefault(str(it.device), []).append(i)
    for dev, idx in by_device.items():
        group = [items[i] for i in idx]
        pieces = [v for it in group for v in it.values()]
        if not pieces:
            continue
        device = torch.device(dev)
        pos, starts, ends = _layout(device, [it.length for it in group])
        seq = torch.cat(pieces)
        both = torch.stack((seq, seq * pos))  # wraps modulo 2**64, exact
        scan = torch.cumsum(both, dim=1)
        scan = torch.cat((torch.zeros((2, 1), dtype=torch.int64, device=device), scan), 1)
        res = (scan[:, ends] - scan[:, starts]).cpu().tolist()  # the one host sync
        for j, i in enumerate(idx):
            sums[i] = (int(res[0][j]) & _MASK, int(res[1][j]) & _MASK)
    return [(it.nbytes, s1, s2) for it, (s1, s2) in zip(items, sums, strict=True)]


@dataclass(frozen=True)
class Baseline:
    """What `Plan.changed` compares against: span and per-storage fingerprints, one time."""

    spans: list[Fp]
    storages: list[Fp]


class Plan:
    """Fingerprints of a fixed list of tensors; build once, run as often as needed.

    The plan holds views of the storages, so it keeps them alive and fingerprints exactly
    those storages on every run (whatever the tensors' slots point to by then)."""

    def __init__(self, tensors: list[Any], coalesce: bool = True) -> None:
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

    def baseline(self) -> Baseline:
        """Span and per-storage fingerprints now, for `changed` to compare against."""
        return Baseline(self.run_spans(), _run_items(self._items))

    def per_tensor(self, base: Baseline) -> list[Fp]:
        """The baseline's fingerprint of each tensor's storage, in the order given."""
        return [base.storages[i] for i in self._index]

    def changed(self, base: Baseline) -> list[int]:
        """Indices (in the order given) of the tensors whose storage bytes differ from
        `base`. One batch over the spans; only a differing span is re-read storage by
        storage to name its tensors (all of them, if its storages all read equal again)."""
        now = self.run_spans()
        bad = [k for k, (a, b) in enumerate(zip(now, base.spans, strict=True)) if a != b]
        if not bad:
            return []
        storages = [i for k in bad for i in self._span_members[k]]
        again = _run_items([self._items[i] for i in storages])
        differ = {i for i, fp in zip(storages, again, strict=True) if fp != base.storages[i]}
        out: set[int] = set()
        for k in bad:
            members = self._span_members[k]
            hit = [i for i in members if i in differ] or members
            for i in hit:
                out.update(self._tensors_of[i])
        return sorted(out)


def fingerprints(tensors: list[Any]) -> list[Fp]:
    """(nbytes, s1, s2) of each tensor's storage, one batch per device."""
    return Plan(tensors, coalesce=False).run()


def fingerprint(t: Any) -> Fp:
    """(nbytes, s1, s2) of the storage under `t`."""
    return fingerprints([t])[0]
