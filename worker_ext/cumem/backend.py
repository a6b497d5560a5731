"""CuMemBackend: the suspend and resume of vLLM's cuMem pools, over the package's parts."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from worker_ext import fpkernel
from worker_ext.cudart import CudaRT, HostBuffer
from worker_ext.cudriver import Driver
from worker_ext.cumem import hostbuf, hostcheck
from worker_ext.cumem.coded import CodedCopies
from worker_ext.cumem.graphs import GraphPart
from worker_ext.cumem.kvlend import Lending
from worker_ext.cumem.records import Records, ranges, size
from worker_ext.cumem.resident import Residency
from worker_ext.cumem.resume import Onload, vllm_side_effects
from worker_ext.cumem.streams import CopyStreams
from worker_ext.cumem.suspend import (
    Beside,
    FreeLater,
    Offload,
    Unlocked,
    map_again,
    release_early,
)
from worker_ext.cumem.tier import TierPart
from worker_ext.pools import (
    ALL_TAGS,
    DISCARDED,
    GRAPHS,
    KV_CACHE,
    OFFLOADED,
    WEIGHTS,
    During,
    policy,
)
from worker_ext.rawmem import raw_bytes
from worker_ext.settings import WorkerSettings


class CuMemBackend:
    """pools.PoolBackend over vLLM's CuMemAllocator records, with the fast copy path."""

    name = "cumem"
    in_place = True
    # suspend(..., during=) runs a prepare while the offload copies are on the link
    overlaps_prepare = True

    def __init__(self, worker: Any, settings: WorkerSettings | None = None) -> None:
        import torch
        from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

        self._torch = torch
        self._worker = worker
        # read once (the environment when not given): docs in worker_ext/settings.py
        self.settings = settings if settings is not None else WorkerSettings.from_env()
        self._unmap_and_release = _forgetting(unmap_and_release, self)
        device = getattr(worker, "device", None)
        self.device = device if device is not None else torch.device("cuda", 0)
        self._records = Records(CuMemAllocator.get_instance(), torch)
        cudart = CudaRT()
        self._residency = Residency(torch, self.device, self._records, cudart)
        self._streams = CopyStreams(torch, self.device, cudart)
        self._suspended: dict[str, str] = {}
        self._level: int | None = None
        # ptr -> (host buffer address, offset, size) of every record offloaded raw now
        self._layout: dict[int, tuple[int, int, int]] = {}
        self._release_host_after_pending = False
        self._woke = hostcheck.WokeFrom()  # what the last wake copied back from
        self._coded = CodedCopies(torch, self.device, self._streams, lambda: self.settings)
        self._graphs = GraphPart(self._records, lambda: self.settings, self._fill)
        index = self.device.index or 0

        def threads() -> int:
            return self.settings.tuning.pin_threads

        # the tier's writer reads the weights' buffer until it is done
        self._host = hostbuf.Pinned(
            "host backup buffer", cudart, index, threads, lambda: self._tier.join_writer()
        )
        # the KV pool's own buffer, made at the first prepare that keeps the KV cache
        self._kv_host = hostbuf.Pinned("host buffer for the KV cache", cudart, index, threads)
        parts = (self._records, self._streams, self._coded)
        self._tier = TierPart(
            worker, torch, self.device, parts, self._host.take, lambda: self.settings
        )
        self._driver: Driver | None = None
        self._lending = _lending(self)
        self._kernel_warm: dict[str, Any] | None = None
        self._coded.get_codec()
        if self.settings.pin_early:
            self.warm_host(wait=False)
        # verify's Triton check compiled now, not inside the first sleep's prepare
        if self.settings.verify_kernel != "off":
            self._kernel_warm = fpkernel.warm(self.device)

    @property
    def codec_profile(self) -> bool:
        """benchmarks.wake sets it: timing events around every piece of a coded wake."""
        return self._coded.profile

    @codec_profile.setter
    def codec_profile(self, on: bool) -> None:
        self._coded.profile = on

    @property
    def last_dma_s(self) -> float | None:
        """GPU time of the last resume's copies, once they were waited for."""
        return self._streams.last_dma_s

    # -- what the extension reads ----------------------------------------------------------

    def pools(self) -> dict[str, int]:
        return self._records.pools()

    def tag_of(self, data_ptr: int, nbytes: int) -> str:
        return self._records.tag_of(data_ptr, nbytes)

    def records(self) -> list[tuple[int, int, str]]:
        return self._records.spans()

    def free_ranges(self) -> list[tuple[int, int]]:
        return self._records.free_ranges()

    def suspended(self) -> dict[str, str]:
        return dict(self._suspended)

    def memory(self) -> dict[str, int]:
        return self._residency.memory()

    def resident(self) -> dict[str, Any]:
        return self._residency.resident(self._lending.lent_total)

    def release_cached(self) -> float:
        return self._residency.release_cached()

    def refresh(self) -> None:
        """Nothing to re-read: the allocator's records are read at every call."""

    def after_reload(self) -> list[str]:
        return []

    def unready(self) -> list[str]:
        return []

    def tier_restored(self) -> dict[str, Any] | None:
        return self._tier.take_restored()

    def describe(self) -> dict[str, Any]:
        """Host-buffer state for hotswap_info (plain values)."""
        driver = self._driver
        drivers = [driver] if driver is not None else []
        return {
            **hostbuf.describe(self._host, self._kv_host),
            "records": len(self._records.all()),
            "verify_kernel_warm": self._kernel_warm,
            "tier": self._tier.describe(),
            "codec": self._coded.describe(),
            "map": {
                "impl": "driver",
                "drivers": {
                    d.handle_type: {"fabric_refused": d.fabric_refused, "rdma": d.rdma}
                    for d in drivers
                },
            },
        }

    # -- the host buffers ------------------------------------------------------------------

    def warm_host(self, wait: bool = False) -> dict[str, Any]:
        """Start (or join) pinning a host buffer of exactly the weights' bytes, or of their
        coded size (planned now, on the device, when the codec is on and they are awake)."""
        self._host.warm(self._host_need(), "hotswap-pin")
        if wait:
            self._host.join()
        return self.describe()

    def _host_need(self) -> int:
        need = self.pools().get(WEIGHTS, 0)
        self._coded.get_codec()
        recs = self._records.of(WEIGHTS)
        if not recs or any(d.is_asleep for _, d in recs):
            return need
        coded = self._coded.plan_ahead(ranges(recs))
        return need if coded is None else coded

    def _host_for(self, tag: str, nbytes: int) -> HostBuffer:
        return (self._kv_host if tag == KV_CACHE else self._host).take(nbytes)

    def host_backup_bytes(self) -> int:
        return self._host.nbytes + self._kv_host.nbytes

    def _release_host(self) -> dict[str, int]:
        self._tier.join_writer()
        return {WEIGHTS: self._host.release(), KV_CACHE: self._kv_host.release()}

    def _join_pinning(self) -> None:
        self._host.join()
        self._kv_host.join()

    def drop_backup(self) -> dict[str, int]:
        """Awake: free the kept pinned buffers once the copies a resume queued are done (and
        a background pinning has ended); the next sleep pins anew, in the foreground."""
        if self._suspended or self._layout or self._coded.pieces:
            raise RuntimeError(f"drop_backup: pools asleep: {sorted(self._suspended)}")
        self.synchronize()
        self._join_pinning()
        return self._release_host()

    def prepare_kv_keep(self) -> None:
        self.warm_kv_host()

    def warm_kv_host(self) -> None:
        """Start pinning a host buffer of exactly the KV pool's bytes (in the background:
        the prepare's fingerprints run meanwhile; the suspend waits for it)."""
        self._kv_host.warm(self.pools().get(KV_CACHE, 0), "hotswap-pin-kv")

    def kv_keep_refusal(self) -> str | None:
        """Host memory for the KV pool's pinned copy, unless a big enough buffer is there or
        on its way."""
        need = self.pools().get(KV_CACHE, 0)
        return hostbuf.keep_refusal(need, self._kv_host.nbytes, self._kv_host.pinning())

    # -- a level-1 sleep becoming level 2 ------------------------------------------------

    def demote_refusal(self) -> str | None:
        """Why this sleep cannot become level 2 (None: it can): the weights must be
        offloaded at level 1, and a kept KV cache must not be (its content and the engine's
        prefix cache would be out of step at level 2)."""
        if self._level != 1 or self._suspended.get(WEIGHTS) != OFFLOADED:
            return f"demote: the weights are not offloaded at level 1 ({self._suspended})"
        if self._suspended.get(KV_CACHE) == OFFLOADED:
            return "demote: the KV cache is kept (offloaded) across this sleep"
        return None

    def demote(self) -> dict[str, Any]:
        """A level-1 sleep becomes level 2: the weights' host copy (coded or raw) and the
        KV cache's kept pinned buffer are released, and the weights pool is marked
        discarded, so the next resume maps it without a copy and the reload (or nothing
        else) refills it. The caller holds the level-2 protection by range."""
        why = self.demote_refusal()
        if why:
            raise RuntimeError(why)
        self.synchronize()
        self._join_pinning()
        ptrs = [ptr for ptr, _data in self._records.of(WEIGHTS)]
        self._coded.forget(ptrs)
        for ptr in ptrs:
            self._layout.pop(ptr, None)
        self._tier.key = None  # no tier file for these weights: the wake reloads
        freed = self._release_host()
        self._suspended[WEIGHTS] = DISCARDED
        self._level = 2
        return {"freed_bytes": {WEIGHTS: freed[WEIGHTS]}, "freed_host_bytes": freed}

    def wake_scratch_bytes(self) -> int:
        """The codec's staging a wake decodes through: asleep with a coded host copy of the
        weights, or with their level-2 disk tier file's key."""
        gc = self._coded.made
        if gc is None or WEIGHTS not in self._suspended:
            return 0
        if self._coded.pieces or self._tier.key is not None:
            return int(gc.scratch_bytes())
        return 0

    # -- suspend / resume ------------------------------------------------------------------

    def synchronize(self) -> None:
        """Wait for copies a resume queued; release the host buffer if so configured."""
        self._streams.wait()
        self._coded.waited()
        if self._release_host_after_pending and not self._layout and not self._coded.pieces:
            self._release_host()
        self._release_host_after_pending = False

    def _release(self, data: Any) -> None:
        self._unmap_and_release(data.handle)
        data.is_asleep = True

    def _fill(self, ptr: int, nbytes: int, value: int) -> None:
        raw_bytes(ptr, nbytes, self.device).fill_(value)

    def suspend(
        self,
        level: int,
        tags: list[str],
        keep_kv: bool = False,
        rewritten: Sequence[tuple[int, int]] = (),
        during: During | None = None,
        early_kv: Sequence[int] = (),
    ) -> dict[str, Any]:
        """`during` (hotswap_sleep): called once the copies of the tuning's
        `sleep_stage_share` of the weights' bytes are queued and `early_kv` released (and
        lent: kvlend), with the function that queues the rest (the prepare calls it once its
        protected copies are queued; else called after it); its answer replaces `rewritten`.
        If it raises, every queued copy is waited for, `early_kv` mapped back, nothing else
        released, and the error raised again."""
        tags = _check_suspend(level, tags, self._suspended, self._records, self._lending)
        self._woke = hostcheck.WokeFrom()
        plan = {t: policy(level, t, keep_kv) for t in tags}
        recs = {t: self._records.of(t) for t in tags}
        t0 = time.perf_counter()
        self.synchronize()
        self._torch.cuda.synchronize(self.device)
        before = self.memory()["free"]
        timings: dict[str, float] = {}
        # Each offloaded pool has its own host buffer: the weights', the KV cache's.
        offload = {t: recs[t] for t in tags if plan[t] == OFFLOADED}
        share = self.settings.tuning.sleep_stage_share if during is not None else 1.0
        copies = Offload(self._coded, self._streams, self._host_for, offload, timings, share)
        link = _LinkClock(self._torch, self._streams, t0, bool(offload))
        early_kv = early_kv if during is not None else ()
        unlocked, later = _release_modes(self, during is not None, timings)

        def kv_first(how: Callable[[Any], None] | None = None) -> list[tuple[int, Any]]:
            how = how or later
            return release_early(early_kv, recs, plan, self._lending, timings, t0, how)

        # threaded, it starts before the first copies are queued; else after them
        early = (
            unlocked.run(lambda: kv_first(unlocked), kv_first) if unlocked and early_kv else None
        )
        overlapped = copies.queue_first()
        timings["at_queued_first_s"] = time.perf_counter() - t0
        early = early or Beside(kv_first, threaded=False)
        if during is not None:
            rewritten = _prepare_under(during, copies, early, self._mapper, timings, later)
        timings["at_prepared_s"] = time.perf_counter() - t0
        copies.go_on()
        copies.check_reused_plan()
        link.queued()  # every copy is queued now
        if level == 2 and WEIGHTS in tags and plan[WEIGHTS] == DISCARDED:
            self._tier.put_away(recs[WEIGHTS], timings, rewritten)
        discard = _discarding(self, tags, plan, recs, timings, t0, unlocked, later)
        copies.release_copied(self._release)
        graphs = discard.join(timings, "discard_join_wait_s")
        if later is not None:
            later.join(timings)  # every record's memory free before the answer
        timings["at_released_s"] = time.perf_counter() - t0
        copies.finish()
        link.done(timings)
        self._layout.update(copies.layout)
        self._suspended.update(plan)
        self._level = level
        _free_host_at_level2(self, level, plan)
        timings["trim_s"] = self._residency.trim()  # with the stack's shrink (resident.stack)
        freed = {t: sum(size(d) for _, d in recs[t]) for t in tags}
        return {
            "freed_bytes": {**freed, GRAPHS: graphs} if graphs else freed,
            "offloaded_bytes": {t: freed[t] if plan[t] == OFFLOADED else 0 for t in tags},
            "memory_before": before,
            "memory_after": self.memory()["free"],
            "backend_s": time.perf_counter() - t0,
            "timings": timings,
            "overlapped": overlapped and during is not None,
            "host_backup_bytes": self._host.nbytes,
            "kv_host_backup_bytes": self._kv_host.nbytes,
        }

    def check_host_copy(self, bad: Sequence[hostcheck.Bad]) -> dict[str, Any]:
        """A verify's mismatch: the last wake's host copy of each differing piece read."""
        live = [self._host.buf, self._kv_host.buf]
        return self._woke.check(bad, self.device, self.synchronize, live)

    def _mapper(self) -> Driver:
        """The driver that maps records back (exportable memory, as vLLM asks; a create
        refused for memory waits as tuned), its per-call times reset."""
        if self._driver is None:
            i = self.device.index
            self._driver = Driver(self._torch.cuda.current_device() if i is None else i)
        self._driver.oom_wait_s = self.settings.tuning.map_oom_wait_s
        self._driver.take_spent()
        return self._driver

    def resume(self, tags: list[str]) -> dict[str, Any]:
        want = list(dict.fromkeys(tags))
        unknown = [t for t in want if t not in ALL_TAGS]
        if unknown:
            raise ValueError(f"unknown tags {unknown}; expected a subset of {list(ALL_TAGS)}")
        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        # Pools back without a copy (a swap's discarded KV cache) map under an earlier
        # resume's copies, as in one hotswap_wake (docs/benchmarks.md, the swap).
        late = self._streams.pending and OFFLOADED not in {self._suspended.get(t) for t in want}
        if not late:
            _wait_copies(self.synchronize, self._streams, timings)
        # before any kernel of the wake (a no-op after the first resume since the suspend)
        self._residency.restore_stack(timings)
        before = self.memory()["free"]
        restored = dict.fromkeys(want, 0)
        was_level = self._level
        driver = self._mapper()
        self._lending.open(self._suspended.get(KV_CACHE) == DISCARDED)  # until it is mapped
        copies = Onload(self._coded, self._streams, self._layout, lambda: self._host.buf)
        # Weights first: their copies start at once and the KV mapping overlaps them.
        for tag in sorted(want, key=lambda t: (t != WEIGHTS, t)):
            mode = self._suspended.get(tag)
            if mode is None:
                continue
            t, cpu = time.perf_counter(), time.thread_time()
            lent = self._lending.lent if tag == KV_CACHE else None
            restored[tag] += copies.map_back(self._records.of(tag), mode, driver, lent)
            if tag == KV_CACHE and (graphs := self._graphs.map_back(driver, timings)):
                restored[GRAPHS] = graphs
            gc = self._coded.made
            if copies.wq is not None and gc is not None and tag == WEIGHTS:
                timings["codec_scratch_bytes"] = float(gc.scratch_bytes(slots=copies.wq.n_slots))
            if tag == WEIGHTS and mode == DISCARDED and self._tier.key is not None:
                self._tier.restored = self._tier.restore(timings)
            timings[f"{tag}_s"] = time.perf_counter() - t
            # this thread's CPU time: far below the wall time means it waited (driver, GIL)
            timings[f"{tag}_cpu_s"] = time.thread_time() - cpu
            self._lending.mapped(tag, timings, driver.imported)
            for step, spent in driver.take_spent().items():
                timings[f"{tag}_{step}_s"] = spent
            del self._suspended[tag]
        if late:
            _wait_copies(self.synchronize, self._streams, timings)
        self._woke.add(copies.raw_done, self._coded.made, copies.wq, self._host.buf)
        if copies.start is not None:
            self._streams.hand_over(copies.start)
            if not self.settings.keep_host_backup:
                self._release_host_after_pending = True
                self.synchronize()  # the buffer goes back now, so wait for its copies
        t = time.perf_counter()
        side = vllm_side_effects(self._worker, restored, was_level)
        timings["after_resume_s"] = time.perf_counter() - t
        if not self._suspended:
            self._level = None
        return {
            "restored_bytes": restored,
            "memory_before": before,
            "memory_after": self.memory()["free"],
            "backend_s": time.perf_counter() - t0,
            "timings": timings,
            "side_effects": side,
        }


def _check_suspend(
    level: int, tags: list[str], suspended: dict[str, str], records: Records, lending: Lending
) -> list[str]:
    """The tags to suspend, once each; ValueError or RuntimeError before anything moves.
    An inbox a wake left open (its KV pool never mapped) is closed first."""
    lending.close()
    if level not in (1, 2):
        raise ValueError(f"level must be 1 or 2, not {level!r}")
    tags = list(dict.fromkeys(tags))
    unknown = [t for t in tags if t not in ALL_TAGS]
    if unknown or not tags:
        raise ValueError(f"tags must be a non-empty subset of {list(ALL_TAGS)}: {tags}")
    asleep = [t for t in tags if t in suspended]
    if asleep:
        raise RuntimeError(f"already suspended: {asleep}")
    stray = [p for t in tags for p, d in records.of(t) if d.is_asleep]
    if stray:
        raise RuntimeError(f"{len(stray)} records already asleep (vLLM's own sleep?)")
    return tags


def _discarding(
    b: CuMemBackend,
    tags: list[str],
    plan: dict[str, str],
    recs: dict[str, list[tuple[int, Any]]],
    timings: dict[str, float],
    t0: float,
    unlocked: Unlocked | None,
    later: FreeLater | None = None,
) -> Beside[int]:
    """The discarded pools released (they need no copy) while the offload copies run, and
    the CUDA graphs' pool with the KV cache (never copied: worker_ext.graphpool): on a
    thread of its own where `unlocked`, beside the weights' releases. Its answer: the graph
    pool's bytes released."""

    def run(release: Callable[[Any], None]) -> int:
        t = time.perf_counter()
        for tag in tags:
            if plan[tag] == DISCARDED:
                weights = tag == WEIGHTS and isinstance(release, FreeLater)
                how = b._release if weights else release  # free_later: not the weights
                for _ptr, data in recs[tag]:
                    if not data.is_asleep:  # else released early
                        how(data)
        graphs = b._graphs.release(release, timings) if KV_CACHE in tags else 0
        timings["discard_s"] = time.perf_counter() - t
        timings["at_discarded_s"] = time.perf_counter() - t0
        return graphs

    def here() -> int:
        return run(later or b._release)

    if unlocked is None:
        return Beside(here, threaded=False)
    return unlocked.run(lambda: run(unlocked), here)


def _release_modes(
    b: CuMemBackend, fused: bool, timings: dict[str, float]
) -> tuple[Unlocked | None, FreeLater | None]:
    """A fused sleep's releases as its tuning asks: the KV cache's on threads of their own
    (`kv_thread`: Unlocked), each record's memory freed on a thread as its exported
    descriptor closes (`free_later`: FreeLater); None for either when off."""
    tuning = b.settings.tuning
    unlocked = Unlocked(b._mapper()) if fused and tuning.kv_thread else None
    later = FreeLater(b._mapper().export_fd, b._release) if fused and tuning.free_later else None
    for key, on in (("kv_thread", unlocked), ("free_later", later)):
        if on is not None:
            timings[key] = 1.0
    return unlocked, later


def _prepare_under(
    during: During,
    copies: Offload,
    early: Beside[list[tuple[int, Any]]],
    mapper: Callable[[], Driver],
    timings: dict[str, float],
    later: FreeLater | None = None,
) -> Sequence[tuple[int, int]]:
    """`during` (the prepare) under the queued copies, then the KV records released early
    waited for. If it raises: every queued copy waited for, the records released early
    mapped back (once their memory is free: `later`; a refusal there raises: the rank
    fails) and its error raised again. An error of the early release is raised once the
    copies were waited for (the rank fails)."""
    t = time.perf_counter()
    try:
        rewritten = during(copies.go_on)
    except BaseException:
        copies.abandon()
        released = early.join(timings, "kv_join_wait_s")
        if later is not None:
            later.join(timings)
        map_again(released, mapper)
        raise
    timings["prepare_under_copies_s"] = time.perf_counter() - t
    try:
        early.join(timings, "kv_join_wait_s")
    except BaseException:
        copies.abandon()
        raise
    return rewritten


def _free_host_at_level2(b: CuMemBackend, level: int, plan: dict[str, str]) -> None:
    """A level-2 sleep that discards the weights keeps no host copy of them: the pinned
    buffers kept for the next sleep are freed (that sleep pins anew, in the foreground, as
    after `drop_backup`), unless the disk tier's writer reads the weights' buffer now."""
    if level != 2 or plan.get(WEIGHTS) != DISCARDED or b._tier.writing():
        return
    b._join_pinning()
    b._host.release()
    b._kv_host.release()


def _wait_copies(sync: Callable[[], None], streams: CopyStreams, timings: dict[str, float]) -> None:
    """Wait for the copies an earlier resume left in flight (`sync`: the backend's), timed."""
    waited = streams.pending
    t = time.perf_counter()
    sync()
    if waited:
        timings["wait_copies_s"] = time.perf_counter() - t
        if streams.last_dma_s is not None:
            timings["copies_gpu_s"] = streams.last_dma_s


class _LinkClock:
    """When a suspend's copies ended on the GPU, in seconds from its start (`at_link_done_s`;
    `link_s`: first queued to last done): whether the link or the host bounds the sleep."""

    def __init__(self, torch: Any, streams: CopyStreams, t0: float, on: bool) -> None:
        self._torch = torch
        self._streams = streams
        self._on = on  # anything to copy
        self._ends: list[Any] = []
        if on:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(streams.all()[0])  # the streams are idle: it fires at once
            self._at = time.perf_counter() - t0

    def queued(self) -> None:
        """Every copy is queued: an event after the last on each stream."""
        if not self._on:
            return
        event = self._torch.cuda.Event
        self._ends = [s.record_event(event(enable_timing=True)) for s in self._streams.all()]

    def done(self, timings: dict[str, float]) -> None:
        """Once the copies were waited for (the suspend's last piece on the host)."""
        for e in self._ends:
            e.synchronize()
        if not self._ends:
            return
        gpu = max(self._start.elapsed_time(e) for e in self._ends) / 1000.0
        timings["link_s"] = gpu
        timings["at_link_done_s"] = self._at + gpu


def _lending(b: CuMemBackend) -> Lending:
    """The backend's kvlend side: by its device's UUID, lending through its own release
    and its driver's export."""
    props = b._torch.cuda.get_device_properties
    return Lending(
        lambda: str(props(b.device).uuid),
        lambda: b.settings,
        b._release,
        lambda handle: b._mapper().export_fd(handle),
    )


def _forgetting(release: Callable[[Any], None], b: CuMemBackend) -> Callable[[Any], None]:
    """vLLM's unmap_and_release, then the descriptor a record's lent memory came with
    closed (cudriver.Driver.forget): its memory goes back to the driver, unless lent on."""

    def call(handle: Any) -> None:
        release(handle)
        if b._driver is not None:
            b._driver.forget(int(handle[2]))

    return call
