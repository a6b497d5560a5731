"""The wake's RPCs: the resume (pools mapped back), the reload (level 2), the restore and
verify, and the resume and verify fused into hotswap_wake."""

from __future__ import annotations

import time
from typing import Any, cast

from worker_ext import snapshot, vllmcompat
from worker_ext.extension.base import ExtensionBase, mem_value
from worker_ext.extension.rpc import log, rank_of, rpc
from worker_ext.pools import WEIGHTS


class WakeRPCs(ExtensionBase):
    """hotswap_resume, hotswap_reload, hotswap_restore_and_verify and hotswap_wake."""

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
            mem = mem_value(before)
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
            "memory_before": mem_value(before),
            "memory_after": mem_value(st.backend.memory()),
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
            log.exception("hotswap: hotswap_wake's resume failed on rank %s", rank_of(self))
            return {"ok": False, "error": f"{type(e).__name__}: {e}", "failed_step": "resume"}
        t1 = time.monotonic()
        try:
            verified = self._hotswap_restore_and_verify()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            log.exception("hotswap: hotswap_wake's verify failed on rank %s", rank_of(self))
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
            seen = snapshot.recheck(snap)
            if seen is not None and not mismatched:
                log.warning(
                    "hotswap: verify on rank %s: a difference seen at the first read was gone "
                    "after a device-wide wait (bytes still being written): %s",
                    rank_of(self),
                    seen,
                )
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
            # vLLM's own sleep still in force: the sidecar ends it through vLLM's /wake_up
            "vllm_sleep": vllmcompat.vllm_sleep(self),
            "ok": not mismatched,
            # the kernel check's two reads when its first saw a difference (None: it saw none)
            "verify_recheck": seen,
            # on a mismatch: whether the host copy holds the differing pieces' baseline (§1.4)
            "host_copy_check": None,
            "timings": {
                "rebind_s": t1 - t0,
                "restore_s": t2 - t1,
                "verify_s": t3 - t2,
                # 1.0: the kernel check's first read saw a difference and read again (§1.4)
                "verify_rechecked": float(seen is not None),
            },
        }
        if mismatched:
            what = "tensor(s) or range(s)" if bad_ranges else "tensor(s)"
            out["error"] = f"{len(mismatched)} {what} differ after resume: {mismatched[:8]}"
            if seen is not None:
                out["error"] += f" (kernel check: {_evidence(seen)})"
            checked = self._hotswap_host_copy_check(snap)
            out["host_copy_check"] = checked
            if checked is not None:
                out["error"] += f" (host copy: {checked.get('summary')})"
            ph.failed(f"restore_and_verify: {out['error']}")
        else:
            ph.verified()
        t4 = time.perf_counter()
        del snap  # the snapshot's last reference: its views, plans and host copies go now
        out["timings"]["release_s"] = time.perf_counter() - t4
        return out

    def _hotswap_host_copy_check(self, snap: snapshot.Snapshot) -> dict[str, Any] | None:
        """After a mismatch: the backend's look at its host copy of the differing pieces
        (None: no per-piece evidence, or a backend without a host copy to read). Never
        raises: a look that fails says so."""
        try:
            bad = snapshot.differing_pieces(snap)
            look = getattr(self._hotswap_state().backend, "check_host_copy", None)
            if not bad or not callable(look):
                return None
            return cast(dict[str, Any], look(bad))
        except Exception as e:
            log.exception("hotswap: the host copy check failed on rank %s", rank_of(self))
            return {"error": f"{type(e).__name__}: {e}", "summary": f"not checked: {e}"}


def _evidence(seen: dict[str, Any]) -> str:
    """The kernel check's two reads of a mismatch, in one line for the rank's error."""
    parts = [
        f"pieces differing {seen.get('pieces_differing')} then "
        f"{seen.get('pieces_differing_again')} after a device-wide wait"
    ]
    for name, (k, n) in list(seen.get("pieces_by_range", {}).items())[:4]:
        parts.append(f"{name}: {k}/{n} pieces")
    if "piece" in seen:
        parts.append(
            f"piece {seen['piece']}: baseline {seen.get('piece_baseline')}, kernel now "
            f"{seen.get('piece_kernel_now')}, torch now {seen.get('piece_torch_now')}"
        )
    return "; ".join(parts)
