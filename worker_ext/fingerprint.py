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

Cost on a GPU: one reduction kernel per storage of ROW_WORDS words or more, a handful of
kernels for the whole batch, and one device-to-host copy; no per-tensor host sync.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

ROW_WORDS = 512  # 4 KiB rows of int64 words
_MASK = (1 << 64) - 1
_LAYOUTS: OrderedDict[tuple[Any, ...], tuple[Any, Any, Any]] = OrderedDict()
_MAX_LAYOUTS = 8  # prepare and verify share one; a few models or levels share the cache


def storage_bytes(t: Any) -> Any:
    """A uint8 tensor over the whole storage of `t` (all aliases, any view offset)."""
    st = t.untyped_storage()
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    out.set_(st, 0, (st.nbytes(),), (1,))
    return out


class _Item:
    """One storage split into device tensors whose values form its sequence v_1..v_k."""

    __slots__ = ("device", "length", "nbytes", "row_views", "word_views")

    def __init__(self, raw: Any) -> None:
        n = int(raw.numel())
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
    """(positions 1..k within each storage, start index, end index) on `device`, cached."""
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


class Plan:
    """Fingerprints of a fixed list of tensors; build once, run as often as needed.

    The plan holds views of the storages, so it keeps them alive and fingerprints exactly
    those storages on every run (whatever the tensors' slots point to by then)."""

    def __init__(self, tensors: list[Any]) -> None:
        self._index: list[int] = []  # tensor i -> its storage's item
        seen: dict[tuple[str, int, int], int] = {}
        self._items: list[_Item] = []
        for t in tensors:
            st = t.untyped_storage()
            key = (str(t.device), int(st.data_ptr()), int(st.nbytes()))
            i = seen.get(key)
            if i is None:
                i = seen[key] = len(self._items)
                self._items.append(_Item(storage_bytes(t)))
            self._index.append(i)
        self._by_device: dict[str, list[int]] = {}
        for i, item in enumerate(self._items):
            self._by_device.setdefault(str(item.device), []).append(i)

    def __len__(self) -> int:
        return len(self._index)

    def run(self) -> list[tuple[int, int, int]]:
        """(nbytes, s1, s2) per tensor, in the order given."""
        sums: list[tuple[int, int]] = [(0, 0)] * len(self._items)
        for dev, idx in self._by_device.items():
            items = [self._items[i] for i in idx]
            pieces = [v for it in items for v in it.values()]
            if not pieces:
                continue
            device = torch.device(dev)
            pos, starts, ends = _layout(device, [it.length for it in items])
            seq = torch.cat(pieces)
            both = torch.stack((seq, seq * pos))  # wraps modulo 2**64, exact
            scan = torch.cumsum(both, dim=1)
            scan = torch.cat((torch.zeros((2, 1), dtype=torch.int64, device=device), scan), 1)
            res = (scan[:, ends] - scan[:, starts]).cpu().tolist()  # the one host sync
            for j, i in enumerate(idx):
                sums[i] = (int(res[0][j]) & _MASK, int(res[1][j]) & _MASK)
        out: list[tuple[int, int, int]] = []
        for i in self._index:
            s1, s2 = sums[i]
            out.append((self._items[i].nbytes, s1, s2))
        return out


def fingerprints(tensors: list[Any]) -> list[tuple[int, int, int]]:
    """(nbytes, s1, s2) of each tensor's storage, one batch per device."""
    return Plan(tensors).run()


def fingerprint(t: Any) -> tuple[int, int, int]:
    """(nbytes, s1, s2) of the storage under `t`."""
    return fingerprints([t])[0]
