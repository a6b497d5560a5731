"""HotSwapExtension: the hotswap_* RPC methods vLLM mixes into every worker.

Rules this class lives by (docs/contracts.md §1):
- every name starts with `hotswap_`/`_hotswap_` (a name the Worker already has aborts start);
- every method returns one plain dict (`ok`, `rank`, `elapsed_s`, `error` when not ok) and
  never raises: with TP>1 a raise desyncs vLLM's reply queues;
- `__init__` never runs (vLLM 0.26/0.32 mix the class into the Worker's bases), so the
  state is created lazily on first use.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch

from worker_ext import ownership, protect, snapshot, vllmcompat
from worker_ext.barrier import Quiescer
from worker_ext.hostpools import HostBackend
from worker_ext.phase import RankPhase
from worker_ext.pools import ALL_TAGS, KV_CACHE, WEIGHTS, PoolBackend
from worker_ext.settings import WorkerSettings

log = logging.getLogger("worker_ext")
AUDIT_RANGES = 64  # unnamed ranges listed in an audit with detail (all are counted)

F = TypeVar("F", bound=Callable[..., dict[str, Any]])


def plain(value: Any) -> Any:
    """JSON/msgpack-native copy: dict (str keys), list, str, int, float, bool, None."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return str(value)


def _rank_of(worker: Any) -> int:
    try:
        return int(worker.rank)
    except Exception:
        return -1


def rpc(fn: F) -> F:
    """Run an RPC body: time it, catch everything, always return a plain dict."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            out = dict(fn(self, *args, **kwargs))
            out.setdefault("ok", True)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            log.exception("hotswap: %s failed on rank %s", fn.__name__, _rank_of(self))
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out["rank"] = _rank_of(self)
        out["elapsed_s"] = time.monotonic() - t0
        if not out["ok"]:
            out.setdefault("error", "failed")
        try:
            return cast(dict[str, Any], plain(out))
        except BaseException as e:  # a result that cannot be made plain is still an answer
            return {
                "ok": False,
                "rank": out["rank"],
                "elapsed_s": out["elapsed_s"],
                "error": f"result not serialisable: {type(e).__name__}",
            }

    return cast(F, wrapper)


@dataclass
class _HotswapState:
    settings: WorkerSettings
    backend: PoolBackend
    quiescer: Quiescer = field(default_factory=Quiescer)
    snap: snapshot.Snapshot | None = None
    level: int | None = None
    phase: RankPhase = field(default_factory=RankPhase)
    # The prepare run once ahead of time (HOTSWAP_WARM_PREPARE): its outcome, None until then.
    warm_prepare: dict[str, Any] | None = None

    def use_settings(self, settings: WorkerSettings) -> None:
        """Tests and benches that change a variable in a live worker: the new settings."""
        self.settings = self.backend.settings = settings


def _vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:
        return "unknown"


def _cumem_active() -> bool:
    """CUDA with vLLM's CuMemAllocator holding allocations (started with sleep mode)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except Exception:
        return False
    inst = getattr(CuMemAllocator, "instance", None)
    return inst is not None and bool(getattr(inst, "pointer_to_data", None))


def _mem_value(mem: dict[str, int]) -> int:
    return int(mem.get("free", mem.get("rss", 0)))


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


def _rewritten(snap: snapshot.Snapshot) -> list[tuple[int, int]]:
    """The ranges a snapshot writes back after the wake (its protection by range)."""
    return [(s, e) for s, e, _tag in snap.protection.protect] if snap.protection else []


class HotSwapExtension:
    """Mixed into vLLM's Worker; `self` is the Worker (model_runner, rank, reload_weights)."""

    # Set on the Worker by _hotswap_state(); a class default keeps reads safe before that.
    _hotswap_st: _HotswapState | None = None

    # -- internals ----------------------------------------------------------------

    def _hotswap_state(self) -> _HotswapState:
        st = self._hotswap_st
        if st is None:
            vllmcompat.require()  # an untested vLLM: every RPC answers why (contracts §1.6)
            settings = WorkerSettings.from_env()  # read once for this worker's life
            st = _HotswapState(settings, self._hotswap_make_backend(settings))
            self._hotswap_st = st
        return st

    def _hotswap_make_backend(self, settings: WorkerSettings) -> PoolBackend:
        if torch.cuda.is_available():
            if not _cumem_active():
                raise RuntimeError(
                    "CUDA worker without an active CuMemAllocator: start vLLM with "
                    "--enable-sleep-mode"
                )
            from worker_ext.cumem import CuMemBackend  # CUDA only: vLLM's allocator

            return CuMemBackend(self, settings)
        return HostBackend(self, settings)

    def _hotswap_model(self) -> Any:
        runner = cast(Any, self).model_runner
        return runner.get_model() if runner is not None else None

    def _hotswap_records(self) -> list[ownership.TensorRecord]:
        return ownership.walk(self._hotswap_model(), cast(Any, self).model_runner)

    @contextlib.contextmanager
    def _hotswap_step(self, step: str) -> Iterator[RankPhase]:
        """A memory step under way: any error inside it leaves the rank failed."""
        ph = self._hotswap_state().phase
        try:
            yield ph
        except BaseException as e:
            ph.failed(f"{step}: {type(e).__name__}: {e}")
            raise

    def _hotswap_fault(self, point: str) -> None:
        """Test seam: subclasses raise here to prove failures stay inside the RPC."""

    def _hotswap_before_barrier(self) -> None:
        """Test seam: subclasses delay here to hold a rank past the barrier timeout."""

    def _hotswap_before_verify(self) -> None:
        """Test seam: between the write-back and the fingerprints (a corruption there must
        fail the wake)."""

    # -- RPC surface ----------------------------------------------------------------

    @rpc
    def hotswap_info(self) -> dict[str, Any]:
        self._hotswap_fault("info")
        st = self._hotswap_state()
        self._hotswap_warm_prepare()
        model = self._hotswap_model()
        try:
            from vllm.distributed.parallel_state import get_world_group

            world_size = int(get_world_group().world_size)
        except Exception:
            world_size = int(getattr(cast(Any, self).parallel_config, "world_size", 1))
        return {
            "world_size": world_size,
            "platform": "cuda" if torch.cuda.is_available() else "cpu",
            "backend": st.backend.name,
            "vllm_version": _vllm_version(),
            "model": type(model).__name__ if model is not None else None,
            "pools": st.backend.pools(),
            "device_memory": st.backend.memory(),
            "suspended": st.backend.suspended(),
            "resident": st.backend.resident(),
            "level": st.level,
            "poisoned": st.quiescer.poisoned,
            **st.phase.report(),
            "snapshot_held": st.snap is not None,
            "host_backup_bytes": st.backend.host_backup_bytes(),
            "wake_scratch_bytes": st.backend.wake_scratch_bytes(),
            "warm_prepare": st.warm_prepare,
            # the cumem backend's host buffer, verify kernel and mapping (plain values)
            "backend_detail": st.backend.describe(),
        }

    def _hotswap_warm_prepare(self) -> None:
        """Once per process, on an awake rank with no snapshot: a level-1 prepare whose
        snapshot is dropped at once, so that its first-call costs (allocator blocks, pinned
        host blocks, kernel variants for these tensors) are paid here and not by the first
        sleep. It moves no memory and changes neither phase nor transitions; a failure is
        only reported (`warm_prepare` in hotswap_info)."""
        st = self._hotswap_state()
        if not st.settings.warm_prepare or st.warm_prepare is not None:
            return
        if st.snap is not None or st.backend.suspended() or self._hotswap_model() is None:
            return
        t0 = time.perf_counter()
        try:
            snap, _cover, _at_risk, _timings = self._hotswap_take_snapshot(1, keep=False)
            st.warm_prepare = {
                "ok": True,
                "s": time.perf_counter() - t0,
                "fingerprinted": len(snap.entries) + len(snap.unnamed),
            }
            del snap
        except Exception as exc:  # reported, never raised: the real prepare will say more
            log.warning("hotswap: the prepare ahead of time failed: %s", exc)
            st.warm_prepare = {
                "ok": False,
                "s": time.perf_counter() - t0,
                "error": f"{type(exc).__name__}: {exc}",
            }

    @rpc
    def hotswap_quiesce(self, timeout_s: float) -> dict[str, Any]:
        self._hotswap_fault("quiesce")
        st = self._hotswap_state()
        return st.quiescer.run(
            float(timeout_s), _rank_of(self), before_barrier=self._hotswap_before_barrier
        )

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
        self, level: int, keep: bool, copied: Callable[[], None] | None = None
    ) -> tuple[snapshot.Snapshot, protect.Protection | None, set[str], dict[str, float]]:
        """What a prepare at `level` takes (hotswap_prepare, and once ahead of time the warm
        prepare, which drops it): the walk's records, the audit, the protection plan and
        the snapshot, timed by step. Returns the snapshot, its protection by range (None:
        by object), the at-risk names and the timings."""
        st = self._hotswap_state()
        t0 = time.perf_counter()
        records = self._hotswap_records()
        t1 = time.perf_counter()
        rows = self._hotswap_audit_rows(level, records)
        at_risk = {r["name"] for r in rows if r["at_risk"]}
        t2 = time.perf_counter()
        # a sleep that keeps the KV cache cannot be demoted (cumem.demote_refusal)
        cover_level = level if keep else self._hotswap_cover_level(level)
        cover = self._hotswap_protection(cover_level, records)
        t3 = time.perf_counter()
        # by range, the ranges hold every at-risk tensor's bytes: no copy per object
        backups = set() if cover is not None else at_risk
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
        )
        timings = {
            "records_s": t1 - t0,
            "audit_s": t2 - t1,
            "protect_plan_s": t3 - t2,
            "snapshot_s": time.perf_counter() - t3,
        }
        return snap, cover, at_risk, timings

    @rpc
    def hotswap_prepare(self, level: int, kv: str = "discard") -> dict[str, Any]:
        self._hotswap_fault("prepare")
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

    def _hotswap_demotable(self, snap: snapshot.Snapshot) -> bool:
        """hotswap_demote can follow a sleep on this snapshot: asleep at level 1, and where
        the backend maps in place, with the level-2 protection by range held."""
        b = self._hotswap_state().backend
        if snap.level != 1 or not callable(getattr(b, "demote", None)):
            return False
        if not b.in_place:
            return True  # the host backend copies the at-risk tensors when it demotes
        return snap.protection is not None and snap.protection.level >= 2

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
        after = st.backend.memory()
        resident = st.backend.resident()
        return {
            "level": level,
            "tags": chosen,
            "kv": kv,
            "resident_bytes": resident["bytes"],
            "resident": resident,
            "wake_scratch_bytes": st.backend.wake_scratch_bytes(),
            "host_backup_bytes": st.backend.host_backup_bytes(),
            "timings": res.get("timings", {}),
            "freed_bytes": res.get("freed_bytes", {}),
            "offloaded_bytes": res.get("offloaded_bytes", {}),
            "memory_before": _mem_value(before),
            "memory_after": _mem_value(after),
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
        chosen = sorted(ALL_TAGS, key=lambda t: (t != WEIGHTS, t))
        prepared: dict[str, Any] = {}
        began = time.perf_counter()

        def prepare(go_on: Callable[[], None] | None = None) -> list[tuple[int, int]]:
            """The prepare; `go_on` (the backend's): queue the rest of the weights' copies,
            called once the protected ranges' copies are queued ahead of them."""
            t = time.perf_counter()
            try:
                self._hotswap_fault("prepare")
                snap, cover, at_risk, timings = self._hotswap_take_snapshot(
                    level, keep=False, copied=go_on
                )
            except BaseException as e:
                agreed = st.quiescer.agree(False)  # so that no other rank releases either
                raise _PrepareFailed(f"{type(e).__name__}: {e}", agreed["failed_ranks"]) from e
            agreed = st.quiescer.agree(True)  # every rank's prepare done, before any release
            if not agreed["ok"]:
                why = agreed["error"] or f"the prepare failed on ranks {agreed['failed_ranks']}"
                raise _PrepareFailed(f"{why}: nothing released", agreed["failed_ranks"])
            st.snap = snap
            prepared.update(
                self._hotswap_prepared(level, False, None, snap, cover, at_risk, timings)
            )
            prepared["prepare_s"] = time.perf_counter() - t
            return _rewritten(snap)

        overlap = bool(getattr(st.backend, "overlaps_prepare", False))
        if not overlap:  # nothing to run it under: the prepare first, as hotswap_prepare
            try:
                rewritten = prepare()
            except _PrepareFailed as e:
                log.error("hotswap: hotswap_sleep's prepare failed on rank %s: %s",
                          _rank_of(self), e)  # fmt: skip
                return _prepare_failed(e)
        before = st.backend.memory()
        t_suspend = time.perf_counter()
        try:
            self._hotswap_fault("suspend")  # before any memory step, as hotswap_suspend's
        except Exception as e:
            log.exception("hotswap: hotswap_sleep refused on rank %s", _rank_of(self))
            return {"ok": False, "error": f"{type(e).__name__}: {e}", "failed_step": "suspend"}
        try:
            if overlap:
                res = st.backend.suspend(level, chosen, keep_kv=False, during=prepare)
            else:
                res = st.backend.suspend(level, chosen, keep_kv=False, rewritten=rewritten)
        except _PrepareFailed as e:  # the backend waited for its copies and released nothing
            st.snap = None
            log.error("hotswap: hotswap_sleep's prepare failed on rank %s: %s", _rank_of(self), e)
            return _prepare_failed(e)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # a memory step failed: the rank is failed (§1.1)
            log.exception("hotswap: hotswap_sleep's suspend failed on rank %s", _rank_of(self))
            st.phase.failed(f"suspend: {type(e).__name__}: {e}")
            return {"ok": False, "error": f"{type(e).__name__}: {e}", "failed_step": "suspend"}
        suspend_s = time.perf_counter() - t_suspend
        st.level = level
        st.phase.suspended(level, st.backend.suspended())
        out = {**prepared, **self._hotswap_suspended(level, chosen, "discard", res, before)}
        timings = {**prepared.get("timings", {}), **out.get("timings", {})}
        timings.update(
            prepare_s=prepared.pop("prepare_s", 0.0),
            suspend_s=suspend_s,
            sleep_s=time.perf_counter() - began,
        )
        out.pop("prepare_s", None)
        out["timings"] = timings
        out["overlapped"] = overlap and bool(res.get("overlapped"))  # copies were under it
        return out

    @rpc
    def hotswap_resume(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self._hotswap_resume(tags)

    def _hotswap_resume(self, tags: list[str] | None = None) -> dict[str, Any]:
        st = self._hotswap_state()
        asleep = st.backend.suspended()
        chosen = list(asleep) if tags is None else [str(t) for t in tags]
        unknown = [t for t in chosen if t not in asleep]
        if unknown:
            raise RuntimeError(f"pools not suspended: {unknown} (suspended: {sorted(asleep)})")
        chosen.sort(key=lambda t: (t != WEIGHTS, t))
        before = st.backend.memory()
        self._hotswap_fault("resume")
        if not chosen:  # nothing asleep: no memory step
            mem = _mem_value(before)
            return {
                "tags": [],
                "restored_bytes": {},
                "timings": {},
                "memory_before": mem,
                "memory_after": mem,
            }
        with self._hotswap_step("resume") as ph:
            res = st.backend.resume(chosen)
        ph.resumed(st.backend.suspended())
        return {
            "tags": chosen,
            "restored_bytes": res.get("restored_bytes", {}),
            "timings": res.get("timings", {}),
            "memory_before": _mem_value(before),
            "memory_after": _mem_value(st.backend.memory()),
            "host_backup_bytes": st.backend.host_backup_bytes(),
        }

    @rpc
    def hotswap_drop_backup(self) -> dict[str, Any]:
        """Awake: release the host copies kept for the next sleep (CUDA's pinned buffers);
        that sleep pins anew. Refused, before touching anything, while a pool is asleep.
        Host memory only: the rank's phase and transitions do not move."""
        st = self._hotswap_state()
        asleep = st.backend.suspended()
        if asleep:
            raise RuntimeError(f"drop_backup: not awake (pools asleep: {sorted(asleep)})")
        self._hotswap_fault("drop_backup")
        freed = st.backend.drop_backup()
        return {"freed_host_bytes": freed, "host_backup_bytes": st.backend.host_backup_bytes()}

    @rpc
    def hotswap_demote(self) -> dict[str, Any]:
        """Asleep at level 1: become level 2 (the host copy of the weights released), so the
        next wake reloads. The host backend copies the tensors a level-2 wake does not
        reload to host memory first, beside the level-1 snapshot's fingerprints; the CUDA
        backend needs them protected by range already (the level-1 prepare planned level 2:
        HOTSWAP_DEMOTABLE). Either way the wake's verification covers every byte. Refused
        before touching anything where that does not hold."""
        st = self._hotswap_state()
        snap = st.snap
        if st.level != 1 or snap is None or snap.level != 1:
            raise RuntimeError(f"demote: not asleep at level 1 (level {st.level})")
        demote = getattr(st.backend, "demote", None)
        if not callable(demote):
            raise RuntimeError(f"demote: the {st.backend.name} backend cannot demote")
        if not self._hotswap_demotable(snap):
            raise RuntimeError(
                "demote: this sleep's prepare did not protect what a level-2 wake needs "
                "(HOTSWAP_DEMOTABLE=0 or protection by object)"
            )
        refusal = getattr(st.backend, "demote_refusal", None)
        why = refusal() if callable(refusal) else None
        if why:
            raise RuntimeError(why)
        self._hotswap_fault("demote")
        at_risk: set[str] = set()
        copied = 0
        with self._hotswap_step("demote") as ph:
            if st.backend.in_place:  # by range: copied at prepare, written back at restore
                copied = sum(r.end - r.start for r in snap.ranges if r.pool == WEIGHTS)
            else:
                rows = ownership.judge([e.record for e in snap.entries], 2, st.backend.tag_of)
                at_risk = {r["name"] for r in rows if r["at_risk"]}
                for e in snap.entries:
                    if e.record.name in at_risk and e.backup is None:
                        raw = snapshot.storage_bytes(e.original)
                        e.backup = torch.empty(raw.numel(), dtype=torch.uint8)
                        e.backup.copy_(raw)
                        copied += int(raw.numel())
            res = demote()
            snap.level = 2
            st.level = 2
            ph.suspended(2, st.backend.suspended())
        return {
            "level": 2,
            "freed_bytes": res.get("freed_bytes", {}),
            "freed_host_bytes": res.get("freed_host_bytes", {}),
            "protected_bytes": copied,
            "at_risk": sorted(at_risk),
            "host_backup_bytes": st.backend.host_backup_bytes(),
        }

    @rpc
    def hotswap_reload(self) -> dict[str, Any]:
        st = self._hotswap_state()
        if WEIGHTS in st.backend.suspended():
            raise RuntimeError("resume the weights pool before reloading")
        self._hotswap_fault("reload")
        t0 = time.monotonic()
        with self._hotswap_step("reload") as ph:
            tier = st.backend.tier_restored()
            repacked: list[str] = []
            if not (tier and tier.get("used")):  # the disk tier did not bring them back
                cast(Any, self).reload_weights()
                repacked = st.backend.after_reload()
        ph.reloaded()
        source = "disk" if tier and tier.get("used") else "reload"
        return {
            "reload_s": time.monotonic() - t0,
            "repacked": repacked,
            "source": source,
            "tier": tier,
        }

    @rpc
    def hotswap_restore_and_verify(self) -> dict[str, Any]:
        return self._hotswap_restore_and_verify()

    @rpc
    def hotswap_wake(self) -> dict[str, Any]:
        """The wake's last RPC fused (docs/contracts.md §1): every pool still suspended
        mapped back, then restored and verified, in one round trip. Refused before any
        memory step without a snapshot to verify against, or at level 2 with the weights
        still asleep (they need the reload first)."""
        st = self._hotswap_state()
        if st.snap is None:
            raise RuntimeError("nothing to verify: no hotswap_prepare since the last verify")
        asleep = st.backend.suspended()
        if st.snap.level == 2 and WEIGHTS in asleep:
            raise RuntimeError(
                "level 2: resume the weights and reload them (hotswap_resume(['weights']), "
                "hotswap_reload()) before hotswap_wake"
            )
        self._hotswap_fault("wake")
        t0 = time.monotonic()
        try:
            resumed = self._hotswap_resume(None)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            log.exception("hotswap: hotswap_wake's resume failed on rank %s", _rank_of(self))
            return {"ok": False, "error": f"{type(e).__name__}: {e}", "failed_step": "resume"}
        t1 = time.monotonic()
        try:
            verified = self._hotswap_restore_and_verify()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            log.exception("hotswap: hotswap_wake's verify failed on rank %s", _rank_of(self))
            verified = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        t2 = time.monotonic()
        timings = {**resumed.pop("timings", {}), **verified.pop("timings", {})}
        timings.update(resume_s=t1 - t0, verify_elapsed_s=t2 - t1)
        out: dict[str, Any] = {**resumed, **verified, "timings": timings}
        if not verified.get("ok", True):
            out["failed_step"] = "restore_and_verify"
        return out

    def _hotswap_restore_and_verify(self) -> dict[str, Any]:
        st = self._hotswap_state()
        snap = st.snap
        if snap is None:
            raise RuntimeError("nothing to verify: no hotswap_prepare since the last verify")
        asleep = st.backend.suspended()
        if asleep:
            raise RuntimeError(f"pools still suspended: {sorted(asleep)}")
        self._hotswap_fault("restore_and_verify")
        unready = st.backend.unready()
        if unready:
            raise RuntimeError("; ".join(unready))
        with self._hotswap_step("restore_and_verify") as ph:
            t0 = time.perf_counter()
            rebound = snapshot.rebind(snap)
            t1 = time.perf_counter()
            restored = snapshot.restore(snap)  # ends when every copy on the device is done
            self._hotswap_before_verify()
            t2 = time.perf_counter()
            verified, mismatched, bad_ranges = snapshot.verify(snap)
            t3 = time.perf_counter()
        st.snap = None
        st.level = None
        out: dict[str, Any] = {
            "restored": restored,
            "rebound": rebound,
            "verified": verified,
            "kv_verified": len(snap.kv_names),  # KV storages kept and checked (§1.3)
            "kv_verified_bytes": snap.kv_bytes,
            "mismatched": mismatched,
            "mismatched_ranges": bad_ranges,
            "ok": not mismatched,
            "timings": {"rebind_s": t1 - t0, "restore_s": t2 - t1, "verify_s": t3 - t2},
        }
        if mismatched:
            what = "tensor(s) or range(s)" if bad_ranges else "tensor(s)"
            out["error"] = f"{len(mismatched)} {what} differ after resume: {mismatched[:8]}"
            ph.failed(f"restore_and_verify: {out['error']}")
        else:
            ph.verified()
        t4 = time.perf_counter()
        del snap  # the snapshot's last reference: its views, plans and host copies go now
        out["timings"]["release_s"] = time.perf_counter() - t4
        return out


__all__ = ["KV_CACHE", "HotSwapExtension", "plain", "rpc"]
