"""worker_ext.fingerprint on CPU tensors (pure torch, no vLLM): what it must and need not see."""

from __future__ import annotations

import pytest
import torch

from worker_ext import fingerprint as fpmod
from worker_ext.fingerprint import ROW_WORDS, Plan, fingerprint, fingerprints, storage_bytes

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8]
# byte sizes below, at and above one row, with 1-7 byte tails
SHAPES = [(1,), (3,), (7, 5), (2, 3, 4), (131,), (ROW_WORDS * 2 + 3,), (3, ROW_WORDS + 1)]


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def _flip(t: torch.Tensor, byte: int, bit: int) -> None:
    raw = storage_bytes(t)
    raw[byte : byte + 1].bitwise_xor_(1 << bit)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_one_flipped_bit_anywhere_is_seen(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _rand(shape, dtype, 0)
    fp = fingerprint(t)
    assert fp == fingerprint(t.clone())  # equal bytes, equal fingerprint
    n = storage_bytes(t).numel()
    assert fp[0] == n
    # first, last, a row boundary, the tail and a spread of bytes in between
    probes = sorted({0, n - 1, min(n - 1, ROW_WORDS * 8), min(n - 1, ROW_WORDS * 8 - 1)})
    probes += list(range(0, n, max(1, n // 97)))
    for byte in probes:
        for bit in (0, 3, 7):
            _flip(t, byte, bit)
            assert fingerprint(t) != fp, (byte, bit)
            _flip(t, byte, bit)
    assert fingerprint(t) == fp


def test_every_bit_of_a_small_tensor_is_seen() -> None:
    t = _rand((13,), torch.bfloat16, 3)  # 26 bytes: three int64 words and a 2-byte tail
    fp = fingerprint(t)
    for byte in range(26):
        for bit in range(8):
            _flip(t, byte, bit)
            assert fingerprint(t) != fp, (byte, bit)
            _flip(t, byte, bit)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swapped_elements_of_a_small_tensor_are_seen(dtype: torch.dtype) -> None:
    t = _rand((6, 7), dtype, 1)
    fp = fingerprint(t)
    flat = t.view(-1)
    n = flat.numel()
    for i, j in [(0, 1), (0, n - 1), (3, 17), (n - 2, n - 1)]:
        if flat[i] == flat[j]:
            continue
        s = t.clone()
        s.view(-1)[i], s.view(-1)[j] = flat[j].clone(), flat[i].clone()
        assert fingerprint(s) != fp, (i, j)


def test_swapped_rows_of_a_large_tensor_are_seen() -> None:
    t = _rand((5, ROW_WORDS * 2), torch.float32, 2)  # each tensor row = one 4 KiB row
    fp = fingerprint(t)
    s = t.clone()
    s[1], s[3] = t[3].clone(), t[1].clone()
    assert fingerprint(s) != fp
    words = t.clone().view(-1).view(torch.int64)
    words[0], words[5] = words[5].clone(), words[0].clone()  # a swap inside one 4 KiB row
    assert fingerprint(words) == fp  # documented blind spot: row sums are order-blind


def test_views_and_non_contiguous_tensors_cover_the_whole_storage() -> None:
    base = _rand((64, 33), torch.bfloat16, 4)
    view = base[3:9, ::2]  # offset and strided
    assert not view.is_contiguous()
    assert fingerprint(view) == fingerprint(base)
    before = fingerprint(view)
    base[60, 32] += 1  # outside the view, inside its storage
    assert fingerprint(view) != before
    assert fingerprint(view) == fingerprint(base)


def test_batch_equals_one_by_one_and_keeps_order() -> None:
    ts = [_rand(s, d, i) for i, (s, d) in enumerate(zip(SHAPES, DTYPES * 2, strict=False))]
    ts.append(torch.empty(0))
    batch = fingerprints(ts)
    assert batch == [fingerprint(t) for t in ts]
    assert batch[-1] == (0, 0, 0)
    shared = ts[2].view(-1)[1:]  # same storage as ts[2]: computed once, answered twice
    assert fingerprints([ts[2], shared, ts[0]]) == [batch[2], batch[2], batch[0]]


def test_identical_bytes_in_different_tensors_give_identical_fingerprints() -> None:
    a = _rand((ROW_WORDS + 7,), torch.float32, 5)
    b = a.clone().view(torch.int32)  # same bytes, another dtype
    assert fingerprint(a) == fingerprint(b)
    c = a.clone()
    c[0] = -c[0]
    assert fingerprint(a) != fingerprint(c)


def test_a_plan_sees_changes_to_its_storages_and_rebuilt_layouts_agree() -> None:
    ts = [_rand((ROW_WORDS * 3 + 5,), torch.bfloat16, 6), _rand((9,), torch.int8, 7)]
    plan = Plan(ts)
    first = plan.run()
    assert len(plan) == 2
    fpmod._LAYOUTS.clear()  # a fresh layout gives the same values
    assert plan.run() == first
    ts[0][100] += 1
    now = plan.run()
    assert now[0] != first[0]
    assert now[1] == first[1]


def test_unaligned_storage_is_fingerprinted_byte_by_byte() -> None:
    data = bytearray(range(41))
    t = torch.frombuffer(data, dtype=torch.uint8, offset=1)
    if t.untyped_storage().data_ptr() % 8 == 0:
        pytest.skip("frombuffer gave an aligned storage here")
    fp = fingerprint(t)
    assert fp == fingerprint(t)
    for byte in (0, 17, 39):
        _flip(t, byte, 2)
        assert fingerprint(t) != fp, byte
        _flip(t, byte, 2)
    assert fingerprint(t) == fp
