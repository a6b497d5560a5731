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

Kernel (a plan's `kernel`, the worker's HOTSWAP_VERIFY_KERNEL: `auto`, the default, on
CUDA; `on` also on CPU under Triton's interpreter; `off` never): `Plan.baseline` builds a
`fpkernel.SpanCheck` over the spans of the CUDA device that holds most of the bytes (spans
elsewhere, e.g. a runner's CPU tensors, and spans that do not start on 8 bytes, keep the
eager check), and `Plan.changed` runs it: one Triton launch over all those spans in 2 MiB
pieces, one comparison on the device, one bool to the host, about one memory pass. The
check is cross-checked against torch on a sample of pieces when built; if Triton is missing
or anything about the kernel fails, the eager span check runs instead (`kernel_error` says
why). The plan's storages keep their addresses across sleep/wake (in-place restore), so
the kernel's address table stays valid for the plan's life.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from worker_ext.fpkernel import SpanCheck
from worker_ext.rawmem import raw_bytes

ROW_WORDS = 512  # 4 KiB rows of int64 words
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


class _Item:
    """One byte range split into device tensors whose values form its sequence v_1..v_k."""

    __slots__ = ("device", "length", "nbytes", "raw", "row_views", "word_views")

    def __init__(self, raw: Any) -> None:
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
            k = nwords // ROW_WORDS
            if k:
                self.row_views.append(words[: k * ROW_WORDS].view(k, ROW_WORDS))
                done, nrows = k * ROW_WORDS, k
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


DEFAULT_KERNEL = "auto"  # a plan's kernel mode when none is given (the worker passes its own)


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(msg)


@dataclass(frozen=True)
class Baseline:
    """What `Plan.changed` compares against, taken at one time: the kernel's values for the
    spans it covers, eager values for the rest, and per-storage fingerprints."""

    spans: list[Fp]  # eager values of the spans in `rest` (all spans when rest is None)
    storages: list[Fp]
    check: SpanCheck | None = None
    covered: list[int] = field(default_factory=list)  # span indices `check` reads, in order
    rest: list[int] | None = None  # span indices checked eagerly; None: all of them


class Plan:
    """Fingerprints of a fixed list of tensors; build once, run as often as needed.

    The plan holds views of the storages, so it keeps them alive and fingerprints exactly
    those storages on every run (whatever the tensors' slots point to by then)."""

    def __init__(
        self, tensors: list[Any], coalesce: bool = True, kernel: str | None = None
    ) -> None:
        self._kernel = DEFAULT_KERNEL if kernel is None else kernel
        self.kernel_error: str | None = None  # why the last baseline checks eagerly
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

    def _kernel_check(self) -> tuple[SpanCheck, list[int]] | None:
        """A baselined Triton check over the spans of the device holding most of the bytes
        (a CUDA device; any device when the mode is `on`) and the span indices it covers;
        None when every span is checked eagerly (`kernel_error` says why, if it failed)."""
        if self._kernel == "off":
            return None
        by_device: dict[Any, list[int]] = {}
        for k, it in enumerate(self._span_items):
            aligned = int(it.raw.data_ptr()) % 8 == 0  # the kernel reads words
            if it.nbytes and aligned and (self._kernel == "on" or it.device.type == "cuda"):
                by_device.setdefault(it.device, []).append(k)
        if not by_device:
            return None
        device, covered = max(
            by_device.items(), key=lambda kv: sum(self._span_items[k].nbytes for k in kv[1])
        )
        try:
            items = [self._span_items[k] for k in covered]
            check = SpanCheck([(int(it.raw.data_ptr()), it.nbytes) for it in items], device)
            check.baseline()
        except Exception as e:
            self.kernel_error = f"{type(e).__name__}: {e}"
            _warn_once("kernel", f"verify: Triton span check unavailable, checking eagerly: {e}")
            return None
        return check, covered

    def baseline(self) -> Baseline:
        """Span and per-storage fingerprints now, for `changed` to compare against; the
        kernel check (the plan's `kernel`) takes its own baseline values here, and the
        spans it does not cover (other devices, empty ones) are fingerprinted eagerly."""
        self.kernel_error = None
        found = self._kernel_check()
        if found is None:
            return Baseline(self.run_spans(), _run_items(self._items))
        check, covered = found
        taken = set(covered)
        rest = [k for k in range(len(self._span_items)) if k not in taken]
        spans = _run_items([self._span_items[k] for k in rest])
        return Baseline(spans, _run_items(self._items), check, covered, rest)

    def per_tensor(self, base: Baseline) -> list[Fp]:
        """The baseline's fingerprint of each tensor's storage, in the order given."""
        return [base.storages[i] for i in self._index]

    def changed(self, base: Baseline) -> list[int]:
        """Indices (in the order given) of the tensors whose storage bytes differ from
        `base`. One batch over the spans; only a differing span is re-read storage by
        storage to name its tensors (all of them, if its storages all read equal again)."""
        bad: list[int] = []
        if base.check is not None:
            bad = [base.covered[i] for i in base.check.differing()]
        rest = list(range(len(self._span_items))) if base.rest is None else base.rest
        if rest:
            now = _run_items([self._span_items[k] for k in rest])
            bad += [k for k, a, b in zip(rest, now, base.spans, strict=True) if a != b]
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
