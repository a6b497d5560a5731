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

CUDA graph (HOTSWAP_VERIFY_GRAPH, default GRAPH_DEFAULT; CUDA only): `Plan.baseline`
captures the whole span check (row sums to the (2, n_spans) result) into one CUDA graph,
and `Plan.changed` replays it and makes one host copy. The plan's storages keep their
addresses across sleep/wake (in-place restore), so the graph stays valid for the plan's
life. In the graph, spans of at least BIG_ROW_WORDS words are read in 64 KiB rows first
(then 4 KiB rows, then words), so the graph's private pool stays small: a swap of two words
inside one 64 KiB row is not seen there (restoring moves whole 2 MiB pages). The graph's
values are checked against the same computation run eagerly at capture; any capture or
replay error falls back to that eager computation (logged once, kept in `graph_error`).
Off by default: on the one H200 run so far every capture fell back to eager (its reason
was not recorded then; `graph_error` now keeps it).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

ROW_WORDS = 512  # 4 KiB rows of int64 words
BIG_ROW_WORDS = 8192  # 64 KiB rows: the graph path's first pass over large spans
GRAPH_DEFAULT = False  # HOTSWAP_VERIFY_GRAPH when unset: off until a GPU run shows it works
log = logging.getLogger(__name__)
_WARNED: set[str] = set()
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

    def __init__(self, raw: Any, big_rows: bool = False) -> None:
        n = int(raw.numel())
        self.raw = raw  # keeps the view (and so the storage it reads) alive
        self.nbytes = n
        self.device = raw.device
        self.row_views: list[Any] = []  # (rows, width) int64 views, reduced at run time
        self.word_views: list[Any] = []  # 1-D int64 values taken as they are
        aligned = raw.data_ptr() % 8 == 0
        nwords = n // 8 if aligned else 0
        done = 0  # words covered by rows so far
        nrows = 0
        if nwords:
            words = raw[: nwords * 8].view(torch.int64)
            widths = (BIG_ROW_WORDS, ROW_WORDS) if big_rows else (ROW_WORDS,)
            for width in widths:
                k = (nwords - done) // width
                if k:
                    self.row_views.append(words[done : done + k * width].view(k, width))
                    done += k * width
                    nrows += k
            if done < nwords:
                self.word_views.append(words[done:])
        if n > nwords * 8:
            self.word_views.append(raw[nwords * 8 :])  # uint8: widened at run time
        self.length = nrows + sum(int(v.numel()) for v in self.word_views)

    def values(self) -> list[Any]:
        out: list[Any] = [torch.sum(rv, dim=1) for rv in self.row_views]
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


def _batch(group: list[_Item], layout: tuple[Any, Any, Any]) -> Any:
    """(2, len(group)) int64 device tensor of s1 and s2 per item (no host sync)."""
    pos, starts, ends = layout
    device = group[0].device
    seq = torch.cat([v for it in group for v in it.values()])
    both = torch.stack((seq, seq * pos))  # wraps modulo 2**64, exact
    scan = torch.cumsum(both, dim=1)
    scan = torch.cat((torch.zeros((2, 1), dtype=torch.int64, device=device), scan), 1)
    return scan[:, ends] - scan[:, starts]


def _sums(res: Any) -> list[tuple[int, int]]:
    """Host (s1, s2) pairs from a (2, n) int64 result."""
    rows = res.cpu().tolist()  # the one host sync
    return [(int(a) & _MASK, int(b) & _MASK) for a, b in zip(rows[0], rows[1], strict=True)]


def _run_items(items: list[_Item]) -> list[Fp]:
    """(nbytes, s1, s2) per item: one batch (one scan, one host transfer) per device."""
    sums: list[tuple[int, int]] = [(0, 0)] * len(items)
    by_device: dict[str, list[int]] = {}
    for i, it in enumerate(items):
        by_device.setdefault(str(it.device), []).append(i)
    for dev, idx in by_device.items():
        group = [items[i] for i in idx]
        if not any(it.length for it in group):
            continue
        layout = _layout(torch.device(dev), [it.length for it in group])
        for i, pair in zip(idx, _sums(_batch(group, layout)), strict=True):
            sums[i] = pair
    return [(it.nbytes, s1, s2) for it, (s1, s2) in zip(items, sums, strict=True)]


def graph_enabled() -> bool:
    """HOTSWAP_VERIFY_GRAPH (GRAPH_DEFAULT when unset): capture verify's span check into a
    CUDA graph."""
    raw = os.environ.get("HOTSWAP_VERIFY_GRAPH")
    if raw is None:
        return GRAPH_DEFAULT
    return raw.strip().lower() not in ("0", "false", "no", "off", "")


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(msg)


class _SpanGraph:
    """The span check of `items` (one CUDA device) captured as one CUDA graph."""

    def __init__(self, items: list[_Item]) -> None:
        device = items[0].device
        lengths = [it.length for it in items]
        # every index/position tensor exists before capture; the graph keeps them alive
        lens = torch.tensor(lengths, dtype=torch.int64)
        ends = torch.cumsum(lens, 0)
        starts = ends - lens
        total = int(ends[-1])
        pos = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(starts, lens) + 1
        self.layout = (pos.to(device), starts.to(device), ends.to(device))
        self.items = items
        self.index_bytes = sum(int(t.numel()) * 8 for t in self.layout)
        with torch.cuda.device(device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up on a side stream, as torch's docs ask
                self.eager = _sums(_batch(items, self.layout))
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # what graph capture does first anyway: a clean baseline
            reserved = torch.cuda.memory_reserved(device)
            allocated = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: cumem.py's pinning threads may call CUDA during the capture
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.out = _batch(items, self.layout)
            # segments made for the graph's private pool, and the peak it held in capture
            self.pool_bytes = torch.cuda.memory_reserved(device) - reserved
            self.peak_bytes = torch.cuda.max_memory_allocated(device) - allocated

    def run(self) -> list[tuple[int, int]]:
        self.graph.replay()
        return _sums(self.out)


@dataclass(frozen=True)
class Baseline:
    """What `Plan.changed` compares against: span and per-storage fingerprints, one time."""

    spans: list[Fp]
    storages: list[Fp]


class Plan:
    """Fingerprints of a fixed list of tensors; build once, run as often as needed.

    The plan holds views of the storages, so it keeps them alive and fingerprints exactly
    those storages on every run (whatever the tensors' slots point to by then)."""

    def __init__(
        self, tensors: list[Any], coalesce: bool = True, graph: bool | None = None
    ) -> None:
        self._want_graph = graph_enabled() if graph is None else graph
        self._graph: _SpanGraph | None = None
        self.graph_error: str | None = None  # why the last capture or replay fell back
        self._check_items: list[_Item] | None = None  # what `changed` reads (graph layout)
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

    @property
    def graph_bytes(self) -> dict[str, int] | None:
        """Device bytes the captured check holds while the model sleeps (the private pool's
        segments, the peak allocated in it at capture, the index tensors), or None when
        the check runs eagerly."""
        g = self._graph
        if g is None:
            return None
        return {"pool": g.pool_bytes, "capture_peak": g.peak_bytes, "index": g.index_bytes}

    def _capture(self) -> list[Fp] | None:
        """Capture the span check as a CUDA graph; its baseline values, or None (eager)."""
        devices = {str(it.device) for it in self._span_items}
        if not self._want_graph or len(devices) != 1 or self._span_items[0].device.type != "cuda":
            return None
        if not any(it.length for it in self._span_items):
            return None
        try:
            items = [_Item(it.raw, big_rows=True) for it in self._span_items]
            g = _SpanGraph(items)
            got = g.run()
            if got != g.eager:
                raise RuntimeError("graph replay differs from the same check run eagerly")
        except Exception as e:  # any capture trouble: the eager check, which is proven
            self.graph_error = f"capture: {e!r}"
            _warn_once("capture", f"verify: CUDA graph capture failed, checking eagerly: {e!r}")
            self._graph = None
            return None
        self._graph, self._check_items = g, items
        return [(it.nbytes, s1, s2) for it, (s1, s2) in zip(items, got, strict=True)]

    def _check(self) -> list[Fp]:
        """The span values `changed` compares: graph replay, else the same items eagerly."""
        g, items = self._graph, self._check_items
        if items is None:
            return self.run_spans()
        if g is not None:
            try:
                got = g.run()
                return [(it.nbytes, s1, s2) for it, (s1, s2) in zip(items, got, strict=True)]
            except Exception as e:  # replay trouble: the same values, computed eagerly
                self.graph_error = f"replay: {e!r}"
                _warn_once("replay", f"verify: CUDA graph replay failed, checking eagerly: {e!r}")
                self._graph = None
        return _run_items(items)

    def baseline(self) -> Baseline:
        """Span and per-storage fingerprints now, for `changed` to compare against; on CUDA
        (HOTSWAP_VERIFY_GRAPH) the span check is captured as a CUDA graph here."""
        self._graph, self._check_items, self.graph_error = None, None, None
        spans = self._capture()
        if spans is None:
            spans = self.run_spans()
        return Baseline(spans, _run_items(self._items))

    def per_tensor(self, base: Baseline) -> list[Fp]:
        """The baseline's fingerprint of each tensor's storage, in the order given."""
        return [base.storages[i] for i in self._index]

    def changed(self, base: Baseline) -> list[int]:
        """Indices (in the order given) of the tensors whose storage bytes differ from
        `base`. One batch over the spans; only a differing span is re-read storage by
        storage to name its tensors (all of them, if its storages all read equal again)."""
        now = self._check()
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
