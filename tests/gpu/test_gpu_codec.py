"""The host codec on the device: the Triton kernels write the torch reference's bytes, the
sleep and wake queues round-trip through pinned host memory exactly, and the scratch stays
within its bound. (The engine-level proof is every other GPU test: they run with the
default HOTSWAP_HOST_CODEC=exp, so each level-1 cycle there is coded and fingerprinted.)"""

from __future__ import annotations

import pytest
import torch

from worker_ext import codec, devmodels
from worker_ext.rawmem import raw_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


def _data(kind: str, n_words: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(11)
    if kind == "realistic":
        t = torch.empty(n_words, dtype=torch.bfloat16, device="cuda")
        devmodels.realistic_fill_(t, "mlp.up_proj", 3)
        w = t.view(torch.int16)
        w[::4099] = 0x7FC1  # NaN
        w[1::4111] = 0xFF80 - 65536  # -Inf
        w[2::4127] = 0x0005  # a denormal
        return w.view(torch.uint8)
    return torch.randint(0, 256, (2 * n_words,), generator=g, device="cuda", dtype=torch.uint8)


def _written(ref: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """The bytes of a piece the encoder writes (not its alignment padding)."""
    meta = ref[: n_chunks * codec.META_BYTES].view(torch.int32).view(n_chunks, codec.META_INTS)
    mask = torch.zeros(ref.numel(), dtype=torch.bool)
    mask[: n_chunks * codec.META_BYTES] = True
    for row in meta.tolist():
        k, off, n, nexc, pk, bo, ex = (row[i] for i in range(7))
        if k == 0:
            mask[off : off + 2 * n] = True
            continue
        mask[off : off + n] = True
        mask[off + pk : off + pk + (n + 7) // 8 * k] = True
        mask[off + bo : off + bo + 4 * ((n + codec.BLOCK - 1) // codec.BLOCK)] = True
        mask[off + ex : off + ex + nexc] = True
    return mask


@pytest.mark.parametrize("kind", ["realistic", "noise"])
def test_kernels_write_the_reference_bytes(kind: str) -> None:
    data = _data(kind, 2 * codec.CHUNK_WORDS + 12345)
    gc = codec.GpuCodec("cuda", piece_chunks=4)
    plan = gc.plan([(data.data_ptr(), data.numel())])
    [piece] = plan.pieces
    slot = gc.slots()[0]
    gc.encode_into(plan, piece, slot)
    ref = codec.encode_piece(data.cpu())
    assert piece.size == ref.numel()
    mask = _written(ref, piece.n_chunks)
    assert torch.equal(slot[: piece.size].cpu()[mask], ref[mask])
    for decoder in codec.DECODERS:
        gc.decoder = decoder
        out = torch.zeros_like(data)
        gc.decode_to(slot, piece.n_chunks, out.data_ptr(), out.numel())
        assert torch.equal(out, data), decoder
    if kind == "realistic":
        assert plan.ratio() <= 0.72, plan.ratio()
    else:
        assert plan.by_k == {0: 3}
    print(f"[codec] {kind}: ratio {plan.ratio():.4f}, chunks by k {plan.by_k}")


def test_queues_roundtrip_through_pinned_memory_within_scratch() -> None:
    """Several ranges (one odd-sized), pieces of 2 chunks, 2 slots: sleep then wake."""
    sizes = [3 * codec.CHUNK_WORDS, codec.CHUNK_WORDS // 3, 5 * codec.CHUNK_WORDS + 2]
    tensors = [_data("realistic" if i % 2 == 0 else "noise", n) for i, n in enumerate(sizes)]
    orig = [t.clone() for t in tensors]
    gc = codec.GpuCodec("cuda", piece_chunks=2, slots=2)
    plan = gc.plan([(t.data_ptr(), t.numel()) for t in tensors])
    host = torch.empty(plan.total, dtype=torch.uint8, pin_memory=True)
    dev_ = torch.device("cuda", torch.cuda.current_device())

    def copy(off: int, dev: int, n: int, to_host: bool, stream: int) -> None:
        s = torch.cuda.ExternalStream(stream)
        with torch.cuda.stream(s):
            src = raw_bytes(dev, n, dev_)
            if to_host:
                host[off : off + n].copy_(src, non_blocking=True)
            else:
                src.copy_(host[off : off + n], non_blocking=True)

    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    sq = codec.SleepQueue(gc, plan, copy, a, b)
    for p in plan.pieces:
        sq.queue(p)
    torch.cuda.synchronize()
    for decoder in codec.DECODERS:
        gc.decoder = decoder
        for t in tensors:
            t.fill_(0x5A)
        wq = codec.WakeQueue(gc, plan, copy, a, b, profile=True)
        for p in plan.pieces:
            wq.queue(p)
        torch.cuda.synchronize()
        for t, o in zip(tensors, orig, strict=True):
            assert torch.equal(t, o), decoder
        prof = wq.profile_summary()
        assert prof is not None
        assert prof["pieces"] == len(plan.pieces), prof
        assert 0 < prof["wire_s"] <= prof["total_s"], prof
        assert prof["decode_s"] > 0, prof
        quarters = prof["wire_gbps_by_quarter"]  # the wire's rate over the queue's order
        assert len(quarters) == 4, prof
        assert all(q is None or q > 0 for q in quarters), prof
        print(f"[codec] wake profile, {decoder}: {prof}")
    bound = 2 * gc.slot_bytes + 2 * gc.piece_chunks * codec.CHUNK_BLOCKS * 4
    assert gc.peak_scratch <= bound
    assert gc.scratch_bytes(plan) <= bound + plan.meta.numel() * 4 + plan.inv.numel()
    n = len(plan.pieces)
    print(f"[codec] queues: {n} pieces, ratio {plan.ratio():.4f}, scratch {gc.peak_scratch} B")


def test_warm_proves_the_kernels() -> None:
    gc, report = codec.warm(torch.device("cuda", torch.cuda.current_device()))
    assert gc is not None, report
    assert report["ok"], report


def test_a_wake_with_more_slots_than_the_sleep_brings_the_bytes_back() -> None:
    """A wake through four slots (the groups decoder) of pieces a two-slot sleep coded: the
    bytes come back exactly, the sleep used two slots and the wake four."""
    sizes = [3 * codec.CHUNK_WORDS, codec.CHUNK_WORDS // 3, 5 * codec.CHUNK_WORDS + 2]
    tensors = [_data("realistic" if i % 2 == 0 else "noise", n) for i, n in enumerate(sizes)]
    orig = [t.clone() for t in tensors]
    gc = codec.GpuCodec("cuda", piece_chunks=2, slots=4, decoder="groups")
    plan = gc.plan([(t.data_ptr(), t.numel()) for t in tensors])
    host = torch.empty(plan.total, dtype=torch.uint8, pin_memory=True)
    dev_ = torch.device("cuda", torch.cuda.current_device())

    def copy(off: int, dev: int, n: int, to_host: bool, stream: int) -> None:
        s = torch.cuda.ExternalStream(stream)
        with torch.cuda.stream(s):
            src = raw_bytes(dev, n, dev_)
            if to_host:
                host[off : off + n].copy_(src, non_blocking=True)
            else:
                src.copy_(host[off : off + n], non_blocking=True)

    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    sq = codec.SleepQueue(gc, plan, copy, a, b)
    for p in plan.pieces:
        sq.queue(p)
    torch.cuda.synchronize()
    fixed = 2 * gc.piece_chunks * codec.CHUNK_BLOCKS * 4
    assert gc.peak_scratch <= 2 * gc.slot_bytes + fixed
    for t in tensors:
        t.fill_(0x5A)
    wq = codec.WakeQueue(gc, plan, copy, a, b, profile=True)
    assert wq.n_slots == 4 < len(plan.pieces)
    for p in plan.pieces:
        wq.queue(p)
    torch.cuda.synchronize()
    for t, o in zip(tensors, orig, strict=True):
        assert torch.equal(t, o)
    assert gc.peak_scratch <= 4 * gc.slot_bytes + fixed
    prof = wq.profile_summary()
    assert prof is not None
    assert prof["pieces"] == len(plan.pieces)
    print(f"[codec] four slots, {len(plan.pieces)} pieces: {prof}")
