"""The sleep's RPCs: the audit, the prepare (protection and snapshot), the suspend, and
the two fused into hotswap_sleep (the prepare run under the weights' copies)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import torch

from worker_ext import ownership, protect, snapshot, trim
from worker_ext.extension.base import ExtensionBase, mem_value
from worker_ext.extension.rpc import log, rank_of, rpc
from worker_ext.pools import ALL_TAGS, KV_CACHE, WEIGHTS

AUDIT_RANGES = 64  # unnamed ranges listed in an audit with detail (all are counted)


def _kv_word(kv: Any) -> str:
    """What a sleep does with the KV cache: "keep" (docs/contracts.md §1.3) or "discard"."""
    word = str(kv)
    if word not in ("keep", "discard"):
        raise ValueError(f"kv must be 'keep' or 'discard', not {word!r}")
    return word


class _PrepareFailed(RuntimeError):
    """hotswap_sleep's prepare failed, here or on another rank (`failed_ranks`, as the
    ranks' agreement says): nothing was released (the backend re-raises it once its queued
    copies are done)."""

    def __init__(self, message: str, failed_ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks or []


def _prepare_failed(e: _PrepareFailed) -> dict[str, Any]:
    return {"ok": False, "error": str(e), "failed_step": "prepare", "failed_ranks": e.failed_ranks}


class _KvBytesLost(RuntimeError):
    """A record released before the prepare holds bytes the prepare's range plan protects:
    they are gone (the rank is failed)."""


def _kv_spans(backend: Any) -> tuple[tuple[int, int], ...]:
    return tuple((s, e) for s, e, tag in backend.records() if tag == KV_CACHE)


def _kv_droppable(
    backend: Any, cover: protect.Protection
) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """The KV records no protected or unnamed range of `cover` touches, with the KV
    records they were judged among (HotswapState.kv_droppable)."""
    spans = _kv_spans(backend)
    hit = [(a, b) for a, b, tag in (*cover.protect, *cover.unnamed) if tag == KV_CACHE]
    free = tuple(s for s, e in spans if not any(a < e and s < b for a, b in hit))
    return spans, free


def _check_released(
    backend: Any, cover: protect.Protection | None, released: tuple[int, ...]
) -> None:
    """Raise _KvBytesLost if `cover` protects anything in a record released early."""
    if not released:
        return
    if cover is None:
        raise _KvBytesLost("the KV cache first: protection by object cannot tell what was lost")
    early = set(released)
    gone = [(s, e) for s, e in _kv_spans(backend) if s in early]
    rows = (*cover.protect, *cover.unnamed)
    lost = [(a, b) for a, b, _tag in rows for s, e in gone if a < e and s < b]
    if lost:
        raise _KvBytesLost(
            f"the KV cache first: {len(lost)} protected ranges were in records released "
            f"before the prepare ({sum(b - a for a, b in lost)} bytes lost)"
        )


def _rewritten(snap: snapshot.Snapshot) -> list[tuple[int, int]]:
    """The ranges a snapshot writes back after the wake (its protection by range)."""
    return [(s, e) for s, e, _tag in snap.protection.protect] if snap.protection else []


class SleepRPCs(ExtensionBase):
    """hotswap_audit, hotswap_prepare, hotswap_suspend and hotswap_sleep."""

    @rpc
    def hotswap_audit(self, level: int, detail: bool = True) -> dict[str, Any]:
        self._hotswap_fault("audit")
        records = self._hotswap_records()
        rows = self._hotswap_audit_rows(int(level), records)
        risky = [r for r in rows if r["at_risk"]]
        mode = self._hotswap_protect_mode()
        cover = self._hotswap_protection(int(level), records, always=True)
        lost = cover.unnamed_bytes if cover is not None and mode != "ranges" else 0
        out: dict[str, Any] = {
            "level": int(level),
            "count": len(rows),
            "bytes": sum(r["bytes"] for r in rows),
            "at_risk": [r["name"] for r in risky],
            "at_risk_bytes": sum(r["bytes"] for r in risky),
            "protection": mode,
            "pools": cover.pools if cover is not None else {},
            "unnamed_bytes": cover.unnamed_bytes if cover is not None else 0,
            # what a sleep at this level would lose unseen (by object: the unnamed ranges)
            "unprotected_bytes": lost,
        }
        if detail:
            out["tensors"] = rows
            out["unnamed"] = (
                [cover.describe((a, b), pool) for a, b, pool in cover.unnamed[:AUDIT_RANGES]]
                if cover is not None
                else []
            )
        return out

    def _hotswap_audit_rows(
        self, level: int, records: list[ownership.TensorRecord] | None = None
    ) -> list[dict[str, Any]]:
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        st = self._hotswap_state()
        if not st.backend.suspended():
            st.backend.refresh()
        recs = self._hotswap_records() if records is None else records
        return ownership.judge(recs, level, st.backend.tag_of)

    def _hotswap_take_snapshot(
        self,
        level: int,
        keep: bool,
        copied: Callable[[], None] | None = None,
        released: tuple[int, ...] = (),
    ) -> tuple[snapshot.Snapshot, protect.Protection | None, set[str], dict[str, float]]:
        """What a prepare at `level` takes (hotswap_prepare, and once ahead of time the warm
        prepare, which drops it): the walk's records, the audit, the protection plan and
        the snapshot, timed by step. Returns the snapshot, its protection by range (None:
        by object), the at-risk names and the timings. `released`: KV records released
        before it (their bytes gone): _KvBytesLost if the plan protects anything in them.
        A plan that discards the KV cache notes which KV records it protects nothing in."""
        st = self._hotswap_state()
        t0 = time.perf_counter()
        records = self._hotswap_records()
        t1 = time.perf_counter()
        # a sleep that keeps the KV cache cannot be demoted (cumem.demote_refusal)
        cover_level = level if keep else self._hotswap_cover_level(level)
        cover = self._hotswap_protection(cover_level, records)
        _check_released(st.backend, cover, released)
        if cover is not None and not keep:
            st.kv_droppable = _kv_droppable(st.backend, cover)
        t2 = time.perf_counter()
        # the range plan names what the level loses as the audit would (no second pass)
        if cover is not None and cover_level == level:
            at_risk = set(cover.at_risk)
        else:
            at_risk = {r["name"] for r in self._hotswap_audit_rows(level, records) if r["at_risk"]}
        t3 = time.perf_counter()
        # by range, the ranges hold every at-risk tensor's bytes: no copy per object
        backups = set() if cover is not None else at_risk
        steps: dict[str, float] = {}
        snap = snapshot.prepare(
            level,
            records,
            backups,
            torch.cuda.is_available(),
            cover,
            st.backend.device,
            st.settings.verify_kernel,
            keep_kv=keep,
            copied=copied,
            steps=steps,
        )
        timings = {
            "records_s": t1 - t0,
            "protect_plan_s": t2 - t1,
            "audit_s": t3 - t2,
            "snapshot_s": time.perf_counter() - t3,
            **steps,
        }
        return snap, cover, at_risk, timings

    @rpc
    def hotswap_prepare(self, level: int, kv: str = "discard") -> dict[str, Any]:
        self._hotswap_fault("prepare")
        trim.release_compile_workers()  # compiled and warm: the pool need not sleep with it
        level = int(level)
        kv = _kv_word(kv)
        st = self._hotswap_state()
        if st.backend.suspended():
            raise RuntimeError(f"pools already suspended: {st.backend.suspended()}")
        st.snap = None  # a failed prepare must not leave an older snapshot to verify against
        refusal = self._hotswap_kv_refusal(level) if kv == "keep" else None
        keep = kv == "keep" and refusal is None
        if keep:
            st.backend.prepare_kv_keep()  # CUDA: the KV cache's host buffer, pinned meanwhile
        snap, cover, at_risk, timings = self._hotswap_take_snapshot(level, keep)
        st.snap = snap
        return self._hotswap_prepared(level, keep, refusal, snap, cover, at_risk, timings)

    def _hotswap_prepared(
        self,
        level: int,
        keep: bool,
        refusal: str | None,
        snap: snapshot.Snapshot,
        cover: protect.Protection | None,
        at_risk: set[str],
        timings: dict[str, float],
    ) -> dict[str, Any]:
        """A prepare's answer (hotswap_prepare's keys; hotswap_sleep's prepare part)."""
        st = self._hotswap_state()
        return {
            "level": level,
            "kv": "keep" if keep else "discard",
            "kv_reason": refusal,
            "kv_bytes": st.backend.pools().get(KV_CACHE, 0),
            "kv_fingerprinted": len(snap.kv_names),
            "protection": "ranges" if cover is not None else "objects",
            "protected": len(snap.protected) + len(snap.ranges),
            "protected_bytes": snap.protected_bytes,
            "protected_ranges": len(snap.ranges),
            "unnamed_ranges": len(snap.unnamed),
            "unnamed_bytes": sum(r.end - r.start for r in snap.unnamed),
            "pools": cover.pools if cover is not None else {},
            "demotable": self._hotswap_demotable(snap),
            "fingerprinted": len(snap.entries) + len(snap.unnamed),
            "at_risk": sorted(at_risk),
            "timings": timings,
        }

    def _hotswap_cover_level(self, level: int) -> int:
        """The level a prepare protects by range: a level-1 sleep on a backend that maps in
        place also protects what a level-2 wake needs (HOTSWAP_DEMOTABLE=1: off by default,
        on under a host budget), so hotswap_demote can follow it; else the level itself."""
        st = self._hotswap_state()
        able = callable(getattr(st.backend, "demote", None))
        if level == 1 and st.backend.in_place and st.settings.demotable and able:
            return 2
        return level

    def _hotswap_kv_refusal(self, level: int) -> str | None:
        """Why this rank cannot keep the KV cache across a sleep at `level` (None: it can);
        docs/contracts.md §1.3."""
        if level != 1:
            return "level 2 discards the weights; the KV cache is kept at level 1 only"
        worker = cast(Any, self)
        cache = getattr(worker, "cache_config", None)
        if cache is not None and not getattr(cache, "enable_prefix_caching", False):
            return "prefix caching is off in this engine: nothing would hit after the wake"
        if getattr(worker, "kv_transfer_config", None) is not None:
            return (
                "a KV connector (kv_transfer_config) is configured: its blocks live outside "
                "this engine's pools and its own cache would be out of step"
            )
        return self._hotswap_state().backend.kv_keep_refusal()

    def _hotswap_protect_mode(self) -> str:
        """`ranges` where the backend maps pools back in place and the tuning's protect is not
        `objects`; else `objects` (the host backend: docs/contracts.md §1.2)."""
        st = self._hotswap_state()
        by_range = st.backend.in_place and st.settings.tuning.protect == "ranges"
        return "ranges" if by_range else "objects"

    def _hotswap_protection(
        self,
        level: int,
        records: list[ownership.TensorRecord],
        always: bool = False,
    ) -> protect.Protection | None:
        """What a sleep at `level` protects by range; None when protection is by object
        (with `always`, where the backend maps in place, what ranges would protect)."""
        if self._hotswap_protect_mode() != "ranges" and not (
            always and self._hotswap_state().backend.in_place
        ):
            return None
        b = self._hotswap_state().backend
        return protect.plan(level, b.records(), records, b.tag_of, b.free_ranges())

    @rpc
    def hotswap_suspend(
        self, level: int, tags: list[str] | None = None, kv: str = "discard"
    ) -> dict[str, Any]:
        level = int(level)
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        kv = _kv_word(kv)
        st = self._hotswap_state()
        snap = st.snap
        if snap is None or snap.level < level:
            raise RuntimeError(f"call hotswap_prepare({level}) before suspending")
        chosen = list(ALL_TAGS) if tags is None else [str(t) for t in tags]
        unknown = [t for t in chosen if t not in ALL_TAGS]
        if unknown or not chosen:
            raise ValueError(f"tags must be a non-empty subset of {list(ALL_TAGS)}: {chosen}")
        asleep = [t for t in chosen if t in st.backend.suspended()]
        if asleep:
            raise RuntimeError(f"pools already suspended: {asleep}")
        keep = kv == "keep"
        if keep and (level != 1 or snap.kv_plan is None or KV_CACHE not in chosen):
            raise RuntimeError(
                "kv 'keep' needs level 1, the kv_cache pool, and a hotswap_prepare(1, 'keep') "
                "that answered kv 'keep'"
            )
        if not keep and KV_CACHE in chosen:
            snap.forget_kv()  # discarded after all (the controller fell back): not verified
        # Weights first: on CUDA the offload copy of weights must not race the KV discard.
        chosen.sort(key=lambda t: (t != WEIGHTS, t))
        before = st.backend.memory()
        self._hotswap_fault("suspend")
        with self._hotswap_step("suspend") as ph:
            res = st.backend.suspend(level, chosen, keep_kv=keep, rewritten=_rewritten(snap))
        st.level = level
        ph.suspended(level, st.backend.suspended())
        return self._hotswap_suspended(level, chosen, kv, res, before)

    def _hotswap_suspended(
        self, level: int, chosen: list[str], kv: str, res: dict[str, Any], before: dict[str, int]
    ) -> dict[str, Any]:
        """A suspend's answer (hotswap_suspend's keys; hotswap_sleep's suspend part)."""
        st = self._hotswap_state()
        # what the suspend's own scratch freed after its trim: not kept while it sleeps
        cache_s = st.backend.release_cached()
        host_trim = trim.release_host_memory()  # asleep: what the host need not keep
        after = st.backend.memory()
        resident = st.backend.resident()
        timings = {
            **res.get("timings", {}),
            "cache_release_s": cache_s,
            "host_trim_s": host_trim["s"],
        }
        return {
            "level": level,
            "tags": chosen,
            "kv": kv,
            "resident_bytes": resident["bytes"],
            "resident": resident,
            "wake_scratch_bytes": st.backend.wake_scratch_bytes(),
            "host_backup_bytes": st.backend.host_backup_bytes(),
            "timings": timings,
            "host_trim": host_trim,
            "freed_bytes": res.get("freed_bytes", {}),
            "offloaded_bytes": res.get("offloaded_bytes", {}),
            "memory_before": mem_value(before),
            "memory_after": mem_value(after),
        }

    @rpc
    def hotswap_sleep(self, level: int) -> dict[str, Any]:
        """The sleep's prepare and suspend fused (docs/contracts.md §1): every pool
        suspended, the KV cache discarded, in one round trip. Where the backend offloads
        with copies (CUDA, level 1) the prepare runs under them: the backend queues the
        copies, calls the prepare, and releases nothing before the prepare's device work and
        each record's own copy are done. A failed prepare leaves every pool mapped."""
        level = int(level)
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        st = self._hotswap_state()
        if st.backend.suspended():
            raise RuntimeError(f"pools already suspended: {st.backend.suspended()}")
        st.snap = None  # a failed prepare must not leave an older snapshot to verify against
        trim.release_compile_workers()  # compiled and warm: the pool need not sleep with it
        chosen = sorted(ALL_TAGS, key=lambda t: (t != WEIGHTS, t))
        prepared: dict[str, Any] = {}
        began = time.perf_counter()
        overlap = bool(getattr(st.backend, "overlaps_prepare", False))
        early = self._hotswap_early_kv() if overlap else ()
        prepare = self._hotswap_sleep_prepare(level, prepared, early)
        if not overlap:  # nothing to run it under: the prepare first, as hotswap_prepare
            try:
                rewritten = prepare(None)
            except _PrepareFailed as e:
                log.error("hotswap: hotswap_sleep's prepare failed on rank %s: %s",
                          rank_of(self), e)  # fmt: skip
                return _prepare_failed(e)
        before = st.backend.memory()
        t_suspend = time.perf_counter()
        try:
            self._hotswap_fault("suspend")  # before any memory step, as hotswap_suspend's
        except Exception as e:
            log.exception("hotswap: hotswap_sleep refused on rank %s", rank_of(self))
            return {"ok": False, "error": f"{type(e).__name__}: {e}", "failed_step": "suspend"}
        try:
            if overlap:
                res = st.backend.suspend(
                    level, chosen, keep_kv=False, during=prepare, early_kv=early
                )
            else:
                res = st.backend.suspend(level, chosen, keep_kv=False, rewritten=rewritten)
        except _PrepareFailed as e:  # the backend waited for its copies and released nothing
            st.snap = None
            log.error("hotswap: hotswap_sleep's prepare failed on rank %s: %s", rank_of(self), e)
            return _prepare_failed(e)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # a memory step failed: the rank is failed (§1.1)
            log.exception("hotswap: hotswap_sleep's suspend failed on rank %s", rank_of(self))
            st.phase.failed(f"suspend: {type(e).__name__}: {e}")
            return {"ok": False, "error": f"{type(e).__name__}: {e}", "failed_step": "suspend"}
        suspend_s = time.perf_counter() - t_suspend
        st.level = level
        st.phase.suspended(level, st.backend.suspended())
        t_answer = time.perf_counter()
        out = {**prepared, **self._hotswap_suspended(level, chosen, "discard", res, before)}
        timings = {**prepared.get("timings", {}), **out.get("timings", {})}
        timings.update(
            prepare_s=prepared.pop("prepare_s", 0.0),
            suspend_s=suspend_s,
            answer_s=time.perf_counter() - t_answer,  # the host trim, what it holds now
            sleep_s=time.perf_counter() - began,
        )
        out.pop("prepare_s", None)
        out["timings"] = timings
        out["overlapped"] = overlap and bool(res.get("overlapped"))  # copies were under it
        return out

    def _hotswap_early_kv(self) -> tuple[int, ...]:
        """The KV records a fused sleep releases before its prepare (its tuning's `kv_early`): those
        the last prepare protected nothing in, if the KV records are still the ones it saw."""
        st = self._hotswap_state()
        known = st.kv_droppable
        if not st.settings.tuning.kv_early or known is None or _kv_spans(st.backend) != known[0]:
            return ()
        return known[1]

    def _hotswap_sleep_prepare(
        self, level: int, prepared: dict[str, Any], released: tuple[int, ...] = ()
    ) -> Callable[[Callable[[], None] | None], list[tuple[int, int]]]:
        """hotswap_sleep's prepare, its answer put in `prepared`; the ranks agree on every
        prepare's outcome before any of them releases anything else. `released`: the KV
        records the backend released before it (bytes found lost there fail the rank)."""
        st = self._hotswap_state()

        def prepare(go_on: Callable[[], None] | None = None) -> list[tuple[int, int]]:
            """The prepare; `go_on` (the backend's): queue the rest of the weights' copies,
            called once the protected ranges' copies are queued ahead of them."""
            t = time.perf_counter()
            try:
                self._hotswap_fault("prepare")
                snap, cover, at_risk, timings = self._hotswap_take_snapshot(
                    level, keep=False, copied=go_on, released=released
                )
            except BaseException as e:
                agreed = st.quiescer.agree(False)  # so that no other rank releases either
                if isinstance(e, _KvBytesLost):
                    raise  # not a prepare to answer: this rank lost bytes (failed)
                raise _PrepareFailed(f"{type(e).__name__}: {e}", agreed["failed_ranks"]) from e
            t_agree = time.perf_counter()
            agreed = st.quiescer.agree(True)  # every rank's prepare done, before any release
            timings["agree_s"] = time.perf_counter() - t_agree
            if not agreed["ok"]:
                why = agreed["error"] or f"the prepare failed on ranks {agreed['failed_ranks']}"
                raise _PrepareFailed(f"{why}: nothing released", agreed["failed_ranks"])
            st.snap = snap
            prepared.update(
                self._hotswap_prepared(level, False, None, snap, cover, at_risk, timings)
            )
            prepared["prepare_s"] = time.perf_counter() - t
            return _rewritten(snap)

        return prepare
