"""The RPCs that give host memory back: the backup kept for the next sleep (awake), and a
level-1 sleep's host copy (asleep: the sleep becomes level 2)."""

from __future__ import annotations

from typing import Any

import torch

from worker_ext import ownership, snapshot
from worker_ext.extension.base import ExtensionBase
from worker_ext.extension.rpc import rpc
from worker_ext.pools import WEIGHTS


class HostMemoryRPCs(ExtensionBase):
    """hotswap_drop_backup and hotswap_demote."""

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
